"""``fastgate train read``: the read gate's training pass on dev questions, its fit and its checkpoint.

The pass is an evaluation of ``read[collect=true]`` (every question is answered closed-book *and* from its passages,
with every feature recorded), stored like any `fastgate eval` run, so an interrupted pass resumes where it stopped.
A question's label is 1 where reading fixed the closed-book answer (the passages' answer is right, the closed-book
one wrong). One checkpoint holds a model per feature set (``all``, ``dense``); the report gives each one's
out-of-fold curve on the dev questions against the random gate and the oracle.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from fastgate.assets.pins import DEFAULT_MODEL

__all__ = ["add_read_parser", "collect_rows", "cross_validated_logits", "prefill_rows", "training_pass"]


def training_pass(runtime, base: str, data: str, n: int | None, store_dir: Path, *, seed: int = 0,
                  batch_size: int = 16, index: str | None = None, progress: bool = True,
                  reads: str = "bm25") -> list[dict[str, Any]]:
    """Run (or resume) the collecting pass, reading the top-k passages of ``reads`` (``bm25``, or ``dense`` for the
    dense-only gate, which reads dense passages: its labels must come from the passages it will read); returns its
    records in question order."""
    from fastgate.eval.datasets import load_examples, refuse_test_split
    from fastgate.eval.runner import EvalSettings, ResultsStore, RunSpec, check_settings, evaluate
    from fastgate.serving.runtime import check_request

    refuse_test_split(data, "the read gate's training pass")
    data, examples = load_examples(data, n, seed, index)
    req = check_request("read", {"base": base, "collect": True}, reads, runtime.model)
    run = RunSpec(req.method, req.retriever, req.params)
    check_settings(store_dir, EvalSettings(model=runtime.model, data=data, seed=seed))
    store = ResultsStore(store_dir / "results.jsonl")
    evaluate(runtime, [run], examples, store, batch_size=batch_size, progress=progress)
    return [store.records[(run.key, e.id)] for e in examples if (run.key, e.id) in store.records]


def collect_rows(records: list[dict[str, Any]]) -> tuple[list[dict[str, float]], np.ndarray, np.ndarray, np.ndarray]:
    """Features, labels (reading fixed it), closed-book accuracy and read accuracy of a collecting pass's records
    (records with an error are left out)."""
    from fastgate.eval.metrics import accuracy

    rows, fixed, cb, rd = [], [], [], []
    for r in usable_records(records):
        d = r["details"]
        closed = float(accuracy(d.get("closed_book_answer", ""), r["answers"]))
        rows.append(d["features"])
        cb.append(closed)
        rd.append(float(r["acc"]))
        fixed.append(int(r["acc"] > closed))
    return rows, np.asarray(fixed), np.asarray(cb), np.asarray(rd)


def usable_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a gate is fitted on: those with features and without an error."""
    return [r for r in records if not r.get("error") and "features" in (r.get("details") or {})]


def prefill_rows(engine, records: list[dict[str, Any]], rows: list[dict[str, float]], layer: int, rank: int,
                 projection=None) -> tuple[list[dict[str, float]], Any]:
    """The prefill gate's feature rows of a collecting pass's usable records (``rows``: their :func:`collect_rows`
    features, in the same order): the search features that need no closed-book answer, and each question's
    pre-answer state at ``layer`` (one prefill of its closed-book prompt) projected on ``projection``, or on the first
    ``rank`` principal components of these states when none is given. Returns the rows and the projection."""
    import torch

    from fastgate.gates.read import PREFILL_SEARCH_FEATURES, fit_state_projection
    from fastgate.prompts import closed_book_prompt

    usable = usable_records(records)
    if len(usable) != len(rows):
        raise ValueError(f"{len(usable)} usable records for {len(rows)} feature rows")
    states = engine.prompt_states([closed_book_prompt(r["question"]) for r in usable], layer)  # [N, d]
    states = states.to(device="cpu", dtype=torch.float64).numpy()
    if projection is None:
        projection = fit_state_projection(states, layer, rank)
    z = projection.project(states)  # [N, rank]
    out = [{**{f"state_{i}": float(v) for i, v in enumerate(zi)}, **{k: row[k] for k in PREFILL_SEARCH_FEATURES["all"]}}
           for zi, row in zip(z, rows)]
    return out, projection


