"""``fastgate calibrate``: a gated method's threshold for a model, from one resumable pass on dev questions.

The pass evaluates the method with its first gate forced to skip (its :class:`~fastgate.methods.base.GateThreshold`
``skip`` value), so every question's first score is recorded; the records are stored like any `fastgate eval` run,
so an interrupted calibration resumes. The threshold is then chosen from the scores:

- ``rate`` (default): the value at which ``--rate`` of the first gates retrieve (the midpoint between the scores on
  either side of the boundary);
- ``best``: the value with the largest gain over the random gate at the same rate (accuracy replayed from the
  skipped answers and ``always``'s answers on the same questions, which the pass then also runs), among rates up to
  ``--rate``;
- ``loss``: the value at which the fewest questions retrieve while the replayed accuracy stays within ``--max-loss``
  of the better of ``never`` (the skipped answers) and ``always`` (also run): the read gate's rule (``fastgate train
  read``), for any gate; ``--rate`` is not used.

It is shown with its dev curve and written to ``$FASTGATE_HOME/calibration/<model>.json``, which ask, eval and serve
read on top of the shipped values (:mod:`fastgate.methods.calibration`).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastgate.assets.pins import DEFAULT_MODEL
from fastgate.errors import InputError

__all__ = ["CalibrationResult", "add_calibrate_args", "choose_cut", "dev_curve"]


def _calibration_count(text: str) -> int:
    """argparse ``type`` of calibrate's ``--n``: at least 2 questions (a threshold lies between two questions' scores;
    ``--n 1`` answered its question, then could not calibrate)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of questions, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected a number of questions >= 2 (a threshold lies between two "
                                         f"questions' scores), got {value}")
    return value


@dataclass(frozen=True)
class CalibrationResult:
    """A calibrated threshold and what it was chosen from."""

    method: str
    param: str
    value: float
    rate: float  # share of the dev questions whose first gate retrieves at ``value``
    n: int
    rule: str
    gain: float | None = None  # replayed ACC − random gate at that rate (``best`` only)


def _order(scores: np.ndarray, retrieve_above: bool) -> np.ndarray:
    """Scores sorted so that the first k are the k questions that retrieve first."""
    return np.sort(scores)[::-1] if retrieve_above else np.sort(scores)


def choose_cut(scores: np.ndarray, k: int, retrieve_above: bool) -> float:
    """A score boundary at which exactly the ``k`` most retrieving questions retrieve (midpoint between neighbours)."""
    s = _order(np.asarray(scores, dtype=np.float64), retrieve_above)
    n = len(s)
    sign = 1.0 if retrieve_above else -1.0
    if k <= 0:
        return float(s[0] + sign * max(1.0, abs(s[0])))
    if k >= n:
        return float(s[-1] - sign * 1e-6 * max(1.0, abs(s[-1])))
    return float((s[k - 1] + s[k]) / 2)


def dev_curve(scores: np.ndarray, retrieve_above: bool, skip_acc: np.ndarray | None = None,
              read_acc: np.ndarray | None = None) -> list[dict[str, float]]:
    """For k = 0..n retrieving questions: the rate, the boundary, and (given both answers) replayed ACC and the random
    gate's ACC at that rate."""
    scores = np.asarray(scores, dtype=np.float64)
    n = len(scores)
    order = np.argsort(-scores if retrieve_above else scores, kind="stable")
    rows = []
    for k in range(n + 1):
        row = {"k": k, "rate": k / n, "cut": choose_cut(scores, k, retrieve_above)}
        if skip_acc is not None and read_acc is not None:
            retrieve = np.zeros(n, dtype=bool)
            retrieve[order[:k]] = True
            row["acc"] = float(np.where(retrieve, read_acc, skip_acc).mean())
            row["random"] = float((1 - k / n) * skip_acc.mean() + k / n * read_acc.mean())
        rows.append(row)
    return rows


