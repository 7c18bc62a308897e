"""Exception types. Every error a user can cause derives from :class:`FastgateError`; the CLI prints its message on
one line and exits non-zero, without a traceback."""

from __future__ import annotations

import errno
import os

__all__ = [
    "DISK_ERRORS",
    "BackendUnavailableError",
    "CheckpointError",
    "CorpusError",
    "FastgateError",
    "IndexError_",
    "InputError",
    "InstallError",
    "MissingDependencyError",
    "ModelError",
    "OutOfMemory",
    "RemoteError",
    "ShapeError",
    "UnknownNameError",
    "WriteError",
    "disk_error",
    "out_of_memory",
    "require",
]


class FastgateError(Exception):
    """Base class of errors caused by input, configuration or environment (not by a bug)."""


class InputError(FastgateError, ValueError):
    """A question, parameter or argument is invalid."""


class UnknownNameError(InputError):
    """A method, retriever, model or backend name is not known."""

    def __init__(self, kind: str, name: str, choices: list[str] | tuple[str, ...]) -> None:
        super().__init__(f"unknown {kind} {name!r}; choose one of: {', '.join(choices)}")
        self.kind, self.name, self.choices = kind, name, tuple(choices)


class ShapeError(FastgateError, ValueError):
    """A tensor or array argument has the wrong shape or contents."""


class ModelError(FastgateError):
    """A model cannot be found, converted or loaded."""


class CheckpointError(FastgateError):
    """A prober / confidence checkpoint is missing, corrupt, or was trained for another model."""


class CorpusError(FastgateError):
    """A corpus file is missing or malformed."""


class IndexError_(FastgateError):
    """A retrieval index is missing, corrupt or built for something else."""


class RemoteError(FastgateError):
    """A remote engine's server (``--engine openai``) cannot be reached, times out, refuses a request or does not
    return what the engine needs (token log-probabilities)."""


class OutOfMemory(FastgateError):
    """The engine could not allocate the memory a batch needed (the device's or the host's): the requests running
    fail with this, the server keeps serving (fewer at once: ``--max-live``, ``--max-rows``, ``--kv-budget-mb``)."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: torch's ``OutOfMemoryError`` (CUDA), a ``MemoryError``, or the CPU
    allocator's ``RuntimeError`` ("can't allocate memory"), also inside another error: torch.compile reports a
    failure in its backend as a ``BackendCompilerFailed`` holding it (``inner_exception``; torch 2.13 sets no
    ``__cause__``), and an error raised while handling one keeps it as its context."""
    seen = 0
    while exc is not None and seen < 8:  # a chain is short; a cycle must not loop forever
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return True
        if isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc)):
            return True
        exc, seen = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__, seen + 1
    return False


class BackendUnavailableError(FastgateError):
    """An explicitly requested backend (ext, triton, faiss-gpu...) is not available here."""


class InstallError(FastgateError):
    """pip could not install a pinned data package (``fastgate prepare --install``)."""


class MissingDependencyError(FastgateError, ImportError):
    """An optional dependency is not installed."""

    def __init__(self, package: str, hint: str) -> None:
        super().__init__(f"{package} is required for this feature: {hint}")
        self.package = package


# The errors of a place fastgate writes that the user fixes (free space, permissions, a writable directory), with the
# words the CLI prints for each.
DISK_ERRORS: dict[int, str] = {
    errno.ENOSPC: "no space left on device",
    errno.EACCES: "permission denied",
    errno.EROFS: "read-only file system",
}


class WriteError(FastgateError, OSError):
    """A file or directory could not be written: the disk is full, permission is denied or the file system is
    read-only (``errno`` one of :data:`DISK_ERRORS`). An ``OSError`` that names what was written and where;
    ``str()`` is the CLI's line: ``<what> <path>: <reason>``."""

    def __init__(self, what: str, path: str | os.PathLike, code: int) -> None:
        super().__init__(code, DISK_ERRORS.get(code) or os.strerror(code), os.fspath(path))
        self.what = what

    def __str__(self) -> str:
        return f"{self.what} {self.filename}: {self.strerror}"


def disk_error(exc: BaseException, what: str, path: str | os.PathLike) -> WriteError | None:
    """The :class:`WriteError` for ``exc`` when it says the disk is full, permission is denied or the file system is
    read-only, else None (re-raise ``exc`` then). ``exc``: an ``OSError``, or a ``RuntimeError`` of a C++ library
    that reports the C error in words (faiss: ``write error in ...: No space left on device``)."""
    if isinstance(exc, WriteError):
        return exc
    if isinstance(exc, OSError):
        code = exc.errno
    elif isinstance(exc, RuntimeError):
        code = next((c for c in DISK_ERRORS if os.strerror(c) in str(exc)), None)
    else:
        code = None
    return WriteError(what, path, code) if code in DISK_ERRORS else None


def require(module: str, hint: str):
    """Import an optional heavy dependency lazily, with an install hint on failure."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(module, hint) from exc
