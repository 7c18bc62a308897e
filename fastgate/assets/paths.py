"""Where fastgate keeps converted models and indexes: ``$FASTGATE_HOME`` (default ``~/.cache/fastgate``)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

__all__ = ["home", "index_dir", "models_dir", "remove_stale"]


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: Path, prefix: str) -> list[Path]:
    """Remove ``directory/<prefix><pid>-*`` entries left by a process that no longer runs (a killed conversion or
    index build); entries of another live process are kept (a concurrent build). Names without a pid (left by
    versions that did not record it) are removed too. Returns what was removed."""
    removed = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if not entry.name.startswith(prefix):
            continue
        pid_text = entry.name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit() and _pid_alive(int(pid_text)) and int(pid_text) != os.getpid():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        removed.append(entry)
    return removed
