"""The LM head in column slices against the plain product, on the model's own head and in a whole decode step.

Two parts, in one run, for each ``--models`` entry:

- ``head``: ``hidden [rows, K] @ W.T`` over the model's real head weight, plain (``F.linear``) and in slices of
  ``--columns`` output features (:func:`fastgate.engine.lm_head.sliced_linear`), at ``--rows``; ``speedup`` = plain /
  sliced and ``same`` says whether the logits are bitwise equal (machine-dependent: where they are not, the engine's
  :class:`fastgate.engine.lm_head.SlicedHead` keeps the plain product for that row count). ``GBps`` is the weight bytes
  read per second and ``of_bound`` that rate over the read bandwidth of a ``sum`` in the same run (the head reads its
  weight once).
- ``step``: a packed decode step (:class:`fastgate.engine.packed.PackedLoop`, the service's layout) of ``--batch``
  rows with ``--context``-token prompts, with the engine's head sliced (the default) and plain (``head_columns=0``);
  rounds alternate the two so drift hits both alike.

Every row names ``dtype``: the head weight's (``head``), the engine's weights' (``step``).

Run: python bench/bench_lm_head.py [--models smollm2-135m,qwen2.5-0.5b] [--rows 1,4,16,32] [--columns 1024,2048,4096]
Appends to bench/results/lm_head.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import append_rows, median_time, print_table  # noqa: E402
from bench_engine import FILLER, loop_step, read_bandwidth  # noqa: E402

from fastgate.assets.models import load  # noqa: E402
from fastgate.engine.lm_head import DEFAULT_COLUMNS, sliced_linear  # noqa: E402
from fastgate.engine.local import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--rows", default="1,4,16,32")
    ap.add_argument("--columns", default="1024,2048,4096")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    columns_list = [int(c) for c in args.columns.split(",")]
    bandwidth = read_bandwidth(torch.device("cpu"))
    rows = []
    for name in args.models.split(","):
        lm = load(name, weights="float")  # the head as an nn.Linear (its weight is what this bench times)
        weight = lm.model.lm_head.weight.detach()  # [V, K]
        vocab, hidden = weight.shape
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for n in rows_list:
                x = torch.randn(n, hidden, generator=gen).to(weight.dtype)  # rows in the head's dtype (auto's)
                plain_out = F.linear(x, weight)
                plain = median_time(lambda: F.linear(x, weight), repeat=5)  # noqa: B023
                for columns in columns_list:
                    same = torch.equal(sliced_linear(x, weight, None, columns), plain_out)
                    sliced = median_time(lambda: sliced_linear(x, weight, None, columns), repeat=5)  # noqa: B023
                    gbps = weight.numel() * weight.element_size() / sliced / 1e9
                    rows.append({"part": "head", "model": name, "dtype": str(weight.dtype)[6:], "vocab": vocab,
                                 "hidden": hidden, "rows": n,
                                 "columns": columns, "plain_ms": plain * 1e3, "sliced_ms": sliced * 1e3,
                                 "speedup": plain / sliced, "same": same, "GBps": gbps,
                                 "of_bound": gbps * 1e9 / bandwidth, "read_GBps": bandwidth / 1e9})
        ids = lm.tokenizer(FILLER * (1 + args.context // 30))["input_ids"]
        rows_ids = [ids[i:i + args.context] for i in range(args.batch)]  # loop_step's rows: token ids
        times: dict[int, list[float]] = {DEFAULT_COLUMNS: [], 0: []}
        for _ in range(args.rounds):
            for columns in times:
                engine = Engine(lm, prefix_cache=0, head_columns=columns)
                times[columns].append(loop_step(engine, rows_ids, args.steps, "packed")[0])
        dtype = Engine(lm).dtype_name  # the default head again; the step's weights' dtype (the head rows' too)
        plain, sliced = statistics.median(times[0]), statistics.median(times[DEFAULT_COLUMNS])
        rows.append({"part": "step", "model": name, "dtype": dtype, "vocab": vocab, "hidden": hidden,
                     "rows": args.batch,
                     "columns": DEFAULT_COLUMNS, "plain_ms": plain * 1e3, "sliced_ms": sliced * 1e3,
                     "speedup": plain / sliced, "same": "", "GBps": "", "of_bound": "",
                     "read_GBps": bandwidth / 1e9, "context": args.context, "threads": torch.get_num_threads()})
    print_table(rows, ["part", "model", "rows", "columns", "plain_ms", "sliced_ms", "speedup", "same", "of_bound"])
    print(f"appended to {append_rows('lm_head', rows)}")


if __name__ == "__main__":
    main()
