"""Where fastgate keeps converted models and indexes: ``$FASTGATE_HOME`` (default ``~/.cache/fastgate``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["home", "index_dir", "models_dir", "one_builder", "remove_stale", "writable_dir"]


def _root() -> Path:
    return Path(os.environ.get("FASTGATE_HOME", Path.home() / ".cache" / "fastgate")).expanduser()


def _unusable(path: Path, exc: OSError):
    """The error for a directory under ``$FASTGATE_HOME`` (or the home itself) that cannot be made or written."""
    from fastgate.errors import InputError

    root = _root()
    where = f"FASTGATE_HOME {root}" if path == root else f"{path} (in FASTGATE_HOME {root})"
    return InputError(f"{where} is not a usable directory ({exc.strerror or exc}); set FASTGATE_HOME to a writable "
                      "directory")


def _make_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on the path (ENOTDIR), no permission, ...: a traceback before
        raise _unusable(path, exc) from None
    return path


def home() -> Path:
    """The cache root, created on demand."""
    return _make_dir(_root())


def models_dir() -> Path:
    """Converted HF model directories."""
    return _make_dir(home() / "models")


def writable_dir(path: Path) -> Path:
    """``path`` (created if need be) once a file could be made in it: a probe file, removed at once. What is about to
    spend minutes building something there calls it first (a read-only ``$FASTGATE_HOME`` failed only when the
    conversion wrote its result, 100 s later); ``os.access`` would not do: root passes it on any mode bits.

    Raises:
        InputError: the directory cannot be made or written (no permission, a read-only file system, ...)."""
    _make_dir(path)
    try:
        fd, probe = tempfile.mkstemp(prefix=f".write-probe-{os.getpid()}-", dir=path)
    except OSError as exc:
        raise _unusable(path, exc) from None
    os.close(fd)
    os.unlink(probe)
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


@contextlib.contextmanager
def one_builder(target: Path, waiting: str = "") -> Iterator[None]:
    """The block run by one process at a time among those that enter it for the same ``target``: an advisory
    ``flock`` of ``.<name>.lock`` beside it, the file removed by its holder on the way out (so nothing stays behind;
    a process that locked a file since removed takes the new one), and dropped by the kernel if its holder dies.
    Processes that prepare the same thing at once (Ray Serve replicas or pytest-xdist workers starting on an empty
    ``$FASTGATE_HOME``, two CLI runs) take turns: each checks for the result inside the block, so the later ones find
    the first one's instead of building it again and replacing it under its readers (readers take no lock: a forced
    rebuild still replaces an index under them). ``waiting`` is printed to stderr when another process holds the
    lock. No lock where ``fcntl`` is missing (Windows) or the lock file cannot be made (a read-only directory, where
    nothing can be built either: the build then says why)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    target = Path(target).resolve()  # every route to the directory, symlinks included, takes the same file
    lock = target.parent / f".{target.name}.lock"
    told = False
    while True:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)  # flock needs no write access
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting and not told:
                print(waiting, file=sys.stderr)
                told = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except OSError:  # removed by the holder before us
            same = False
        if same:
            break
        os.close(fd)  # the file we locked was removed on the way out: lock the current one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # before the unlock: a waiter then finds its file gone and takes a new one
        os.close(fd)
