"""BM25 retrieval on tantivy (on-disk index, English stemming on title and text)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import unicodedata
import weakref
from collections.abc import Iterable
from pathlib import Path

from fastgate.assets.corpus import Passage, corpus_fingerprint
from fastgate.errors import IndexError_, require
from fastgate.retrieval.base import Hit, atomic_index_dir, check_k, read_manifest

__all__ = ["BM25Retriever", "build_bm25_index", "query_terms"]

_HINT = "pip install tantivy"


def _term_char(ch: str) -> bool:
    """A character of a word as the index's tokenizer reads it: letters and digits, and the combining marks (vowel
    signs, viramas, diacritics) that Python's word pattern leaves out: it split हिन्दी, กรุงเทพมหานคร and القاهرةُ, which
    the index holds whole, into terms that matched nothing."""
    return ch.isalnum() or unicodedata.category(ch).startswith("M")


def query_terms(query: str) -> str:
    """Reduce free text to space-separated lower-case word terms, so no query-syntax character can break parsing."""
    return " ".join("".join(ch if _term_char(ch) else " " for ch in query.lower()).split())


def _schema(tantivy):
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("id", stored=True, tokenizer_name="raw")
    sb.add_text_field("title", stored=True, tokenizer_name="en_stem")
    sb.add_text_field("text", stored=True, tokenizer_name="en_stem")
    return sb.build()


def build_bm25_index(passages: Iterable[Passage], out_dir: str | Path, corpus_name: str = "",
                     progress: bool = False, heap_mb: int = 256, corpus_path: str | None = None) -> Path:
    """Build (atomically) a tantivy index of ``passages`` at ``out_dir`` (``corpus_path``: the corpus file, recorded
    in its manifest)."""
    tantivy = require("tantivy", _HINT)
    passages = list(passages)
    meta = {"corpus": corpus_name, "n_passages": len(passages), "corpus_fingerprint": corpus_fingerprint(passages)}
    if corpus_path:
        meta["corpus_path"] = corpus_path
    with atomic_index_dir(Path(out_dir), "bm25", meta) as tmp:
        index = tantivy.Index(_schema(tantivy), path=str(tmp))
        writer = index.writer(heap_size=heap_mb * 1_000_000, num_threads=1)
        it = passages
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(passages, desc="bm25 index", unit="doc")
        for p in it:
            writer.add_document(tantivy.Document(id=p.id, title=p.title, text=p.text))
        writer.commit()
        writer.wait_merging_threads()
    return Path(out_dir)


def _remove_shadow(path: Path, pid: int, attempts: int = 5) -> None:
    """Remove the directory of links (in the process that made it). Again if something is left: tantivy's watcher
    thread polls the index's meta.json and, finding its link gone mid-removal, may make `.tantivy-meta.lock` anew
    before the directory itself is removed (a full test run left the directory once)."""
    if os.getpid() != pid:
        return
    for attempt in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists() or attempt == attempts - 1:
            return
        time.sleep(0.01 * (attempt + 1))


def _denied(exc: BaseException) -> bool:
    """Whether tantivy could not write or read a file for want of permission (its errors carry the OS's words)."""
    return any(w in str(exc) for w in ("Read-only file system", "PermissionDenied", "Permission denied"))


class BM25Retriever:
    """Top-k passages by BM25 over title + text.

    Args:
        index_dir: a directory built by :func:`build_bm25_index` (``fastgate index``).
    """

    name = "bm25"

    def __init__(self, index_dir: str | Path) -> None:
        tantivy = require("tantivy", _HINT)
        self.index_dir = Path(index_dir)
        self.manifest = read_manifest(self.index_dir, "bm25")
        self._shadow: weakref.finalize | None = None  # removes the directory of links to a read-only index (below)
        try:
            self._index, self._searcher = self._open(tantivy, self.index_dir)
        except (ValueError, OSError, RuntimeError) as exc:
            failed = f"cannot open the bm25 index at {self.index_dir}: {exc}"
            if not _denied(exc):
                raise IndexError_(f"{failed}; rebuild it") from None
            # tantivy creates and locks `.tantivy-meta.lock` in the index directory even to search, so an index on a
            # read-only mount, or in a directory of another user's without that file, cannot be opened where it is.
            # Its files are only read: a private directory of links to them takes the lock instead
            try:
                shadow = Path(tempfile.mkdtemp(prefix="fastgate-bm25-"))  # 0700, a random name
            except OSError as exc2:
                raise IndexError_(f"{failed}; nor make a directory of links to its files ({exc2}): set TMPDIR to "
                                  "a directory this user can write") from None
            # removed when this retriever goes or the process ends, by the process that made it (not a forked child)
            self._shadow = weakref.finalize(self, _remove_shadow, shadow, os.getpid())
            try:
                for entry in self.index_dir.iterdir():
                    if not entry.name.startswith(".tantivy-"):  # the lock files are made anew beside the links
                        (shadow / entry.name).symlink_to(entry.resolve())
                self._index, self._searcher = self._open(tantivy, shadow)
            except (ValueError, OSError, RuntimeError) as exc2:
                self._shadow()
                raise IndexError_(f"{failed}; nor through links to its files in a directory of this user's "
                                  f"({exc2}): its files must be readable by this user") from None
        count = self.manifest.get("n_passages")
        if isinstance(count, bool) or not isinstance(count, int):
            raise IndexError_(f"the manifest of the bm25 index at {self.index_dir} has no passage count "
                              f"(n_passages: {count!r}); rebuild it")
        if self._searcher.num_docs != count:
            raise IndexError_(
                f"bm25 index at {self.index_dir} has {self._searcher.num_docs} documents but its manifest says "
                f"{count}; rebuild it"
            )

    @staticmethod
    def _open(tantivy, path: Path):
        index = tantivy.Index.open(str(path))
        index.reload()
        return index, index.searcher()

    def close(self) -> None:
        """Remove the directory of links a read-only index was opened through (if any); the searcher keeps the files
        it has open. Also done when the retriever is collected or the process ends."""
        if self._shadow is not None:
            self._shadow()

    def __len__(self) -> int:
        return int(self._searcher.num_docs)

    def search(self, query: str, k: int = 3) -> list[Hit]:
        check_k(k)
        terms = query_terms(query)
        if not terms:
            return []
        q = self._index.parse_query(terms, ["title", "text"])
        hits = []
        try:  # a segment file lost after the index opened (tantivy reads them lazily): every search would fail
            for score, address in self._searcher.search(q, k).hits:
                doc = self._searcher.doc(address)
                passage = Passage(id=doc["id"][0], title=doc["title"][0], text=doc["text"][0])
                hits.append(Hit(passage, float(score)))
        except (ValueError, OSError, RuntimeError) as exc:
            raise IndexError_(f"the bm25 index at {self.index_dir} cannot be searched ({exc}); rebuild it with "
                              "`fastgate index`") from None
        return hits

    def search_batch(self, queries: list[str], k: int = 3) -> list[list[Hit]]:
        return [self.search(q, k) for q in queries]
