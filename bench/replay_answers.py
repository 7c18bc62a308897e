"""Record or replay the real model's results on 32 held-out questions for all eight methods.

The fixture ``tests/fixtures/golden_real32.jsonl`` was recorded from the batch-synchronous implementation (before
the step-program scheduler): ``python bench/replay_answers.py --record``. A plain run answers the same questions with
today's code, exactly as ``fastgate eval --all --n 32 --budget cpu`` does, and compares answers, gate decisions,
passages and counters (gate and passage scores within 1e-4); it exits 1 on a difference. ``--serving`` schedules as
``fastgate serve`` does (chunked prefill between decode steps). Run by hand (the suite runs the tiny model's golden
records, tests/golden.py): all eight methods take ~9 minutes on 2 cores. The fixture's SCAAR gate steps carry the
score it reports since 2026-11-29 (the θ at which its rule flips), updated with every answer, decision and passage
checked equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "golden_real32.jsonl"
# the eight methods the fixture was recorded with (`read`, fastgate's own gate, came later and ships no checkpoint
# for smollm2-135m)
FIXTURE_METHODS = ("never", "always", "flare", "probing", "dtr", "seakr", "scaar", "cbdr")
KEEP = ("run", "id", "question", "answer", "retrieved", "passages", "retrieval_calls", "lm_calls",
        "generated_tokens", "gate_steps", "truncated")


def run_all(n: int, batch_size: int, out: Path, methods: list[str] | None = None, dtype: str = "float32",
            step: str = "eager", weights: str = "float") -> list[dict]:
    """Answer ``n`` held-out questions with every method (or ``methods``) under the CPU eval budget; the records in
    run order."""
    from fastgate.eval.datasets import load_qa, sample_examples
    from fastgate.eval.runner import ResultsStore, RunSpec, evaluate
    from fastgate.methods.calibration import CPU_EVAL_BUDGET
    from fastgate.serving.runtime import Runtime, check_request

    runs = []
    for name in methods or FIXTURE_METHODS:
        req = check_request(name, dict(CPU_EVAL_BUDGET.get(name, {})), None, "smollm2-135m")
        runs.append(RunSpec(req.method, req.retriever, req.params))
    examples = sample_examples(load_qa("heldout"), n, 0)
    store = ResultsStore(out / "results.jsonl")
    # the fixture was recorded in float32 with eager steps: replayed so unless asked otherwise, whatever `auto` picks
    evaluate(Runtime("smollm2-135m", "cpu", dtype=dtype, step=step, weights=weights), runs, examples, store,
             batch_size=batch_size, progress=True)
    return [{k: store.records[(r.key, ex.id)][k] for k in KEEP} for r in runs for ex in examples]


def compare(got: list[dict], want: list[dict]) -> list[str]:
    """Differences between two record lists (empty when they agree)."""
    import math

    diffs = []
    mine = {(g["run"], g["id"]): g for g in got}
    for w in want:
        g = mine.get((w["run"], w["id"]))
        if g is None:
            continue  # counted below
        where = f"{w['run']} {w['id']}"
        for key in KEEP:
            if key in ("passages", "gate_steps"):
                continue
            if g[key] != w[key]:
                diffs.append(f"{where}: {key} {g[key]!r} != {w[key]!r}")
        if [p["id"] for p in g["passages"]] != [p["id"] for p in w["passages"]]:
            diffs.append(f"{where}: passages {[p['id'] for p in g['passages']]} != {[p['id'] for p in w['passages']]}")
        elif any(not math.isclose(a["score"], b["score"], rel_tol=1e-4, abs_tol=1e-4)
                 for a, b in zip(g["passages"], w["passages"])):
            diffs.append(f"{where}: passage scores differ")
        gs, ws = g["gate_steps"], w["gate_steps"]
        if [(s["gate"], s["retrieve"]) for s in gs] != [(s["gate"], s["retrieve"]) for s in ws]:
            diffs.append(f"{where}: gate decisions {gs} != {ws}")
        elif any(not math.isclose(a["score"], b["score"], rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(gs, ws)):
            diffs.append(f"{where}: gate scores {[s['score'] for s in gs]} != {[s['score'] for s in ws]}")
    missing = sorted(f"{w['run']} {w['id']}" for w in want if (w["run"], w["id"]) not in mine)
    if missing:  # a renamed run compared nothing and "agreed"
        diffs.append(f"{len(missing)} golden records not answered: {', '.join(missing[:5])}"
                     + (" ..." if len(missing) > 5 else ""))
    if len(got) != len(want):
        diffs.append(f"{len(got)} records, expected {len(want)}")
    return diffs


def _serving_scheduler() -> None:
    """Make every Scheduler (answer_batch builds its own) use the service's defaults."""
    import functools

    from fastgate import scheduler
    from fastgate.serving.service import ServiceConfig

    cfg = ServiceConfig()
    init = scheduler.Scheduler.__init__
    scheduler.Scheduler.__init__ = functools.partialmethod(init, admit_every=cfg.admit_every,
                                                           prefill_budget=cfg.prefill_budget)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help="write the fixture instead of comparing with it")
    ap.add_argument("--n", type=int, default=32, help="held-out questions (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=32, help="questions per answer_batch (default: %(default)s)")
    ap.add_argument("--methods", default=None, help="comma-separated methods to replay (default: the fixture's eight)")
    ap.add_argument("--out", default=None, help="keep the results here (a rerun resumes); default: a temp dir")
    ap.add_argument("--serving", action="store_true",
                    help="schedule as `fastgate serve` does (its layout, prefill budget a step, admission every "
                         "step) instead of the batch defaults")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights' dtype (the fixture is float32; bf16 answers are counted, not expected equal)")
    ap.add_argument("--step", default="eager", choices=["eager", "compiled"],
                    help="decode steps (fastgate.engine.static_step); compiled: greedy answers equal, "
                         "SeaKR's samples are drawn by another generator")
    ap.add_argument("--weights", default="float", choices=["float", "int8", "int4", "int4-dense", "auto"],
                    help="the linear weights (fastgate.assets.quant; the fixture is float: quantized answers are "
                         "counted)")
    args = ap.parse_args(argv)
    if args.serving:
        _serving_scheduler()
    methods = args.methods.split(",") if args.methods else None
    if methods and args.record:
        ap.error("--record writes the whole fixture: all methods")
    t0 = time.perf_counter()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        records = run_all(args.n, args.batch_size, Path(args.out), methods, args.dtype, args.step,
                          args.weights)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            records = run_all(args.n, args.batch_size, Path(tmp), methods, args.dtype, args.step, args.weights)
    elapsed = time.perf_counter() - t0
    if args.record:
        FIXTURE.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"recorded {len(records)} results in {elapsed:.0f} s -> {FIXTURE}")
        return 0
    want = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    if methods:
        want = [w for w in want if w["run"].split("[")[0] in methods]
    asked = {r["id"] for r in records}
    want = [w for w in want if w["id"] in asked]  # --n below the fixture's 32: its first n questions
    diffs = compare(records, want)
    for d in diffs:
        print(d)
    same = {(w["run"], w["id"]) for w in want} - {tuple(d.split(":")[0].rsplit(" ", 1)) for d in diffs}
    if diffs:
        print(f"{len(same)}/{len(want)} records identical in every field ({args.dtype}, {args.weights} weights, "
              f"{args.step} steps)")
        mine = {(r["run"], r["id"]): r["answer"] for r in records}
        answers = sum(mine.get((w["run"], w["id"])) == w["answer"] for w in want)
        print(f"{answers}/{len(want)} answers identical")
    print(f"{len(same)}/{len(want)} records agree ({elapsed:.0f} s)" if diffs else
          f"all {len(want)} records agree with {FIXTURE.name} ({elapsed:.0f} s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