def _data_label(data: str) -> str:
    """``data`` in a run directory's name: a benchmark's ``nq:dev:balanced`` as ``nq-dev-balanced``; a file by its
    stem and a hash of its absolute path (its whole path nested directories under runs/; two files of one stem share
    no directory)."""
    from fastgate.eval.datasets import is_benchmark

    if is_benchmark(data) or not Path(data).is_file():  # a benchmark or a built-in set
        return data.replace(":", "-")
    path = str(Path(data).expanduser().resolve())
    return f"{Path(data).stem}-{hashlib.sha256(path.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def _examples(data: str, n: int | None, seed: int, index: str | None):
    from fastgate.eval.datasets import load_fit_examples

    return load_fit_examples(data, n, "calibration", seed, index)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from fastgate.assets.paths import home
    from fastgate.eval.runner import (
        EvalSettings,
        ResultsStore,
        RunSpec,
        check_settings,
        evaluate,
        has_results,
        hold_out_dir,
    )
    from fastgate.methods import METHODS, make_config
    from fastgate.methods.base import method_class
    from fastgate.methods.calibration import CPU_EVAL_BUDGET, user_calibration_file, write_calibration
    from fastgate.serving.runtime import Runtime, check_request
    from fastgate.settings import parse_params

    if args.method not in METHODS:
        from fastgate.errors import UnknownNameError

        raise UnknownNameError("method", args.method, list(METHODS))
    spec = METHODS[args.method].threshold
    if spec is None:
        gated = [m for m, c in METHODS.items() if c.threshold is not None]
        raise InputError(f"{args.method} has no gate threshold to calibrate (gated methods: {', '.join(gated)})")
    if not 0.0 < args.rate <= 1.0:
        raise InputError(f"--rate must be in (0, 1], got {args.rate}")
    if not 0.0 <= args.max_loss < 1.0:
        raise InputError(f"--max-loss must be in [0, 1), got {args.max_loss}")
    from fastgate.train.read import check_pass_flags

    check_pass_flags(args.batch_size, args.index)  # eval's checks and messages, before the model and the run directory
    from fastgate.eval.datasets import refuse_test_split
    from fastgate.serving.engine_args import remote_config

    refuse_test_split(args.data, "calibration")  # before anything loads
    remote = remote_config(args)
    model = remote.model if remote is not None else args.model  # a served model is calibrated under its name
    engine = remote.name if remote is not None else None
    user = parse_params(args.param)
    if user.get("checkpoint"):  # an entry is for one checkpoint: named by its resolved path
        from fastgate.methods.calibration import checkpoint_key

        user["checkpoint"] = checkpoint_key(user["checkpoint"])
    if spec.param in user:
        raise InputError(f"--param {spec.param}=... is what calibration chooses; leave it out")
    budget = args.budget
    if budget == "auto":
        import torch

        budget = "cpu" if args.device == "cpu" or not torch.cuda.is_available() else "full"
    base = dict(CPU_EVAL_BUDGET.get(args.method, {})) if budget == "cpu" else {}
    forced = {**base, **user, spec.param: f"{spec.skip:g}".replace("e+0", "e").replace("e-0", "e-")}  # "1e9"
    req = check_request(args.method, forced, args.retriever, model, remote=engine)
    run = RunSpec(req.method, req.retriever, req.params)
    runs = [run]
    if args.rule in ("best", "loss"):
        # `always` reads the passages the calibrated run reads (the dense-only read gate: the dense top-k, whatever
        # its retriever): a replayed read is that run's read
        reads = method_class(req.method).reads_from(make_config(req.method, dict(req.params)), req.retriever)
        runs.append(RunSpec("always", check_request("always", {}, reads, model, remote=engine).retriever, ()))
    data, examples = _examples(args.data, args.n, args.seed, args.index)
    if len(examples) < 2:  # a threshold lies between two questions' scores: refused before the model loads
        raise InputError(f"--data {args.data} has {len(examples)} question(s): calibration needs at least 2")
    if args.write and not args.dry_run:  # another model's file (or a corrupt one) is refused before the pass too
        from fastgate.methods.calibration import check_calibration_file

        check_calibration_file(model if remote is not None else Path(args.model).expanduser().name, Path(args.write))
    out = Path(args.out) if args.out else home() / "calibration" / "runs" / (
        f"{Path(model).name}-{_data_label(data)}-seed{args.seed}")
    runtime = Runtime(args.model, device=args.device, index=args.index, remote=remote, dtype=args.dtype,
                      weights=args.weights)
    if remote is None and not has_results(out):
        # every question is to be answered: the model loads before the run directory is made (a mistyped --model
        # left calibration/runs/<typo>-... behind, --dry-run too)
        runtime.engine  # noqa: B018 - the property loads the model
    # two calibrations into one directory answered twice; a run directory made for a pass that fails before it
    # records anything (a server that cannot be reached) is removed again, in $FASTGATE_HOME by default
    with hold_out_dir(out, "fastgate calibrate"):
        check_settings(out, EvalSettings(model=model, data=data, seed=args.seed))
        store = ResultsStore(out / "results.jsonl")
        todo = sum(not store.done(r.key, e.id) for r in runs for e in examples)
        where = f" behind {remote.base_url}" if remote is not None else ""
        print(f"calibrating {args.method} ({spec.param}) for {model}{where} on {len(examples)} question(s) of "
              f"{data}: {run.key}{' and always' if len(runs) > 1 else ''}, {todo} answer(s) to compute -> {out} "
              "(resumable)")
        t0 = time.perf_counter()
        evaluate(runtime, runs, examples, store, batch_size=args.batch_size, progress=not args.quiet,
                 timed=False)  # its records are read for their answers and scores
    recs = [store.records[(run.key, e.id)] for e in examples]
    usable = [i for i, r in enumerate(recs) if r.get("gate_steps") and not r.get("error")]
    if len(usable) < 2:
        raise InputError(f"{len(usable)} question(s) with a first gate score: too few to calibrate")
    scores = np.array([recs[i]["gate_steps"][0]["score"] for i in usable], dtype=np.float64)
    skip_acc = read_acc = None
    if args.rule in ("best", "loss"):
        skip_acc = np.array([float(recs[i]["acc"]) for i in usable])
        read_acc = np.array([float(store.records[(runs[1].key, examples[i].id)]["acc"]) for i in usable])
    curve = dev_curve(scores, spec.retrieve_above, skip_acc, read_acc)
    k_cap = int(math.floor(args.rate * len(usable) + 1e-9))
    if args.rule == "best":
        pick = max(curve[: k_cap + 1], key=lambda r: (round(r["acc"] - r["random"], 12), -r["k"]))
    elif args.rule == "loss":  # the read gate's price rule on one dev set: fewest retrievals within --max-loss
        from fastgate.train.read import choose_price, price_meets

        oriented = scores if spec.retrieve_above else -scores  # higher retrieves first
        one_set = np.zeros(len(scores))
        cut = choose_price(oriented, skip_acc, read_acc, one_set, args.max_loss)
        held = price_meets(oriented, skip_acc, read_acc, one_set, cut, args.max_loss)
        pick = curve[int((oriented >= cut).sum())]
    else:
        pick = curve[int(round(args.rate * len(usable)))]
    value = round(spec.value(pick["cut"]), 6)
    result = CalibrationResult(args.method, spec.param, value, pick["rate"], len(usable), args.rule,
                               None if "acc" not in pick else pick["acc"] - pick["random"])
    if args.rule == "loss":
        print(f"rule loss: the fewest retrievals within {100 * args.max_loss:.1f} point(s) of the better of never "
              f"({skip_acc.mean():.3f}) and always ({read_acc.mean():.3f}) on these dev questions"
              + ("" if held else ": no threshold holds it, this one loses least"))
    _print_curve(curve, pick, spec, args.method)
    # e.g. the read gate's threshold belongs to one trained gate: its base and feature set
    when = {**dict(sorted(user.items())), **method_class(args.method).calibration_condition(
        make_config(args.method, {**user}))}
    entry: dict[str, Any] = {"method": args.method, **({"when": when} if when else {}),
                             "params": {spec.param: value}, "rule": args.rule, "rate": round(pick["rate"], 4),
                             **({"max_loss": args.max_loss} if args.rule == "loss" else {}),
                             "target_rate": args.rate, "data": data, "n": len(usable), "seed": args.seed,
                             "date": time.strftime("%Y-%m-%d"),
                             "note": f"fastgate calibrate: {run.key} forced to skip on {len(usable)} questions of "
                                     f"{data}; scores {scores.min():.4g}..{scores.max():.4g}"}
    if result.gain is not None:
        entry["dev_gain_over_random"] = round(result.gain, 4)
    if remote is not None:  # the server it was measured through (the entry is keyed by the served model's name)
        entry["engine"] = remote.name
    # keyed by the model it was made for: a served model's name, else the loaded model's (resumed: it never loaded)
    model_name = remote.model if remote is not None else (runtime.model_name if runtime.loaded
                                                          else Path(args.model).name)
    path = Path(args.write) if args.write else user_calibration_file(model_name)
    if not args.dry_run:
        write_calibration(model_name, entry, path)
    _plot(curve, pick, out / f"calibration-{run.key}.png", args.method)
    print(f"{args.method}: {spec.param} = {value:g} (first gates retrieve on {pick['rate']:.1%} of {len(usable)} dev "
          f"questions{'' if result.gain is None else f'; {100 * result.gain:+.1f} points over the random gate'}); "
          f"{'not written (--dry-run)' if args.dry_run else f'written to {path}'}; {time.perf_counter() - t0:.0f} s")
    return 0


