"""Decode steps of two or more engine forms (dtype / weight format) interleaved round by round, so that a machine's
drift (this project's shared 2-core VMs move ±30% within minutes: bench_engine.py's two rounds of one form gave 190 and
136 ms for the same batch-16 step) falls on every form alike. bench_engine.py times each form's designs in turn,
minutes apart.

Each round times every form at every (batch, context), then the next round. Reports per shape each form's median and
the median of its per-round ratios to the first form (``vs_first``), rows in ``bench/results/forms.csv`` (a shape's
rows written as soon as its last round is measured).

Run: python bench/bench_forms.py [--model smollm2-135m] [--forms float32:float,auto:auto] [--shapes 1x30,16x600]
[--rounds 5] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastgate.entrypoints import passive_omp_threads  # noqa: E402

passive_omp_threads()  # as the fastgate command does, before torch loads
import torch  # noqa: E402
from _common import append_rows, print_table  # noqa: E402
from bench_engine import build_model, cpu_name, loop_step, prompt_ids  # noqa: E402

from fastgate.engine.local import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--forms", default="float32:float,auto:auto", help="DTYPE:WEIGHTS, comma-separated; the first "
                                                                          "is the others' reference")
    parser.add_argument("--shapes", default="1x30,16x600", help="BATCHxCONTEXT, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-save", action="store_true", help="print the rows only")
    args = parser.parse_args()
    forms = [tuple(f.split(":")) for f in args.forms.split(",")]
    if any(len(f) != 2 for f in forms) or len(forms) < 2:
        sys.exit("--forms: two or more DTYPE:WEIGHTS")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    engines = {}
    for dtype, weights in forms:
        lm = build_model(args.model, "cpu", dtype, weights)
        engines[(dtype, weights)] = Engine(lm, prefix_cache=0, step="eager")
    prompts = {(f, s): prompt_ids(e, *s) for f, e in engines.items() for s in shapes}
    times: dict[tuple, list[float]] = {}
    first = next(iter(engines))
    rows = []

    def shape_rows(shape: tuple[int, int]) -> list[dict]:  # every form's row of one shape, over its rounds
        out = []
        ref = times[(first, shape)]
        for form, engine in engines.items():
            mine = times[(form, shape)]
            ratios = [a / b for a, b in zip(mine, ref)]
            out.append({"batch": shape[0], "context": shape[1], "form": ":".join(form), "dtype": engine.dtype_name,
                        "weights": engine.lm.weights,
                        "ms": statistics.median(mine) * 1e3, "vs_first": statistics.median(ratios),
                        "vs_first_min": min(ratios), "vs_first_max": max(ratios), "rounds": len(mine),
                        "threads": torch.get_num_threads(), "model": args.model, "cpu": cpu_name(),
                        "cpu_capability": torch.backends.cpu.get_cpu_capability()})
        return out

    for rnd in range(args.rounds):
        for shape in shapes:
            line = []
            for form, engine in engines.items():
                t = loop_step(engine, prompts[(form, shape)], args.steps, "packed")[0]
                times.setdefault((form, shape), []).append(t)
                line.append(f"{engine.dtype_name}/{engine.lm.weights} {t * 1e3:.1f} ms")
            print(f"round {rnd} batch {shape[0]} context {shape[1]}: " + ", ".join(line), file=sys.stderr)
            if rnd == args.rounds - 1:  # this shape's rounds are done: its rows are written now
                rows.extend(shape_rows(shape))
                if not args.no_save:
                    append_rows("forms", rows[-len(engines):])
    print_table(rows, ["batch", "context", "form", "dtype", "weights", "ms", "vs_first", "vs_first_min",
                       "vs_first_max"])

if __name__ == "__main__":
    main()
