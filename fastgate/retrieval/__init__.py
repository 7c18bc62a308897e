"""Retrieval: BM25 on tantivy and dense vectors on FAISS behind one :class:`Retriever` interface."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastgate.assets.corpus import DEFAULT_CORPUS, load_corpus
from fastgate.assets.paths import index_dir, one_builder
from fastgate.errors import IndexError_, InputError, UnknownNameError
from fastgate.retrieval.base import Hit, Retriever, check_replaceable

__all__ = ["RETRIEVERS", "BM25Retriever", "DenseRetriever", "Hit", "Retriever", "build_indexes", "check_index_root",
           "corpus_fingerprint_of", "open_retriever"]

RETRIEVERS = ("bm25", "dense")


def __getattr__(name: str):
    if name == "BM25Retriever":
        from fastgate.retrieval.bm25 import BM25Retriever

        return BM25Retriever
    if name == "DenseRetriever":
        from fastgate.retrieval.dense import DenseRetriever

        return DenseRetriever
    raise AttributeError(name)


def check_index_root(index: str | Path | None) -> None:
    """Refuse an ``--index`` that does not exist, before anything loads, whatever the method: one that searches
    nothing answered as if it were right (the retrievers say what is missing inside one that exists).

    Raises:
        InputError: naming the flag and how to build one."""
    if index is not None and not Path(index).expanduser().exists():
        raise InputError(f"--index {index} does not exist (build one with `fastgate index --out {index}`, or leave "
                         "--index out for the default corpus's)")


def open_retriever(kind: str = "bm25", index_root: str | Path | None = None, *, build_default: bool = True,
                   **kwargs) -> Retriever:
    """Open the ``bm25`` or ``dense`` index under ``index_root`` (default: the default corpus's cached indexes).

    With ``build_default`` the default corpus's index is built on first use (with progress bars); a custom
    ``index_root`` must exist.
    """
    if kind not in RETRIEVERS:
        raise UnknownNameError("retriever", kind, RETRIEVERS)
    if index_root is None:
        root = index_dir(DEFAULT_CORPUS)
        if build_default and not (root / kind / "fastgate_index.json").is_file():
            build_indexes(DEFAULT_CORPUS, root, kinds=(kind,), progress=True)
    else:
        root = Path(index_root)
    if kind == "bm25":
        from fastgate.retrieval.bm25 import BM25Retriever

        return BM25Retriever(root / "bm25")
    from fastgate.retrieval.dense import DenseRetriever

    return DenseRetriever(root / "dense", **kwargs)


def corpus_fingerprint_of(index_root: str | Path | None, kind: str) -> str | None:
    """The fingerprint of the corpus the ``kind`` index under ``index_root`` (default: the default corpus's) was built
    from, as its manifest names it; None where there is no readable manifest (an index not built yet)."""
    root = index_dir(DEFAULT_CORPUS) if index_root is None else Path(index_root)
    try:
        manifest = json.loads((root / kind / "fastgate_index.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("corpus_fingerprint") if isinstance(manifest, dict) else None


def build_indexes(corpus: str | Path = DEFAULT_CORPUS, out_root: str | Path | None = None,
                  kinds: tuple[str, ...] = RETRIEVERS, *, hnsw: bool = False, progress: bool = True,
                  force: bool = False) -> dict[str, Path]:
    """Build the requested indexes of a corpus under ``out_root/<kind>``; up-to-date ones are kept unless ``force``."""
    from fastgate.assets.corpus import corpus_fingerprint

    for kind in kinds:
        if kind not in RETRIEVERS:
            raise UnknownNameError("retriever", kind, RETRIEVERS)
    if out_root is not None and Path(out_root).exists() and not Path(out_root).is_dir():
        raise InputError(f"{out_root} is a file: the indexes go in a directory (--out)")
    name, passages = load_corpus(corpus)
    root = Path(out_root) if out_root is not None else index_dir(name)
    for kind in kinds:  # all refused before any is built: `--retriever all` built bm25, then refused dense/
        check_replaceable(root / kind)
    fingerprint = corpus_fingerprint(passages)
    source = None if str(corpus) in (DEFAULT_CORPUS, "default") else str(Path(corpus).resolve())
    # another corpus's index is replaced only when asked: a user's corpus file named like the default one silently
    # became every later search's index, and `--out DIR` holding another corpus's index was rebuilt without a word.
    # The default corpus's directory is its own (a new version of its package rebuilds it); elsewhere a corpus of the
    # same name and file is taken for the same corpus, edited (its index is rebuilt, as before); of the same name from
    # another file (two users' `docs.jsonl`), for another corpus: each build of one replaced the other's index
    default_root = root == index_dir(DEFAULT_CORPUS)
    if not force and not (default_root and source is None):
        for kind in kinds:
            other = _other_corpus(root / kind / "fastgate_index.json", fingerprint, None if default_root else name,
                                  source)
            if other is not None:
                raise InputError(f"{root / kind} holds the {kind} index of another corpus ({other}); build this "
                                 "one under another directory (--out), or pass --force to replace it")
    built: dict[str, Path] = {}
    for kind in kinds:
        target = root / kind
        manifest = target / "fastgate_index.json"
        seen = _stamp(manifest)
        if force or not _up_to_date(manifest, kind, fingerprint, hnsw, say=progress):
            # one build of an index at a time (processes starting together on a fresh cache): a process that waited
            # finds the index the first one built (up to date, or, forced, newer than it was) and keeps it
            with one_builder(target, f"fastgate: waiting for another process building {target}" if progress else ""):
                if not _up_to_date(manifest, kind, fingerprint, hnsw) or (force and _stamp(manifest) == seen):
                    _build_index(kind, name, passages, target, hnsw=hnsw, progress=progress, source=source)
        elif progress:
            print(f"fastgate: {kind} index of {name} is up to date ({target})", file=sys.stderr)
        built[kind] = target
    return built


def _other_corpus(manifest: Path, fingerprint: str, name: str | None, source: str | None = None) -> str | None:
    """What the index of ``manifest`` was built from ("name, N passages") where that is another corpus than the one
    of ``fingerprint`` and named ``name`` from the file ``source`` (``name`` None: any other content is another
    corpus); None where it is this corpus (or an edit of it: the same name, and the same file where the manifest
    names one; indexes built before 2026-11-30 name none), or there is no readable manifest (nothing to keep)."""
    try:
        current = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(current, dict) or current.get("corpus_fingerprint") in (None, fingerprint):
        return None
    built_from = current.get("corpus_path")
    if name is not None and current.get("corpus") == name and built_from in (None, source):
        return None
    where = f" from {built_from}" if built_from else ""
    return f"{current.get('corpus', '?')}{where}, {current.get('n_passages', '?')} passages"


def _stamp(manifest: Path) -> tuple[int, int] | None:
    """The manifest's modification time and inode (None: none): a build since then changed it."""
    try:
        st = manifest.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ino


def _up_to_date(manifest: Path, kind: str, fingerprint: str, hnsw: bool, say: bool = False) -> bool:
    """Whether the index's manifest names this corpus and, for ``dense``, the asked index type, and the index opens
    (a deleted or truncated file: "up to date" and kept before, and every search then failed with "rebuild it")."""
    try:
        current = json.loads(manifest.read_text())
    except (OSError, ValueError):  # unreadable, not JSON or not UTF-8: rebuilt
        return False
    same_type = kind != "dense" or current.get("index_type") == ("hnsw" if hnsw else "flat_ip")
    return current.get("corpus_fingerprint") == fingerprint and same_type and _opens(manifest.parent, kind, say)


def _opens(path: Path, kind: str, say: bool) -> bool:
    """Whether the ``kind`` index at ``path`` opens and agrees with its manifest (the retrievers' own checks; the
    dense one without loading the embedder); ``say``: why not, on stderr."""
    try:
        if kind == "bm25":
            from fastgate.retrieval.bm25 import BM25Retriever

            BM25Retriever(path)
        else:
            from fastgate.retrieval.dense import read_dense_index

            read_dense_index(path)
    except IndexError_ as exc:
        if say:
            print(f"fastgate: {str(exc).removesuffix('; rebuild it')}: building it again", file=sys.stderr)
        return False
    return True


def _build_index(kind: str, name: str, passages, target: Path, *, hnsw: bool, progress: bool,
                 source: str | None = None) -> None:
    """One index of :func:`build_indexes`, its lock held (``source``: the corpus file, None for the default)."""
    if progress:
        print(f"fastgate: building the {kind} index of {name} ({len(passages)} passages) in {target}",
              file=sys.stderr)
    if kind == "bm25":
        from fastgate.retrieval.bm25 import build_bm25_index

        build_bm25_index(passages, target, corpus_name=name, progress=progress, corpus_path=source)
    else:
        from fastgate.retrieval.dense import build_dense_index

        build_dense_index(passages, target, corpus_name=name, hnsw=hnsw, progress=progress, corpus_path=source)
