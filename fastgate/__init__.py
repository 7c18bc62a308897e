"""fastgate: adaptive retrieval-augmented generation that reads the model's own signals.

Heavy pieces (transformers, tantivy, faiss) are imported lazily by the modules that need them.
"""

from __future__ import annotations

from fastgate.config import GenerationConfig, TapSpec
from fastgate.errors import FastgateError, InputError, UnknownNameError
from fastgate.version import __version__

__all__ = [
    "Engine",
    "FastgateError",
    "GenerationConfig",
    "InputError",
    "TapSpec",
    "UnknownNameError",
    "__version__",
    "build_method",
    "load_model",
]


def __getattr__(name: str):
    if name == "Engine":
        from fastgate.engine.local import Engine

        return Engine
    if name == "load_model":
        from fastgate.assets.models import load

        return load
    if name == "build_method":
        from fastgate.methods import build_method

        return build_method
    raise AttributeError(f"module 'fastgate' has no attribute {name!r}")
