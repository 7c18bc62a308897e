"""Dense retrieval on FAISS over MiniLM embeddings (inner product of unit vectors = cosine).

``IndexFlatIP`` by default (exact); ``hnsw=True`` builds ``IndexHNSWFlat`` for large corpora. A GPU FAISS build is used
when importable and CUDA is up (``pip install .[gpu]``), the CPU index otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from fastgate.assets.corpus import Passage, corpus_fingerprint
from fastgate.assets.embedder import Embedder, shared_embedder
from fastgate.errors import IndexError_, disk_error, require
from fastgate.retrieval.base import Hit, atomic_index_dir, check_k, read_manifest

__all__ = ["DenseRetriever", "build_dense_index", "read_dense_index"]

_HINT = "pip install faiss-cpu (or faiss-gpu-cu12 on a CUDA machine: pip install .[gpu])"


def build_dense_index(passages: Iterable[Passage], out_dir: str | Path, embedder: Embedder | None = None,
                      corpus_name: str = "", hnsw: bool = False, hnsw_m: int = 32, progress: bool = False,
                      corpus_path: str | None = None) -> Path:
    """Embed ``passages`` (title + text) and build (atomically) a FAISS index with its ids and passages
    (``corpus_path``: the corpus file, recorded in its manifest).

    Raises:
        WriteError: ``out_dir`` cannot be written (disk full, permission denied, read-only); the build directory is
            removed and a previous index stays as it was.
    """
    faiss = require("faiss", _HINT)
    passages = list(passages)
    embedder = embedder or shared_embedder()
    vectors = embedder.encode([f"{p.title}. {p.text}" if p.title else p.text for p in passages], progress=progress,
                              desc="dense index")  # [n, dim]
    dim = vectors.shape[1]
    if hnsw:
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexFlatIP(dim)
    index.add(vectors)
    meta = {"corpus": corpus_name, "n_passages": len(passages), "corpus_fingerprint": corpus_fingerprint(passages),
            "embedder": embedder.name, "dim": dim, "index_type": "hnsw" if hnsw else "flat_ip"}
    if corpus_path:
        meta["corpus_path"] = corpus_path
    try:
        with atomic_index_dir(Path(out_dir), "dense", meta) as tmp:  # a temporary sibling, renamed when complete
            faiss.write_index(index, str(tmp / "index.faiss"))  # faiss reports a failed write as a RuntimeError
            np.save(tmp / "vectors.npy", vectors)
            with open(tmp / "passages.jsonl", "w", encoding="utf-8") as f:
                for p in passages:
                    f.write(json.dumps(p.to_dict(), ensure_ascii=False) + "\n")
    except (OSError, RuntimeError) as exc:
        err = disk_error(exc, "cannot write the dense index", out_dir)
        if err is None:
            raise
        raise err from None
    return Path(out_dir)


def read_dense_index(index_dir: str | Path) -> tuple[dict[str, Any], Any, list[Passage]]:
    """The manifest, the FAISS index and the passages of a dense index directory, checked against each other;
    :class:`IndexError_` where a file is missing, corrupt or disagrees."""
    faiss = require("faiss", _HINT)
    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir, "dense")
    try:
        index = faiss.read_index(str(index_dir / "index.faiss"))
    except (RuntimeError, OSError) as exc:
        raise IndexError_(f"cannot read the dense index at {index_dir}: {exc}; rebuild it") from None
    passages: list[Passage] = []
    try:
        with open(index_dir / "passages.jsonl", encoding="utf-8") as f:
            for line in f:
                passages.append(Passage(**json.loads(line)))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
        raise IndexError_(f"the dense index at {index_dir} has corrupt passages ({exc}); rebuild it") from None
    if index.ntotal != len(passages) or index.ntotal != manifest.get("n_passages"):
        raise IndexError_(f"the dense index at {index_dir} is inconsistent ({index.ntotal} vectors, "
                          f"{len(passages)} passages); rebuild it")
    return manifest, index, passages


class DenseRetriever:
    """Top-k passages by cosine similarity of MiniLM embeddings.

    Args:
        index_dir: a directory built by :func:`build_dense_index` (``fastgate index``).
        embedder: the query embedder; must be the one the index was built with (default: the packaged MiniLM).
        device: ``auto`` uses GPU FAISS when available, ``cpu`` forces the CPU index, ``gpu`` requires GPU FAISS.
    """

    name = "dense"

    def __init__(self, index_dir: str | Path, embedder: Embedder | None = None, device: str = "auto") -> None:
        faiss = require("faiss", _HINT)
        self.index_dir = Path(index_dir)
        self.manifest, index, self.passages = read_dense_index(self.index_dir)
        self._row = {p.id: i for i, p in enumerate(self.passages)}
        self._vectors: np.ndarray | None = None
        self.embedder = embedder or shared_embedder("cpu" if device == "cpu" else "auto")
        if self.embedder.dim != index.d:
            raise IndexError_(f"the dense index has dimension {index.d} but the embedder gives {self.embedder.dim}")
        self.on_gpu = False
        if device in ("auto", "gpu"):
            gpu_ok = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
            if gpu_ok:
                self._gpu_res = faiss.StandardGpuResources()
                index = faiss.index_cpu_to_gpu(self._gpu_res, 0, index)
                self.on_gpu = True
            elif device == "gpu":
                from fastgate.errors import BackendUnavailableError

                raise BackendUnavailableError("GPU FAISS is not available: pip install .[gpu] on a CUDA machine")
        self._index = index

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int = 3) -> list[Hit]:
        return self.search_batch([query], k)[0]

    def search_vectors(self, vectors: np.ndarray, k: int = 3) -> list[list[Hit]]:
        """Top-k for precomputed unit query vectors ``[B, dim]``."""
        check_k(k)
        k = min(k, len(self.passages))
        scores, ids = self._index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)  # [B, k], [B, k]
        return [[Hit(self.passages[j], float(s)) for s, j in zip(row_s, row_i) if j >= 0]
                for row_s, row_i in zip(scores, ids)]

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit vectors ``[n, dim]`` of ``texts`` with the index's embedder."""
        return self.embedder.encode(texts)

    def passage_vectors(self, hits: list[Hit]) -> np.ndarray:
        """The stored unit vectors ``[n, dim]`` of ``hits`` (memory-mapped from ``vectors.npy``)."""
        if self._vectors is None:
            try:
                self._vectors = np.load(self.index_dir / "vectors.npy", mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise IndexError_(f"cannot read {self.index_dir / 'vectors.npy'} ({exc}); rebuild the index") from None
            if self._vectors.shape != (len(self.passages), self._index.d):
                raise IndexError_(f"{self.index_dir / 'vectors.npy'} has shape {self._vectors.shape}; rebuild it")
        return np.ascontiguousarray(self._vectors[[self._row[h.id] for h in hits]], dtype=np.float32)

    def search_batch(self, queries: list[str], k: int = 3) -> list[list[Hit]]:
        check_k(k)
        if not queries:
            return []
        # an empty query has no meaning to search for (BM25 finds nothing): the embedding of "" ranked passages anyway
        asked = [i for i, q in enumerate(queries) if q.strip()]
        out: list[list[Hit]] = [[] for _ in queries]
        if asked:
            for i, hits in zip(asked, self.search_vectors(self.embedder.encode([queries[i] for i in asked]), k)):
                out[i] = hits
        return out
