"""The retriever interface, typed hits and atomic on-disk index directories."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fastgate.assets.corpus import Passage
from fastgate.assets.paths import remove_stale
from fastgate.errors import IndexError_, InputError

__all__ = ["Hit", "Retriever", "atomic_index_dir", "check_replaceable", "cleanup_killed_builds", "read_manifest"]

MANIFEST = "fastgate_index.json"
INDEX_FORMAT = 1


@dataclass(frozen=True)
class Hit:
    """A retrieved passage with its retriever score (higher is better)."""

    passage: Passage
    score: float

    @property
    def id(self) -> str:
        return self.passage.id

    @property
    def title(self) -> str:
        return self.passage.title

    @property
    def text(self) -> str:
        return self.passage.text


@runtime_checkable
class Retriever(Protocol):
    """What every retriever offers."""

    name: str

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """Top-k hits for one query, best first."""
        ...

    def search_batch(self, queries: list[str], k: int = 3) -> list[list[Hit]]:
        """Top-k hits for each query, in input order."""
        ...


def check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:  # True is an int
        raise InputError(f"k must be a positive integer, got {k!r}")


def cleanup_killed_builds(target: Path) -> list[Path]:
    """Remove what killed builds of ``target`` left beside it: ``.<name>.building-<pid>-*`` directories and
    ``.<name>.old-<pid>-*`` previous indexes of processes that no longer run (concurrent builds of live processes are
    left alone). A build killed between moving the old index aside and moving the new one in leaves no ``target``:
    the old index is then put back, so the index keeps answering. Returns what was removed."""
    target = Path(target)
    parent = target.parent
    if not target.exists():
        stale_old = [p for p in parent.glob(f".{target.name}.old-*") if _dead_owner(p, f".{target.name}.old-")]
        complete = [p for p in stale_old if (p / MANIFEST).is_file()]
        if complete:
            os.replace(max(complete, key=lambda p: p.stat().st_mtime), target)
    return remove_stale(parent, f".{target.name}.building-") + remove_stale(parent, f".{target.name}.old-")


def _dead_owner(path: Path, prefix: str) -> bool:
    pid = path.name[len(prefix):].split("-", 1)[0]
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return int(pid) == os.getpid()


def check_replaceable(target: Path) -> None:
    """Refuse a build into ``target`` where what is there is not an index (no manifest): the user's own files, which
    a build's swap would delete."""
    if target.exists() and not (target.is_dir() and (target / MANIFEST).is_file()):
        raise InputError(f"{target} exists and is not a fastgate index (no {MANIFEST}): it would be replaced; move it "
                         "away or build the indexes under another directory (--out)")


@contextmanager
def atomic_index_dir(target: Path, kind: str, meta: dict[str, Any]) -> Iterator[Path]:
    """Build an index in a temporary sibling directory and move it into place only when complete.

    The manifest is written last; a crash mid-build leaves the previous index (or none), never a half one, and the
    next build removes what a killed one left (:func:`cleanup_killed_builds`).
    """
    target = Path(target)
    check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    cleanup_killed_builds(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-{os.getpid()}-", dir=target.parent))
    try:
        yield tmp
        manifest = {"kind": kind, "format": INDEX_FORMAT, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users of a shared index out
        for part in tmp.iterdir():  # and tantivy writes meta.json and .managed.json 0600
            if part.is_file():
                os.chmod(part, part.stat().st_mode | 0o444)
        trash = None
        if target.exists():
            trash = target.parent / f".{target.name}.old-{os.getpid()}-{time.time_ns()}"
            os.replace(target, trash)
        os.replace(tmp, target)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_manifest(path: Path, kind: str) -> dict[str, Any]:
    """Validate an index directory and return its manifest, or raise a clear :class:`IndexError_`."""
    path = Path(path)
    if not path.is_dir():
        raise IndexError_(f"no {kind} index at {path}; build it with `fastgate index`")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise IndexError_(f"{path} is not a complete {kind} index (no {MANIFEST}); rebuild it with `fastgate index`")
    try:
        manifest = json.loads(manifest_file.read_text())
    except (ValueError, OSError) as exc:  # ValueError: not JSON, or not UTF-8 text at all
        raise IndexError_(f"{manifest_file} is corrupt ({exc}); rebuild it with `fastgate index`") from None
    if not isinstance(manifest, dict):
        raise IndexError_(f"{manifest_file} is not a manifest (a JSON object); rebuild it with `fastgate index`")
    if manifest.get("kind") != kind:
        raise IndexError_(f"{path} holds a {manifest.get('kind')!r} index, not {kind!r}")
    if manifest.get("format") != INDEX_FORMAT:
        raise IndexError_(f"{path} has index format {manifest.get('format')}, expected {INDEX_FORMAT}; rebuild it")
    return manifest
