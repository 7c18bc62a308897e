"""Start-up as a user meets it: a fresh process's model load, `fastgate ask`'s first answer and `fastgate --help`.

Each figure is a fresh Python process (nothing imported or cached in memory; the converted model and the indexes
already prepared on disk), timed from the outside, and the median over ``--rounds`` rounds. With ``--baseline DIR``
(a checkout of another commit, e.g. ``git worktree add /tmp/old <commit>``; it needs its own C++ extension built, or
it runs without it) the same commands run from that tree too, interleaved round by round, and each row gives this
tree's time over the baseline's.

- ``load``: ``fastgate.assets.models.load(MODEL)`` in the default ``auto`` form, imports included;
- ``ask``: ``fastgate ask --json --model MODEL QUESTION`` from start to exit (``ask_setup_s``: what it reports as
  its set-up: the model's load and the retrievers' opening);
- ``help``: ``fastgate --help``.

Rows go to bench/results/startup.csv as each design and model is measured.

Run: python bench/bench_startup.py [--models smollm2-135m,qwen2.5-0.5b] [--rounds 3] [--baseline /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import append_rows, print_table  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
LOAD = ("import sys, time; t = time.perf_counter(); from fastgate.assets.models import load; "
        "load(sys.argv[1]); print(time.perf_counter() - t)")


def _run(tree: Path, args: list[str]) -> tuple[float, str]:
    """Wall seconds of ``python ARGS`` with ``tree`` first on the path (its stdout too); a failure ends the bench."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p),
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} failed in {tree} (rc {done.returncode}):\n{done.stderr[-2000:]}")
    return wall, done.stdout


def measure(tree: Path, model: str, question: str) -> dict[str, float]:
    """One round's figures for ``model`` from ``tree``."""
    wall, out = _run(tree, ["-c", LOAD, model])
    load_s = float(out.strip().splitlines()[-1])
    ask_s, out = _run(tree, ["-m", "fastgate", "ask", "--json", "--model", model, question])
    record = json.loads(out.strip().splitlines()[-1])
    help_s, _ = _run(tree, ["-m", "fastgate", "--help"])
    return {"load_s": load_s, "load_process_s": wall, "ask_s": ask_s,
            "ask_setup_s": float(record["timings"]["setup_s"]), "help_s": help_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--question", default="Who wrote Hamlet?")
    ap.add_argument("--baseline", default=None, help="a checkout of another commit to compare with, same run")
    args = ap.parse_args()
    designs = [("head", HERE)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    for _, tree in designs[1:]:
        if not any((tree / "fastgate").glob("_C*.so")):
            print(f"note: {tree} has no built C++ extension: it runs without it", file=sys.stderr)
    columns = ["design", "model", "load_s", "load_process_s", "ask_s", "ask_setup_s", "help_s"]
    all_rows = []
    for model in args.models.split(","):
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in designs}
        for _ in range(args.rounds):  # interleaved: the machine's drift falls on every design alike
            for name, tree in designs:
                rounds[name].append(measure(tree, model, args.question))
        rows = []
        for name, _ in designs:
            row = {"design": name, "model": model, "rounds": args.rounds}
            for key in columns[2:]:
                values = [r[key] for r in rounds[name]]
                row[key] = round(statistics.median(values), 3)
                row[f"{key}_rounds"] = " ".join(f"{v:.2f}" for v in values)
            rows.append(row)
        if len(rows) > 1:
            for key in columns[2:]:
                rows[0][f"{key}_x_baseline"] = round(rows[0][key] / rows[1][key], 3)
        append_rows("startup", rows)  # as measured: a later model's failure keeps these
        all_rows += rows
    print_table(all_rows, columns + [f"{k}_x_baseline" for k in columns[2:] if len(designs) > 1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
