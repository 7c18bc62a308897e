"""Probing-RAG prober decision for B requests × L layers: fastgate vs torch eager vs the released formulation.

Providers, on the same probers and hidden states in one run:
- ``fastgate``: ``probe_logits`` on the running sums the engine keeps during decoding: the fused Triton kernel on GPU
  (mean, LN, three linears for all B×L in one launch), the batched einsum reference on CPU;
- ``torch_eager``: one ``nn.Module`` prober per layer, called layer by layer on the mean of the running sums;
- ``probing_rag``: the released code's shape: per request and layer, the mean of the stored hidden states of the u
  rationale+answer tokens, then that layer's prober (O(L·u·d) per decision instead of O(L·d)).

Run: python bench/bench_probe.py [--dims 576,2048,4096] [--batches 1,8,64,256] [--layers 6] [--hidden 512]
Appends to bench/results/probe.csv; on GPU also GB/s (weights + sums read once).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, median_time, print_table  # noqa: E402

from fastgate.gates.checkpoints import Prober, stack_probers  # noqa: E402
from fastgate.ops import build_ops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="576,2048,4096")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--layers", type=int, default=6, help="probed layers (Gemma-2B: 6, 8, …, 16)")
    parser.add_argument("--hidden", type=int, default=512, help="prober width (Probing-RAG: 512)")
    parser.add_argument("--tokens", type=int, default=32, help="rationale+answer tokens u for the stored-states path")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops = build_ops("auto", device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n_layers, h, u = args.layers, args.hidden, args.tokens
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        torch.manual_seed(0)
        probers = [Prober(d, h).eval().to(device) for _ in range(n_layers)]
        params = stack_probers(probers).to(device)
        for b in (int(x) for x in args.batches.split(",")):
            states = torch.randn(b, n_layers, u, d, device=device)  # [B, L, u, d] per-token states (stored path)
            sums = states.sum(2)  # [B, L, d] what the engine's running sums hold
            counts = torch.full((b,), float(u), device=device)

            @torch.inference_mode()
            def eager():
                x = sums / counts[:, None, None]
                return torch.stack([probers[layer](x[:, layer]) for layer in range(n_layers)], 1)

            @torch.inference_mode()
            def released():
                return torch.stack([torch.stack([probers[layer](states[i, layer].mean(0)) for layer in
                                                 range(n_layers)]) for i in range(b)])

            def timed(fn, repeat=5):
                def call():
                    fn()
                    sync()
                return median_time(call, repeat=repeat, min_time=0.02)

            torch.testing.assert_close(ops.probe_logits(sums, counts, params), eager(), rtol=1e-3, atol=1e-4)
            t_fast = timed(lambda: ops.probe_logits(sums, counts, params))
            t_eager = timed(eager)
            t_rel = timed(released, repeat=3)
            row = {"op": "probe_logits", "provider": ops.backend, "d": d, "B": b, "L": n_layers, "h": h, "u": u,
                   "fastgate_us": t_fast * 1e6, "torch_eager_us": t_eager * 1e6, "probing_rag_us": t_rel * 1e6,
                   "speedup_vs_eager": t_eager / t_fast, "speedup_vs_probing_rag": t_rel / t_fast}
            if device == "cuda":
                nbytes = sum(t.numel() * t.element_size() for t in params) + sums.numel() * sums.element_size()
                row["gbps"] = nbytes / t_fast / 1e9
            rows.append(row)
            path = append_rows('probe', [row])  # written as measured: a run cut short keeps its rows
            print_table([row], ["d", "B", "fastgate_us", "torch_eager_us", "probing_rag_us", "speedup_vs_eager",
                                "speedup_vs_probing_rag"])
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
