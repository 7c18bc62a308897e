"""Retrieval latency on the default corpus for a batch of queries: BM25 (tantivy) vs dense FAISS (flat, HNSW) vs a
numpy brute-force reference, and the query-embedding cost the dense paths add.

Run: python bench/bench_retrieval.py [--batches 1,8,64] [--k 5]. Appends to bench/results/retrieval.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, median_time, print_table, require  # noqa: E402

from fastgate.eval.datasets import country_capitals  # noqa: E402
from fastgate.retrieval import open_retriever  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()
    faiss = require("faiss", "pip install faiss-cpu (a dependency of fastgate: pip install -e . installs it)")
    bm25, dense = open_retriever("bm25"), open_retriever("dense")
    vectors = np.load(dense.index_dir / "vectors.npy")  # [N, dim]
    hnsw = faiss.IndexHNSWFlat(vectors.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(vectors)
    questions = [e.question for e in country_capitals()]
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        qs = (questions * (b // len(questions) + 1))[:b]
        qv = dense.embed(qs)  # [b, dim]
        exact = np.argsort(-(qv @ vectors.T), axis=1)[:, : args.k]
        t_bm25 = median_time(lambda: bm25.search_batch(qs, args.k), repeat=5)
        t_embed = median_time(lambda: dense.embed(qs), repeat=5)
        t_flat = median_time(lambda: dense.search_vectors(qv, args.k), repeat=5)
        t_hnsw = median_time(lambda: hnsw.search(qv, args.k), repeat=5)
        t_numpy = median_time(lambda: np.argpartition(-(qv @ vectors.T), args.k, axis=1), repeat=5)
        flat_ids = [[dense._row[h.id] for h in hs] for hs in dense.search_vectors(qv, args.k)]
        recall = float(np.mean([len(set(a) & set(e)) / args.k for a, e in zip(hnsw.search(qv, args.k)[1], exact)]))
        assert all(set(f) == set(e) for f, e in zip(flat_ids, exact.tolist()))
        rows.append({"op": "search", "B": b, "k": args.k, "passages": len(dense), "bm25_us": t_bm25 * 1e6,
                     "embed_us": t_embed * 1e6, "faiss_flat_us": t_flat * 1e6, "faiss_hnsw_us": t_hnsw * 1e6,
                     "numpy_bruteforce_us": t_numpy * 1e6, "hnsw_recall": recall,
                     "flat_speedup_vs_numpy": t_numpy / t_flat})
    print_table(rows, ["B", "bm25_us", "embed_us", "faiss_flat_us", "faiss_hnsw_us", "numpy_bruteforce_us",
                       "hnsw_recall"])
    print(f"appended to {append_rows('retrieval', rows)}")


if __name__ == "__main__":
    main()
