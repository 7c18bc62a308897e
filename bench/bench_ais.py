"""DTR's adaptive information selection for B questions: AIS scores of the 2n candidates and the top-k.

Providers, in one run:
- ``ext``: ``ais_topk_batch`` in the C++ extension (scores + top-k for all B in one call, GIL released);
- ``numpy``: fastgate's numpy fallback of the same op;
- ``loop``: DTR's released formulation, a Python loop with ``np.dot`` / ``arccos`` per (question, document), then a
  sort per question.

``ext_GBps`` is the rate at which the C++ op reads its inputs. Once Q, P and D outgrow the caches (d=4096, B=256 is
42 MB) the op runs at the machine's memory bandwidth, and the speedup over the loop is capped by how long the loop's
Python takes per document compared with reading that document's 16 KB.

Run: python bench/bench_ais.py [--dims 384,576,2048,4096] [--batches 1,8,64,256] [--docs 10] [--k 3]
[--mode angle|sum|adaptive].
Appends to bench/results/ais.csv.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, median_time, print_table  # noqa: E402

from fastgate import ops  # noqa: E402


def per_document_loop(Q: np.ndarray, P: np.ndarray, D: np.ndarray, k: int, mode: str = "angle"
                      ) -> tuple[np.ndarray, list[list[int]]]:
    """The formulation of DTR's released code: one np.dot / arccos per (query, document), then a sort per query.
    ``adaptive`` is its ``consider_adaptive=True`` branch (q·p clipped here, as fastgate does)."""
    out = np.zeros(D.shape[:2], dtype=np.float32)
    top = []
    for b in range(D.shape[0]):
        for j in range(D.shape[1]):
            s1 = float(np.clip(np.dot(D[b, j], Q[b]), -1, 1))
            s2 = float(np.clip(np.dot(D[b, j], P[b]), -1, 1))
            if mode == "adaptive":
                alpha = 0.05848 * math.acos(float(np.clip(np.dot(Q[b], P[b]), -1, 1))) + 0.45520
                out[b, j] = -(alpha * math.acos(s1) + (1 - alpha) * math.acos(s2))
            elif mode == "sum":
                out[b, j] = s1 + s2
            else:
                out[b, j] = math.cos(math.acos(s1) + math.acos(s2))
        top.append(sorted(range(D.shape[1]), key=lambda j: -out[b, j])[:k])
    return out, top


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dims", default="384,576,2048,4096", help="384: the MiniLM embeddings DTR scores in fastgate")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--docs", type=int, default=10, help="documents per query (DTR: union of two top-5 lists)")
    parser.add_argument("--k", type=int, default=3, help="documents kept (DTR: 3)")
    parser.add_argument("--mode", default="angle", choices=ops.AIS_MODES, help="AIS form (DTR eq. 7: angle)")
    args = parser.parse_args()
    if not ops.ext_available():
        sys.exit("fastgate._C is not built: pip install -e .")
    ext, py = ops.build_ops("ext", "cpu"), ops.build_ops("python", "cpu")
    rng = np.random.default_rng(0)
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for B in (int(x) for x in args.batches.split(",")):
            Q, P = unit(rng.normal(size=(B, d))), unit(rng.normal(size=(B, d)))
            D = unit(rng.normal(size=(B, args.docs, d)))  # [B, n, d]
            Qt, Pt, Dt = torch.from_numpy(Q), torch.from_numpy(P), torch.from_numpy(D)
            mode = args.mode
            scores, top = per_document_loop(Q, P, D, args.k, mode)
            s_ext, i_ext = ext.ais_topk_batch(Qt, Pt, Dt, args.k, mode)
            np.testing.assert_allclose(s_ext.numpy(), np.take_along_axis(scores, i_ext.numpy(), 1), atol=1e-5)
            t_ext = median_time(lambda: ext.ais_topk_batch(Qt, Pt, Dt, args.k, mode))
            t_np = median_time(lambda: py.ais_topk_batch(Qt, Pt, Dt, args.k, mode))
            t_loop = median_time(lambda: per_document_loop(Q, P, D, args.k, mode), repeat=3)
            # bytes the op must read at least once: Q, P and D. At large B·n·d this bounds ext_us from below, and the
            # loop reads the same bytes plus ~15 µs of Python per (question, document): the ratio shrinks as d grows.
            read_gb = (Q.nbytes + P.nbytes + D.nbytes) / 1e9
            rows.append({"op": "ais_topk_batch", "mode": mode, "d": d, "B": B, "n": args.docs, "k": args.k,
                         "ext_us": t_ext * 1e6, "numpy_us": t_np * 1e6, "loop_us": t_loop * 1e6,
                         "speedup_vs_loop": t_loop / t_ext, "speedup_vs_numpy": t_np / t_ext,
                         "ext_GBps": read_gb / t_ext})
    print_table(rows, ["d", "B", "n", "ext_us", "numpy_us", "loop_us", "speedup_vs_loop", "speedup_vs_numpy",
                       "ext_GBps"])
    print(f"appended to {append_rows('ais', rows)}")


if __name__ == "__main__":
    main()
