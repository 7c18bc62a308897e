"""Where fastgate keeps converted models and indexes: ``$FASTGATE_HOME`` (default ``~/.cache/fastgate``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["home", "index_dir", "models_dir"]


def home() -> Path:
    """The cache root, created on demand."""
    root = Path(os.environ.get("FASTGATE_HOME", Path.home() / ".cache" / "fastgate")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    """Converted HF model directories."""
    path = home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def index_dir(corpus_name: str) -> Path:
    """Default index directory of a corpus (holds ``bm25/`` and ``dense/``)."""
    path = home() / "indexes" / corpus_name
    path.mkdir(parents=True, exist_ok=True)
    return path
