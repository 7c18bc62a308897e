"""A prompt chunk's causal attention (op ``prefill_attention``): torch's SDPA against the blocked bf16 CPU op.

Designs, each on the same bf16 inputs (random, SmolLM2's heads unless ``--heads``):
- ``sdpa-bf16``: the reference, torch's SDPA in bf16 (its CPU flash kernel; what HF's forward runs);
- ``sdpa-fp32``: the same in float32 (inputs cast first, cast included);
- ``blocked``: :func:`fastgate.ops.prefill.blocked_prefill_attention`, torch operations (a CPU without AVX512-BF16);
- ``ext``: the C++ kernel (:func:`fastgate.ops.prefill.ext_prefill_attention`), where the CPU has AVX512-BF16.

With ``--dtype float32`` (a float32 model's chunks), on float32 inputs: ``sdpa-fp32`` (torch's SDPA), ``ext-fp32``
(the float32 C++ kernel at the CPU's width: 16 floats with AVX-512, else 8) and ``ext-fp32-w8`` (8 wide, where the CPU
has AVX-512: what an AVX2 CPU runs); errors against float64 attention, the speedup over ``sdpa-fp32``
(``vs_sdpa_fp32``). Rows name the inputs' dtype.

Each row: a chunk of ``n`` queries after ``start`` cached columns; milliseconds (median), GFLOP/s of the causal work
(two products of ``n × (start + n/2) × D`` per head), the speedup over ``sdpa-bf16`` and the max / mean error against
float32 attention of the same inputs.

Run: python bench/bench_prefill_attention.py [--chunks 700:0,430:0,512:512,64:700] [--heads 9:3:64] [--threads 1]
[--dtype bfloat16|float32].
Appends to bench/results/prefill_attention.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, median_time, print_table  # noqa: E402

from fastgate.ops import reference  # noqa: E402
from fastgate.ops.prefill import blocked_prefill_attention, ext_prefill_attention  # noqa: E402
from fastgate.ops.registry import import_ext  # noqa: E402


def _narrow(ext, op, q, k, v, start):
    """``op`` 8 floats a vector (the layer ops' test hook), restored to 16 after."""
    ext.set_max_vector_width(8)
    try:
        return op(q, k, v, start)
    finally:
        ext.set_max_vector_width(16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="700:0,430:0,512:512,64:700",
                        help="queries:cached columns, comma-separated (default: %(default)s)")
    parser.add_argument("--heads", default="9:3:64", help="query heads:key-value heads:head dim (SmolLM2's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the inputs' dtype: bf16 (an auto model's chunks) or float32 (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim = (int(x) for x in args.heads.split(":"))
    ext = import_ext()
    f32 = args.dtype == "float32"
    if f32:
        designs = {"sdpa-fp32": lambda q, k, v, s: reference.prefill_attention(q, k, v, s)}
        if ext is not None and getattr(ext, "prefill_attention_f32_supported", lambda: False)():
            op = ext_prefill_attention(ext)
            designs["ext-fp32"] = op
            if ext.cpu_has_avx512():
                designs["ext-fp32-w8"] = lambda q, k, v, s: _narrow(ext, op, q, k, v, s)
        else:
            print("ext-fp32: skipped (needs the extension built and a CPU with AVX2 and FMA)", file=sys.stderr)
    else:
        designs = {
            "sdpa-bf16": lambda q, k, v, s: reference.prefill_attention(q, k, v, s),
            "sdpa-fp32": lambda q, k, v, s: reference.prefill_attention(q.float(), k.float(), v.float(), s),
            "blocked": blocked_prefill_attention,
        }
        if ext is not None and ext.prefill_attention_bf16_supported():
            designs["ext"] = ext_prefill_attention(ext)
        else:
            print("ext: skipped (needs the extension built and a CPU with AVX512-BF16)", file=sys.stderr)
    dtype = torch.float32 if f32 else torch.bfloat16
    ratio = "vs_sdpa_fp32" if f32 else "vs_sdpa_bf16"  # the speedup over the first design
    rows = []
    for chunk in args.chunks.split(","):
        n, start = (int(x) for x in chunk.split(":"))
        g = torch.Generator().manual_seed(n * 7919 + start)
        q = (torch.randn(1, n, heads, dim, generator=g) * 2).to(dtype).transpose(1, 2)  # [1, H, n, D], HF's strides
        k = (torch.randn(1, kv_heads, start + n, dim, generator=g) * 2).to(dtype)  # [1, Hkv, S, D]
        v = torch.randn(1, kv_heads, start + n, dim, generator=g).to(dtype)
        wide = torch.float64 if f32 else torch.float32  # exact attention of the same inputs
        exact = reference.prefill_attention(q.to(wide), k.to(wide), v.to(wide), start)  # [1, H, n, D]
        flops = 4 * heads * n * (start + (n + 1) / 2) * dim  # QK and PV over the columns each query sees
        base = None
        for name, fn in designs.items():
            t = median_time(lambda fn=fn: fn(q, k, v, start))
            err = (fn(q, k, v, start).to(exact.dtype) - exact).abs()
            base = base or t
            rows.append({"design": name, "queries": n, "start": start, "heads": heads, "kv_heads": kv_heads,
                         "head_dim": dim, "threads": args.threads, "ms": t * 1e3, "gflops": flops / t / 1e9,
                         ratio: base / t, "max_err": float(err.max()), "mean_err": float(err.mean()),
                         "dtype": args.dtype})
    print_table(rows, ["design", "queries", "start", "ms", "gflops", ratio, "max_err", "mean_err"])
    print(f"appended to {append_rows('prefill_attention', rows)}")


if __name__ == "__main__":
    main()
