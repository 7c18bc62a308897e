"""Eigenscore (op 2, docs/ARCHITECTURE.md) for B requests of k samples: fastgate vs torch eager vs the papers'
formulations.

Providers, all on the same z [B, k, d] in one run:
- ``fastgate``: what ``build_ops("auto")`` binds: the fused Triton kernel on GPU (one launch for B requests); on CPU
  the C++ op of ``fastgate._C`` (float64 Gram with SIMD, in-place Cholesky, threads over requests);
- ``torch_batched``: fastgate's batched torch reference (float64 Gram of feature-centred rows in cache-sized chunks,
  batched Cholesky), what ``FASTGATE_BACKEND=torch`` runs;
- ``torch_eager``: the same math one request at a time (centre, Gram, ``torch.logdet``), unbatched;
- ``seakr``: SeaKR's released formulation per request, a d×d centring matrix ``J_d``, ``einsum('ij,jk,lk->il')``,
  ``logdet``;
- ``inside``: INSIDE's per request, ``torch.cov`` then SVD (its covariance form; compared for cost only).

``--max-reference-s S`` bounds SeaKR's reference only: where its loop over the B requests would take longer than S
seconds (one request's time × B), one request is timed and ``seakr_us`` is that × B (``seakr_extrapolated`` true; the
printed table marks it and ``speedup_vs_seakr`` with ``*`` and a footnote). The other references are always timed.

Run: python bench/bench_eigenscore.py [--dims 576,2048,4096] [--batches 1,8,64,256] [--k 20]
Appends to bench/results/eigenscore.csv. On GPU it also reports GB/s against reading z once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, median_time, print_table  # noqa: E402

from fastgate.ops import build_ops  # noqa: E402
from fastgate.ops.reference import eigenscore as eigenscore_reference  # noqa: E402


def seakr_per_request(z: torch.Tensor, alpha: float = 1e-3) -> torch.Tensor:
    """SeaKR's code: for each request, J_d = I - 11ᵀ/d, Σ = z J_d zᵀ, logdet(Σ + αI)/k."""
    out = []
    for zb in z:
        k, d = zb.shape
        j_d = torch.eye(d, device=z.device) - torch.ones(d, d, device=z.device) / d
        sigma = torch.einsum("ij,jk,lk->il", zb, j_d, zb)
        out.append(torch.logdet(sigma + alpha * torch.eye(k, device=z.device)) / k)
    return torch.stack(out)


def inside_per_request(z: torch.Tensor, alpha: float = 1e-3) -> torch.Tensor:
    """INSIDE's code: torch.cov of the k embeddings, then the log of its singular values."""
    out = []
    for zb in z:
        cov = torch.cov(zb)  # [k, k]
        s = torch.linalg.svdvals(cov + alpha * torch.eye(zb.shape[0], device=z.device))
        out.append(torch.log(s).mean())
    return torch.stack(out)


def eager_per_request(z: torch.Tensor, alpha: float = 1e-3) -> torch.Tensor:
    out = []
    for zb in z:
        zc = zb.double() - zb.double().mean(-1, keepdim=True)
        out.append(torch.logdet(zc @ zc.T + alpha * torch.eye(zb.shape[0], dtype=torch.float64, device=z.device))
                   / zb.shape[0])
    return torch.stack(out).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="576,2048,4096")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--k", type=int, default=20, help="samples per request (SeaKR: 20)")
    parser.add_argument("--max-reference-s", type=float, default=20.0,
                        help="SeaKR's reference only (the others are always timed): where its loop over the B "
                             "requests would take longer than this many seconds (one request's time x B), time one "
                             "request and report seakr_us as that x B (seakr_extrapolated; marked * in the table) "
                             "(default: %(default)s)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops = build_ops("auto", device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            torch.manual_seed(0)
            base = torch.randn(b, 1, d, device=device)
            z = base + 0.3 * torch.randn(b, args.k, d, device=device)  # [B, k, d], correlated like real samples

            def timed(fn, repeat=5):
                def call():
                    fn()
                    sync()
                return median_time(call, repeat=repeat, min_time=0.02)

            want = eigenscore_reference(z)
            got = ops.eigenscore(z)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(seakr_per_request(z[:2]).float(), want[:2], rtol=1e-2, atol=5e-2)
            t_fast = timed(lambda: ops.eigenscore(z))
            t_batched = timed(lambda: eigenscore_reference(z))
            t_eager = timed(lambda: eager_per_request(z), repeat=3)
            one = timed(lambda: seakr_per_request(z[:1]), repeat=3)
            t_seakr = timed(lambda: seakr_per_request(z), repeat=3) if one * b < args.max_reference_s else one * b
            t_inside = timed(lambda: inside_per_request(z), repeat=3)
            row = {"op": "eigenscore", "provider": ops.backend, "d": d, "B": b, "k": args.k,
                   "fastgate_us": t_fast * 1e6, "torch_batched_us": t_batched * 1e6, "torch_eager_us": t_eager * 1e6,
                   "seakr_us": t_seakr * 1e6,
                   "inside_us": t_inside * 1e6, "speedup_vs_seakr": t_seakr / t_fast,
                   "speedup_vs_eager": t_eager / t_fast, "speedup_vs_inside": t_inside / t_fast,
                   "speedup_vs_batched": t_batched / t_fast,
                   "seakr_extrapolated": one * b >= args.max_reference_s}
            if device == "cuda":
                row["gbps_read_z_once"] = z.numel() * z.element_size() / t_fast / 1e9
            rows.append(row)
            path = append_rows('eigenscore', [row])  # written as measured: a run cut short keeps its rows
            shown = dict(row)
            if row["seakr_extrapolated"]:  # the table marks what was not timed
                for key in ("seakr_us", "speedup_vs_seakr"):
                    shown[key] = f"{row[key]:.4g}*"
            print_table([shown], ["provider", "d", "B", "fastgate_us", "torch_batched_us", "torch_eager_us",
                                  "seakr_us", "inside_us", "speedup_vs_seakr", "speedup_vs_eager"])
    if any(r["seakr_extrapolated"] for r in rows):
        print(f"* extrapolated: SeaKR's loop over the B requests would pass --max-reference-s {args.max_reference_s:g} "
              "s; one request timed, times B (seakr_extrapolated in the rows)")
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
