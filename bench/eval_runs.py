"""``fastgate eval`` with parameters per run: several configurations of one method in ONE invocation.

``fastgate eval --param`` gives every run the same parameters, so ``read`` with ``decide=answer`` and ``read`` with
``decide=prefill`` (each with its own checkpoint and threshold) cannot share an invocation, and timings from
different invocations are not comparable. This runs exactly what ``fastgate eval`` runs (the same store, the same
``always`` again at the end, the same report with its cost table and coins), with each ``--run`` its own method and
parameters::

    python bench/eval_runs.py --model smollm2-135m --data nq:test:balanced --n 50 --out runs/x \\
        --run never --run always --run 'read:checkpoint=CK1,threshold=0.1' \\
        --run 'read:decide=prefill,checkpoint=CK2,threshold=-0.3' --run 'always:retriever=dense'

``retriever=`` in a run's parameters is its retriever (what ``fastgate eval --retriever`` gives every run).
``--dtype`` and ``--weights`` are ``fastgate eval``'s (the same choices and defaults): name them when resuming into
an ``--out`` whose records were made in a dtype that ``auto``'s timed probe may not pick again. As ``fastgate eval``,
a user error (records of another dtype in ``--out``, an unknown benchmark...) prints one line, ``eval_runs: error:
...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path


def _run(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    params = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--run {text!r}: expected METHOD[:name=value,...]")
        params[key.strip()] = value.strip()
    return name.strip(), params


def main(argv: list[str] | None = None) -> int:
    from fastgate.errors import FastgateError

    try:
        return _main(argv)
    except FastgateError as exc:  # as the CLI: one line and status 2, no traceback
        print(f"eval_runs: error: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    from fastgate.assets.pins import DEFAULT_MODEL
    from fastgate.eval.datasets import load_benchmark, parse_benchmark
    from fastgate.eval.report import AGAIN_FILE, machine_line, new_invocation, run_always_again, write_report
    from fastgate.eval.runner import EvalSettings, ResultsStore, RunSpec, check_form, check_settings, evaluate
    from fastgate.methods.calibration import CPU_EVAL_BUDGET
    from fastgate.serving.runtime import Runtime, check_request
    from fastgate.serving.service import ServiceConfig
    from fastgate.settings import add_setting_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="METHOD[:name=value,...], repeatable")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--data", required=True, help="a benchmark NAME:SPLIT:SUBSET")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=32, help="questions in flight (or per batch)")
    p.add_argument("--schedule", choices=("window", "batches"), default="window", help="as fastgate eval's")
    p.add_argument("--device", default="auto")
    add_setting_args(p, ServiceConfig, ("dtype", "weights"))  # fastgate eval's flags: its choices and defaults
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    runs = []
    for text in args.run:  # the CPU budget as `fastgate eval` gives it (no GPU here)
        name, params = _run(text)
        retriever = params.pop("retriever", None)  # e.g. always:retriever=dense (the dense-only gate's baseline)
        req = check_request(name, {**CPU_EVAL_BUDGET.get(name, {}), **params}, retriever, args.model)
        runs.append(RunSpec(req.method, req.retriever, req.params))
    spec = parse_benchmark(args.data)
    data = str(spec)
    examples = load_benchmark(spec, seed=args.seed, n=args.n)
    out = Path(args.out)
    check_settings(out, EvalSettings(model=args.model, data=data, seed=args.seed))
    store = ResultsStore(out / "results.jsonl")
    runtime = Runtime(args.model, args.device, dtype=args.dtype, weights=args.weights)
    # one directory, one engine, dtype and weights: refused before any run answers (as fastgate eval)
    check_form(store, runtime)
    check_form(ResultsStore(out / AGAIN_FILE), runtime)
    answered = {r.key: sum(not store.done(r.key, ex.id) for ex in examples) for r in runs}
    invocation = new_invocation()
    print(f"evaluating {', '.join(r.key for r in runs)} on {len(examples)} question(s) of {data} -> {out}",
          file=sys.stderr)
    summaries = evaluate(runtime, runs, examples, store, batch_size=args.batch_size, progress=not args.quiet,
                         invocation=invocation, schedule=args.schedule)
    again = run_always_again(runtime, runs, examples, out, answered, batch_size=args.batch_size,
                             progress=not args.quiet, invocation=invocation, schedule=args.schedule)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"{len(examples)} questions of `{data}` (seed {args.seed}), model {runtime.model_name} "
              f"({runtime.dtype_name or runtime.engine_name}), calibrated thresholds, per-run parameters "
              f"(bench/eval_runs.py), {'window' if args.schedule == 'window' else 'batch'} {args.batch_size}; "
              f"{machine_line()}; {stamp}")
    written = write_report(out, store, examples, runs, summaries, header=header, again=again)
    print("wrote " + ", ".join(str(w) for w in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