def _print_curve(curve, pick, spec, method: str) -> None:
    n = len(curve) - 1
    marks = sorted({min(n, max(0, int(round(q * n)))) for q in np.linspace(0, 1, 11)} | {pick["k"]})
    has_acc = "acc" in curve[0]
    print(f"{'retrieve':>8}  {spec.param:>10}" + ("   dev ACC   random   gain" if has_acc else ""))
    for k in marks:
        r = curve[k]
        line = f"{r['rate']:8.1%}  {spec.value(r['cut']):10.4g}"
        if has_acc:
            line += f"   {r['acc']:7.3f}  {r['random']:7.3f}  {100 * (r['acc'] - r['random']):+5.1f}"
        print(line + ("   <- chosen" if k == pick["k"] else ""))


def _plot(curve, pick, path: Path, method: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience: `pip install fastgate[eval]`
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    rates = [r["rate"] for r in curve]
    if "acc" in curve[0]:
        ax.plot(rates, [r["acc"] for r in curve], label=f"{method}: thresholded first score")
        ax.plot(rates, [r["random"] for r in curve], "--", label="random gate")
        ax.set_ylabel("dev ACC")
        ax.plot([pick["rate"]], [pick["acc"]], "o", label="chosen")
    else:
        ax.plot(rates, [r["cut"] for r in curve], label="boundary score")
        ax.set_ylabel("first gate score")
        ax.plot([pick["rate"]], [pick["cut"]], "o", label="chosen")
    ax.set_xlabel("share of questions retrieving")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    """``fastgate calibrate``'s arguments on its parser ``p`` (its name and help line are the command line's)."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="embedded model or a local HF directory whose threshold is calibrated (default: %(default)s)")
    p.add_argument("--method", required=True, help="a gated method (see `fastgate methods`)")
    p.add_argument("--param", action="append", default=None, metavar="NAME=VALUE",
                   help="other parameters of the method (e.g. base=dtr for read); recorded as the entry's condition")
    p.add_argument("--data", default="nq:dev:balanced", help="dev questions (default: nq:dev:balanced)")
    p.add_argument("--n", type=_calibration_count, default=200,
                   help="questions of the seeded order, at least 2 (default: 200)")
    p.add_argument("--rule", choices=("rate", "best", "loss"), default="rate",
                   help="rate: retrieve on --rate of the questions; best: the largest gain over the random gate at "
                        "rates up to --rate; loss: the fewest retrievals within --max-loss of the better of never and "
                        "always (best and loss also run `always` on the questions; default: %(default)s)")
    p.add_argument("--max-loss", type=float, default=0.005,
                   help="--rule loss: accuracy it may lose to the better of never and always (default: 0.005)")
    p.add_argument("--rate", type=float, default=0.7,
                   help="target (rate) or largest (best) retrieval rate (default: %(default)s)")
    p.add_argument("--retriever", default=None, help="the method's retriever (default: its own)")
    p.add_argument("--budget", choices=("auto", "cpu", "full"), default="auto",
                   help="as in `fastgate eval`: cpu runs the costly methods with fewer samples (auto: cpu without "
                        "a GPU)")
    p.add_argument("--out", default=None, help="records of the pass (default: under $FASTGATE_HOME/calibration/runs)")
    p.add_argument("--write", default=None, help="calibration file (default: $FASTGATE_HOME/calibration/<model>.json)")
    p.add_argument("--dry-run", action="store_true",
                   help="show the threshold without writing a calibration entry (the pass's records and plot are "
                        "still kept under --out, so that a later run resumes)")
    from fastgate.serving.runtime import RuntimeConfig
    from fastgate.settings import add_setting_args

    # where and in which numeric form the pass answers (a --cache of records made in another refuses to resume in
    # this one): RuntimeConfig's flags, as ask and eval have them
    add_setting_args(p, RuntimeConfig, ("device", "dtype", "weights"))
    from fastgate.train.read import add_pass_args

    add_pass_args(p)
    from fastgate.serving.engine_args import add_engine_args

    add_engine_args(p)  # a model behind an OpenAI-compatible server gets its own thresholds
    p.set_defaults(func=_cmd_calibrate)
