"""fastgate's version, in a module of its own so that any layer can read it without importing the package's facade
(``fastgate/__init__.py`` reaches into the engine, the models and the methods)."""

__all__ = ["__version__"]

__version__ = "0.1.0"  # keep equal to pyproject.toml's (tests/test_imports.py checks)