def cross_validated_logits(rows, labels, features, folds: int = 5, l2: float = 1.0) -> np.ndarray:
    """Out-of-fold log-odds of each row (folds by position modulo ``folds``: deterministic)."""
    from fastgate.gates.read import fit_read_model

    out = np.zeros(len(rows))
    fold = np.arange(len(rows)) % folds
    for j in range(folds):
        train = [i for i in range(len(rows)) if fold[i] != j]
        test = [i for i in range(len(rows)) if fold[i] == j]
        m = fit_read_model([rows[i] for i in train], [labels[i] for i in train], features, l2=l2)
        out[test] = m.logits([rows[i] for i in test])
    return out


def _curve_line(name: str, logits: np.ndarray, cb: np.ndarray, rd: np.ndarray, rate: float) -> str:
    k = int(round(rate * len(logits)))
    read = np.zeros(len(logits), dtype=bool)
    read[np.argsort(-logits, kind="stable")[:k]] = True
    acc = float(np.where(read, rd, cb).mean())
    rnd = (1 - rate) * cb.mean() + rate * rd.mean()
    return (f"{name:>6}  read {rate:4.0%}: ACC {acc:.3f}  random {rnd:.3f}  ({100 * (acc - rnd):+.1f} points)  "
            f"always {rd.mean():.3f}  never {cb.mean():.3f}")


def _cmd_read(args: argparse.Namespace) -> int:
    from fastgate.assets.paths import home
    from fastgate.errors import InputError
    from fastgate.eval.datasets import refuse_test_split
    from fastgate.gates.read import FEATURE_SETS, fit_read_model, prefill_feature_names, save_read_checkpoint
    from fastgate.serving.runtime import Runtime

    refuse_test_split(args.data, "fastgate train read")  # before the model loads
    prefill = args.decide == "prefill"
    if prefill and args.rank < 1:
        raise InputError(f"--rank must be >= 1, got {args.rank}")
    runtime = Runtime(args.model, device=args.device, index=args.index)
    store_dir = Path(args.cache) if args.cache else (
        home() / "features" / f"{args.model}-read-{args.base}-{args.data.replace(':', '-')}")
    names = [name.strip() for name in args.features.split(",") if name.strip()]
    if not names:
        raise InputError("--features names no feature set")
    for name in names:
        if name not in FEATURE_SETS:
            raise InputError(f"--features: unknown set {name!r} (known: {', '.join(FEATURE_SETS)})")
    # a gate is trained on labels from the passages it will read: BM25's for `all`, dense's for `dense` (its own pass)
    reads = {name: "dense" if name == "dense" else "bm25" for name in names}
    passes: dict[str, tuple] = {}
    projection = None  # the prefill gate's state projection: fitted on the first pass's questions, shared
    for retriever in dict.fromkeys(reads.values()):
        where = store_dir if retriever == "bm25" else store_dir.with_name(store_dir.name + "-dense-reads")
        print(f"training pass: read[base={args.base},collect=true] reading {retriever} passages on {args.n or 'all'} "
              f"question(s) of {args.data} -> {where} (resumable)")
        records = training_pass(runtime, args.base, args.data, args.n, where, seed=args.seed,
                                batch_size=args.batch_size, index=args.index, progress=not args.quiet,
                                reads=retriever)
        rows, labels, cb, rd = collect_rows(records)
        if len(rows) < 10 or labels.sum() < 2:
            raise InputError(f"read gate: {len(rows)} usable questions with {int(labels.sum())} fixed by reading "
                             f"{retriever} passages: too few to fit (use more --n)")
        print(f"{len(rows)} questions: closed-book ACC {cb.mean():.3f}, with {retriever} passages {rd.mean():.3f}; "
              f"reading fixes {int(labels.sum())}, breaks {int(((rd < cb)).sum())}")
        if prefill:  # the same questions, labels and search features; the pre-answer state instead of the answer
            layer = runtime.lm.n_layers // 2 if args.layer is None else args.layer
            rows, projection = prefill_rows(runtime.engine, records, rows, layer, args.rank, projection)
        passes[retriever] = (rows, labels, cb, rd)
    models, report = {}, {}
    for name in names:
        rows, labels, cb, rd = passes[reads[name]]
        feature_names = prefill_feature_names(name, projection.rank) if prefill else FEATURE_SETS[name]
        oof = cross_validated_logits(rows, labels, feature_names, l2=args.l2)
        print(_curve_line(name, oof, cb, rd, args.rate) + f"  (out-of-fold on these dev questions, {reads[name]} "
              "reads)")
        models[name] = fit_read_model(rows, labels, feature_names, l2=args.l2)
        report[name] = {"weights": dict(zip(models[name].features, (round(w, 4) for w in models[name].weights)))}
        print(f"{'':>6}  weights: " + ", ".join(f"{f} {w:+.2f}" for f, w in report[name]["weights"].items()))
    rows, labels, cb, rd = passes[reads[names[0]]]
    kind = "read-prefill" if prefill else f"read-{args.base}"
    out = Path(args.out) if args.out else home() / "checkpoints" / f"{runtime.model_name}-{kind}"
    meta = {"data": args.data, "n": len(rows), "seed": args.seed, "fixed": int(labels.sum()), "l2": args.l2,
            "closed_book_acc": round(float(cb.mean()), 4), "read_acc": round(float(rd.mean()), 4),
            "labels_from_reads": reads}
    if prefill:
        meta = {**meta, "layer": projection.layer, "rank": projection.rank,
                "pass": f"read[base={args.base},collect=true]"}
    save_read_checkpoint(out, models, model=runtime.lm, base=None if prefill else args.base, meta=meta,
                         decide=args.decide, projection=projection)
    mode = "--param decide=prefill" if prefill else f"--param base={args.base}"
    print(f"checkpoint: {out}\nnext: `fastgate calibrate --model {runtime.model_name} --method read "
          f"{mode} --param checkpoint={out}` for its threshold")
    print(json.dumps({"checkpoint": str(out), **meta}))
    return 0


def add_read_parser(kinds) -> None:
    p = kinds.add_parser("read", help="the read gate (fastgate's extension): collect on dev questions, fit, save")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--decide", choices=("answer", "prefill"), default="answer",
                   help="answer: the gate after the closed-book answer; prefill: the gate on the closed-book prompt's "
                        "pre-answer state and the search scores, before generating (read[decide=prefill])")
    p.add_argument("--base", default="dtr",
                   help="the gated method whose first signal the gate sees (default: dtr); with --decide prefill, the "
                        "base of the training pass whose records it reuses")
    p.add_argument("--layer", type=int, default=None,
                   help="--decide prefill: the layer of the pre-answer state (default: the middle, CBDR's)")
    p.add_argument("--rank", type=int, default=16,
                   help="--decide prefill: principal components of the pre-answer state the gate reads (default: 16)")
    p.add_argument("--data", default="nq:dev:balanced", help="dev questions only (default: nq:dev:balanced)")
    p.add_argument("--n", type=int, default=400, help="questions of the seeded order (default: 400)")
    p.add_argument("--features", default="all,dense", help="feature sets to fit, comma-separated (default: both)")
    p.add_argument("--l2", type=float, default=1.0, help="L2 penalty of the logistic model (default: 1)")
    p.add_argument("--rate", type=float, default=0.7, help="reading rate of the printed dev curve point")
    p.add_argument("--out", default=None,
                   help="checkpoint directory (default: $FASTGATE_HOME/checkpoints/<model>-read-<base>)")
    p.add_argument("--cache", default=None, help="records of the training pass (default: under $FASTGATE_HOME)")
    p.add_argument("--index", default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_read)
