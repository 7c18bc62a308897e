"""``fastgate train read``: the read gate's training pass on dev questions, its fit, its price and its checkpoint.

The pass is an evaluation of ``read[collect=true]`` (every question is answered closed-book *and* from its passages,
with every feature recorded), stored like any `fastgate eval` run, so an interrupted pass resumes where it stopped;
several dev sets (``--data nq:dev:balanced,triviaqa:dev``) each get their own pass and are pooled. A question's
accuracy changes by +1 where reading fixed the closed-book answer, by −1 where it broke it: the gate is a
:class:`~fastgate.gates.read.GainModel` (one logistic model of each), whose score is the expected gain of a read.

The threshold is a price: read iff the expected gain is at least what a read costs, in accuracy. It is chosen out of
fold (five folds within each dev set) as the highest price at which no dev set falls more than ``--max-loss`` below
the better of ``never`` and ``always``, and written as the checkpoint's calibration entry. A rule in accuracy per
read means the same on a balanced set and on the natural distribution, where a reading rate does not. The report
(also ``training.json`` beside the checkpoint) gives each set's out-of-fold reading rate and accuracy at the price and
a learning curve: a fifth of each set held out, models fitted on 400, 800, ... and all of the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from fastgate.assets.pins import DEFAULT_MODEL

__all__ = [
    "add_pass_args",
    "add_read_parser",
    "choose_price",
    "price_meets",
    "collect_rows",
    "answerable_labels",
    "backfill_passage_features",
    "check_pass_flags",
    "check_read_out",
    "cross_validated_gains",
    "cross_validated_shift_gains",
    "learning_curve",
    "prefill_rows",
    "prefill_states",
    "search_again",
    "price_table",
    "training_pass",
]


def training_pass(runtime, base: str, data: str, n: int | None, store_dir: Path, *, seed: int = 0,
                  batch_size: int = 16, index: str | None = None, progress: bool = True,
                  reads: str = "bm25") -> list[dict[str, Any]]:
    """Run (or resume) the collecting pass, reading the top-k passages of ``reads`` (``bm25``, or ``dense`` for the
    dense-only gate, which reads dense passages: its labels must come from the passages it will read); returns its
    records in question order."""
    from fastgate.eval.datasets import load_fit_examples
    from fastgate.eval.runner import EvalSettings, ResultsStore, RunSpec, check_settings, evaluate, hold_out_dir
    from fastgate.serving.runtime import check_request

    data, examples = load_fit_examples(data, n, "the read gate's training pass", seed, index)
    req = check_request("read", {"base": base, "collect": True}, reads, runtime.model)
    run = RunSpec(req.method, req.retriever, req.params)
    with hold_out_dir(store_dir, "read-gate training pass"):  # two passes into one store answered twice
        check_settings(store_dir, EvalSettings(model=runtime.model, data=data, seed=seed))
        store = ResultsStore(store_dir / "results.jsonl")
        evaluate(runtime, [run], examples, store, batch_size=batch_size, progress=progress,
                 timed=False)  # a training pass's records are read for their labels and features
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


def search_again(records: list[dict[str, Any]], retriever) -> list[list[Any]]:
    """Each usable record's hits from ``retriever`` searched again for its question (the index and search are
    deterministic), as many as the passages it read; they must be those passages, in order, else an error (records
    of another index or corpus)."""
    from fastgate.errors import InputError

    usable = usable_records(records)
    if not usable:
        return []
    k = max(len(r.get("passages") or ()) for r in usable) or 3
    out = []
    for r, hits in zip(usable, retriever.search_batch([r["question"] for r in usable], k)):
        ids = [p["id"] for p in r.get("passages") or ()]
        if [h.id for h in hits[:len(ids)]] != ids:
            raise InputError(f"record {r.get('id')}: its passages {ids} are not what this index returns "
                             f"({[h.id for h in hits[:len(ids)]]}): records of another index or corpus")
        out.append(hits[:len(ids)])
    return out


def backfill_passage_features(records: list[dict[str, Any]], hits: list[list[Any]]) -> int:
    """Add the BM25 passage features (:func:`fastgate.gates.read.passage_features`) to the usable records of a
    collecting pass made before they existed, in memory, from their BM25 passages ``hits`` (:func:`search_again`,
    one list per usable record). Returns how many records gained them."""
    from fastgate.gates.read import BM25_PASSAGE_FEATURES, passage_features

    n = 0
    for r, h in zip(usable_records(records), hits):
        if not set(BM25_PASSAGE_FEATURES) <= set(r["details"]["features"]):
            r["details"]["features"].update(passage_features(r["question"], h, "bm25"))
            n += 1
    return n


def answerable_labels(records: list[dict[str, Any]], hits: list[list[Any]]) -> np.ndarray:
    """``[N]`` 1 where the passages a usable record read show a gold answer (as the benchmarks' answerable split
    counts it: the title and the first words a prompt shows, after SQuAD normalisation), else 0."""
    from fastgate.eval.datasets import READ_WORDS, shows_answer

    return np.array([int(any(shows_answer(h, READ_WORDS, r["answers"]) for h in hs))
                     for r, hs in zip(usable_records(records), hits)], dtype=int)


def usable_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a gate is fitted on: those with features and without an error."""
    return [r for r in records if not r.get("error") and "features" in (r.get("details") or {})]


def prefill_states(engine, records: list[dict[str, Any]], layer: int) -> np.ndarray:
    """``[N, d]`` the closed-book prompt's pre-answer state at ``layer`` of each usable record's question (one
    prefill each), float64."""
    import torch

    from fastgate.prompts import closed_book_prompt

    states = engine.prompt_states([closed_book_prompt(r["question"]) for r in usable_records(records)], layer)  # [N, d]
    return states.to(device="cpu", dtype=torch.float64).numpy()


def prefill_rows(engine, records: list[dict[str, Any]], rows: list[dict[str, float]], layer: int, rank: int,
                 projection=None, states: np.ndarray | None = None) -> tuple[list[dict[str, float]], Any]:
    """The prefill gate's feature rows of a collecting pass's usable records (``rows``: their :func:`collect_rows`
    features, in the same order): the search features that need no closed-book answer, and each question's
    pre-answer state at ``layer`` (:func:`prefill_states`, or ``states`` when given) projected on ``projection``, or
    on the first ``rank`` principal components of these states when none is given. Returns the rows and the
    projection."""
    from fastgate.gates.read import PREFILL_SEARCH_FEATURES, fit_state_projection

    if len(usable_records(records)) != len(rows):
        raise ValueError(f"{len(usable_records(records))} usable records for {len(rows)} feature rows")
    if states is None:
        states = prefill_states(engine, records, layer)
    if projection is None:
        projection = fit_state_projection(states, layer, rank)
    z = projection.project(states)  # [N, rank]
    # the passage features are backfilled into BM25-read passes only: a dense pass's rows hold what its set reads
    out = [{**{f"state_{i}": float(v) for i, v in enumerate(zi)},
            **{k: row[k] for k in PREFILL_SEARCH_FEATURES["all"] if k in row}} for zi, row in zip(z, rows)]
    return out, projection


def _folds(groups: np.ndarray, folds: int) -> np.ndarray:
    """Each row's fold: its position within its own dev set modulo ``folds`` (deterministic; every set split
    evenly)."""
    fold = np.zeros(len(groups), dtype=int)
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        fold[idx] = np.arange(len(idx)) % folds
    return fold


def cross_validated_gains(rows, fixed, broken, features, groups, folds: int = 5, l2: float = 1.0) -> np.ndarray:
    """Out-of-fold expected gain of reading (:class:`~fastgate.gates.read.GainModel`) of each row, folds within each
    dev set (:func:`_folds`)."""
    from fastgate.gates.read import fit_gain_model

    out = np.zeros(len(rows))
    fold = _folds(np.asarray(groups), folds)
    for j in range(folds):
        train, test = np.flatnonzero(fold != j), np.flatnonzero(fold == j)
        m = fit_gain_model([rows[i] for i in train], fixed[train], broken[train], features, l2=l2)
        out[test] = m.score([rows[i] for i in test])
    return out


def cross_validated_shift_gains(rows, fixed, broken, answerable, features, groups, folds: int = 5, l2: float = 1.0,
                                rate: float = 0.02) -> np.ndarray:
    """Out-of-fold expected gains of a :class:`~fastgate.gates.read.ShiftGainModel` (folds as
    :func:`cross_validated_gains`), each dev set then scored in its own order from its fold models' training share,
    the share estimate moving ``rate`` per question as :class:`~fastgate.gates.read.ReadGate` moves it on a stream
    of questions: what the gate would have read on each set alone."""
    from fastgate.gates.read import adapt_gains, fit_shift_gain_model

    groups = np.asarray(groups)
    p, on, off, prior = (np.zeros(len(rows)) for _ in range(4))
    fold = _folds(groups, folds)
    for j in range(folds):
        train, test = np.flatnonzero(fold != j), np.flatnonzero(fold == j)
        m = fit_shift_gain_model([rows[i] for i in train], fixed[train], broken[train], answerable[train], features,
                                 l2=l2, rate=rate)
        p[test], on[test], off[test] = m.parts([rows[i] for i in test])
        prior[test] = m.prior
    out = np.zeros(len(rows))
    for g in dict.fromkeys(groups.tolist()):
        idx = np.flatnonzero(groups == g)
        out[idx] = adapt_gains(p[idx], on[idx], off[idx], prior[idx], float(prior[idx[0]]), rate)[0]
    return out


def price_table(scores: np.ndarray, cb: np.ndarray, rd: np.ndarray, groups: np.ndarray, price: float
                ) -> list[dict[str, Any]]:
    """Per dev set, reading iff ``score >= price``: the share read, ACC, ``never``'s (closed-book) and ``always``'s
    ACC, and the loss to the better of the two (points of accuracy)."""
    out = []
    for g in dict.fromkeys(groups.tolist()):
        m = groups == g
        read = scores[m] >= price
        acc = float(np.where(read, rd[m], cb[m]).mean())
        best = max(float(cb[m].mean()), float(rd[m].mean()))
        out.append({"data": g, "n": int(m.sum()), "reads": float(read.mean()), "acc": acc,
                    "never": float(cb[m].mean()), "always": float(rd[m].mean()), "loss": best - acc})
    return out


def choose_price(scores: np.ndarray, cb: np.ndarray, rd: np.ndarray, groups: np.ndarray, max_loss: float) -> float:
    """The highest price (fewest reads) at which every dev set's ACC, reading iff ``score >= price``, is within
    ``max_loss`` of the better of ``never`` and ``always`` on that set; candidates are the midpoints between the
    sorted scores. One rule for every set and answerable share: what a read must be expected to add to be worth
    its cost, chosen where no dev set pays for the reads it skips. Where no price holds, the one whose worst set
    loses least (:func:`price_meets`, false there, says so)."""
    s = np.unique(scores)
    candidates = np.concatenate([[s[-1] + 1.0], (s[1:] + s[:-1])[::-1] / 2, [s[0] - 1.0]])  # high to low price
    worst = []
    for c in candidates:
        loss = _worst_loss(scores, cb, rd, groups, float(c))
        if loss <= max_loss + 1e-12:
            return float(c)
        worst.append(loss)
    # nothing holds (reading everything was taken before; it may lose most: reads that break answers)
    return float(candidates[int(np.argmin(worst))])


def price_meets(scores: np.ndarray, cb: np.ndarray, rd: np.ndarray, groups: np.ndarray, price: float,
                max_loss: float) -> bool:
    """Whether every dev set is within ``max_loss`` of the better of ``never`` and ``always`` at ``price``."""
    return _worst_loss(scores, cb, rd, groups, price) <= max_loss + 1e-12


def _worst_loss(scores: np.ndarray, cb: np.ndarray, rd: np.ndarray, groups: np.ndarray, price: float) -> float:
    """The largest loss of a dev set at ``price`` against the better of ``never`` and ``always`` on it."""
    return max(row["loss"] for row in price_table(scores, cb, rd, groups, price))


def learning_curve(rows, fixed, broken, cb, rd, groups, features, price: float, l2: float, seed: int = 0,
                   start: int = 400, answerable=None, rate: float = 0.0) -> list[dict[str, Any]]:
    """Held-out quality against the number of training questions: fold 0 of each dev set (a fifth) held out; gain
    models fitted on 400, 800, 1600, ... and all of the rest (a seeded random order of the pooled sets), each judged
    on the held-out questions at ``price``: per set the share read and ACC against ``never`` and ``always``. With
    ``answerable`` and a ``rate`` above 0, shift-gain models, each held-out set scored in order from the training
    share (:func:`cross_validated_shift_gains`)."""
    from fastgate.gates.read import fit_gain_model, fit_shift_gain_model

    groups = np.asarray(groups)
    fold = _folds(groups, 5)
    held, pool = np.flatnonzero(fold == 0), np.flatnonzero(fold != 0)
    pool = np.random.default_rng(seed).permutation(pool)
    sizes, n = [], start
    while n < len(pool):
        sizes.append(n)
        n *= 2
    out = []
    for size in sizes + [len(pool)]:
        train = pool[:size]
        if fixed[train].sum() < 2:
            continue
        if answerable is not None and rate > 0:
            m = fit_shift_gain_model([rows[i] for i in train], fixed[train], broken[train], answerable[train],
                                     features, l2=l2, rate=rate)
            score = np.zeros(len(held))
            for g in dict.fromkeys(groups[held].tolist()):
                at = np.flatnonzero(groups[held] == g)
                score[at] = m.adapt([rows[held[i]] for i in at], m.prior)[0]
        else:
            m = fit_gain_model([rows[i] for i in train], fixed[train], broken[train], features, l2=l2)
            score = m.score([rows[i] for i in held])
        out.append({"train": int(size), "held_out": int(len(held)),
                    "sets": price_table(score, cb[held], rd[held], groups[held], price)})
    return out


def _print_table(table: list[dict[str, Any]], indent: str = "        ") -> None:
    for row in table:
        print(f"{indent}{row['data']:<24} n {row['n']:>4}  read {row['reads']:6.1%}  ACC {row['acc']:.3f}  "
              f"never {row['never']:.3f}  always {row['always']:.3f}  ({-100 * row['loss']:+.1f} points to the "
              "better)")


def add_pass_args(p, passes: str = "pass") -> None:
    """The flags of an answering pass that ``train read`` and ``calibrate`` share: its index, questions in flight,
    their order and progress bars (checked by :func:`check_pass_flags`)."""
    p.add_argument("--index", default=None,
                   help="index root holding bm25/ and dense/ (default: the default corpus's)")
    p.add_argument("--batch-size", type=int, default=16,
                   help=f"questions in flight during the {passes} (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="question order (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def check_pass_flags(batch_size: int, index: str | None) -> None:
    """The flags of a pass over questions that ``fastgate eval`` checks before anything loads or is written, refused
    with its messages: ``--batch-size`` below 1, an ``--index`` that does not exist (``calibrate`` and ``train read``
    loaded the model, made their run directory and only then stopped, on a message naming neither flag).

    Raises:
        InputError: the first that is wrong."""
    from fastgate.errors import InputError
    from fastgate.retrieval import check_index_root

    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    check_index_root(index)


def check_read_out(out: Path) -> None:
    """``out`` may receive a read-gate checkpoint: absent, a directory without a ``config.json``, or a read-gate
    checkpoint (replaced). A prober or confidence checkpoint there (or another ``config.json``: a model's) had its
    config replaced by the read gate's, its weights left orphaned.

    Raises:
        InputError: a file, or a directory whose ``config.json`` is not a read-gate checkpoint's (its kind named)."""
    from fastgate.errors import InputError

    if os.path.lexists(out) and not out.is_dir():
        raise InputError(f"{out} exists and is not a directory: choose another --out")
    config = out / "config.json"
    if not os.path.lexists(config):
        return
    try:
        doc = json.loads(config.read_text())
        kind = doc.get("kind") if isinstance(doc, dict) else None
    except (OSError, ValueError):
        kind = None
    if kind == "read":
        return
    what = f"a {kind} checkpoint" if isinstance(kind, str) else "a config.json that is not a read-gate checkpoint's"
    raise InputError(f"{out} holds {what}: `fastgate train read` writes a read checkpoint and would replace it; "
                     "not overwriting it: choose another --out (a new directory, or a read checkpoint to replace)")


def _split(value: str, what: str) -> list[str]:
    from fastgate.errors import InputError

    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise InputError(f"{what} names nothing")
    return items


def _cmd_read(args: argparse.Namespace) -> int:
    from fastgate.assets.paths import home
    from fastgate.errors import InputError
    from fastgate.eval.datasets import refuse_test_split
    from fastgate.gates.read import (
        FEATURE_SETS,
        fit_gain_model,
        fit_shift_gain_model,
        prefill_feature_names,
        save_read_checkpoint,
    )
    from fastgate.methods.read import ReadConfig
    from fastgate.serving.runtime import Runtime

    datas = _split(args.data, "--data")
    for data in datas:
        refuse_test_split(data, "fastgate train read")  # before the model loads
    from fastgate.eval.datasets import is_benchmark, parse_benchmark

    canonical = [str(parse_benchmark(d)) if is_benchmark(d) else str(Path(d).resolve()) if Path(d).is_file() else d
                 for d in datas]
    twice = sorted({d for d, c in zip(datas, canonical) if canonical.count(c) > 1})
    if twice:  # one set under two names (nq:dev and nq:dev:all) pooled its questions twice
        raise InputError(f"--data names one dev set more than once ({', '.join(twice)})")
    ns = []
    for v in _split(str(args.n), "--n"):
        if v not in ("all", "0") and not (v.isascii() and v.isdigit()):
            raise InputError(f"--n takes whole numbers of questions >= 0 or all, one or one per dev set; got {v!r}")
        ns.append(None if v in ("all", "0") else int(v))
    if len(ns) == 1:
        ns = ns * len(datas)
    if len(ns) != len(datas):
        raise InputError(f"--n gives {len(ns)} counts for {len(datas)} dev sets (one count, or one per set)")
    prefill = args.decide == "prefill"
    if prefill and args.rank < 1:
        raise InputError(f"--rank must be >= 1, got {args.rank}")
    if not 0.0 <= args.max_loss < 1.0:
        raise InputError(f"--max-loss must be in [0, 1), got {args.max_loss}")
    # before the pass's minutes: a negative --l2 diverged, a NaN --price was written as the calibration
    if not (args.l2 >= 0 and math.isfinite(args.l2)):
        raise InputError(f"--l2 must be a finite number >= 0, got {args.l2}")
    if args.price is not None and not math.isfinite(args.price):
        raise InputError(f"--price must be a finite number (an accuracy gain), got {args.price}")
    if not 0.0 <= args.adapt < 1.0:
        raise InputError(f"--adapt must be in [0, 1) (0: a plain gain model), got {args.adapt}")
    names = _split(args.features, "--features")
    for name in names:
        if name not in FEATURE_SETS:
            raise InputError(f"--features: unknown set {name!r} (known: {', '.join(FEATURE_SETS)})")
    if prefill and args.layer is not None and args.layer < 0:
        raise InputError(f"--layer must be >= 0 (0: the embeddings), got {args.layer}")
    check_pass_flags(args.batch_size, args.index)  # before the model loads and a pass's directory is made
    if args.out:
        check_read_out(Path(args.out))  # before the passes' minutes, not after them
    runtime = Runtime(args.model, device=args.device, index=args.index, dtype=args.dtype, weights=args.weights)

    def store_dir(data: str) -> Path:
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", data).strip("-")  # nq:dev:balanced -> nq-dev-balanced
        if args.cache:
            return Path(args.cache) if len(datas) == 1 else Path(args.cache) / name
        # the model's name, as the checkpoint's default directory: --model /path/to/hf-dir wrote beside the model
        return home() / "features" / f"{runtime.model_name}-read-{args.base}-{name}"

    # a gate is trained on labels from the passages it will read: BM25's for `all`, dense's for `dense` (its own pass)
    reads = {name: "dense" if name == "dense" else "bm25" for name in names}
    passes: dict[str, tuple] = {}
    layer = (runtime.lm.n_layers // 2 if args.layer is None else args.layer) if prefill else None
    if layer is not None and layer > runtime.lm.n_layers:  # the model just loaded: before any pass, not after it
        raise InputError(f"--layer {layer}: {runtime.model_name} has hidden states 0 to {runtime.lm.n_layers} "
                         f"({runtime.lm.n_layers} layers)")
    projection = None  # the prefill gate's state projection: fitted on the first pass's questions, shared
    for retriever in dict.fromkeys(reads.values()):
        parts = []
        for data, n in zip(datas, ns):
            where = store_dir(data)
            where = where if retriever == "bm25" else where.with_name(where.name + "-dense-reads")
            print(f"training pass: read[base={args.base},collect=true] reading {retriever} passages on {n or 'all'} "
                  f"question(s) of {data} -> {where} (resumable)")
            records = training_pass(runtime, args.base, data, n, where, seed=args.seed, batch_size=args.batch_size,
                                    index=args.index, progress=not args.quiet, reads=retriever)
            hits = search_again(records, runtime.retriever(retriever))  # the passages each record read
            if retriever == "bm25":
                added = backfill_passage_features(records, hits)
                if added:
                    print(f"{added} record(s) made before the passage features: those computed from their BM25 "
                          "passages, searched again")
            answerable = answerable_labels(records, hits)
            rows, fixed, cb, rd = collect_rows(records)
            print(f"{len(rows)} questions of {data}: closed-book ACC {cb.mean():.3f}, with {retriever} passages "
                  f"{rd.mean():.3f}; reading fixes {int(fixed.sum())}, breaks {int((rd < cb).sum())}")
            parts.append((data, records, rows, fixed, cb, rd, answerable))
        rows = [r for p in parts for r in p[2]]
        fixed, cb, rd, answerable = (np.concatenate([p[i] for p in parts]) for i in (3, 4, 5, 6))
        groups = np.array([p[0] for p in parts for _ in p[2]])
        if len(rows) < 10 or fixed.sum() < 2:
            raise InputError(f"read gate: {len(rows)} usable questions with {int(fixed.sum())} fixed by reading "
                             f"{retriever} passages: too few to fit (use more --n)")
        if prefill:  # the same questions, labels and search features; the pre-answer state instead of the answer
            states = [prefill_states(runtime.engine, p[1], layer) for p in parts]
            if projection is None:
                from fastgate.gates.read import fit_state_projection

                projection = fit_state_projection(np.concatenate(states), layer, args.rank)
            rows = [r for p, st in zip(parts, states)
                    for r in prefill_rows(runtime.engine, p[1], p[2], layer, args.rank, projection, st)[0]]
        passes[retriever] = (rows, fixed, (cb > rd).astype(int), cb, rd, groups, answerable)
    models, report, prices = {}, {}, {}
    for name in names:
        rows, fixed, broken, cb, rd, groups, answerable = passes[reads[name]]
        feature_names = prefill_feature_names(name, projection.rank) if prefill else FEATURE_SETS[name]
        rate = args.adapt
        kinds = min(int(answerable.sum()), len(answerable) - int(answerable.sum()))
        if rate > 0 and kinds < 5:  # the answerable model needs both kinds, in every fold
            print(f"{name:>6}  {int(answerable.sum())} of {len(answerable)} questions answerable from the passages "
                  "read: too few of one kind for a shift-gain model; a plain gain model at the training share")
            rate = 0.0
        if rate > 0:
            oof = cross_validated_shift_gains(rows, fixed, broken, answerable, feature_names, groups, l2=args.l2,
                                              rate=rate)
        else:
            oof = cross_validated_gains(rows, fixed, broken, feature_names, groups, l2=args.l2)
        price = choose_price(oof, cb, rd, groups, args.max_loss) if args.price is None else args.price
        prices[name] = price
        table = price_table(oof, cb, rd, groups, price)
        how = "given (--price)" if args.price is not None else \
            f"the highest within {100 * args.max_loss:.1f} point(s) of the better of never and always on every set"
        if args.price is None and not price_meets(oof, cb, rd, groups, price, args.max_loss):
            how = (f"no price keeps every set within {100 * args.max_loss:.1f} point(s) of the better of never and "
                   "always: the one whose worst set loses least")
        print(f"{name:>6}  price of a read {price:.4f} ({how}); out-of-fold on these dev questions, {reads[name]} "
              "reads:")
        _print_table(table)
        curve = learning_curve(rows, fixed, broken, cb, rd, groups, feature_names, price, args.l2, args.seed,
                               answerable=answerable, rate=rate)
        for point in curve:
            print(f"{'':>6}  learning curve: trained on {point['train']}, judged on {point['held_out']} held out:")
            _print_table(point["sets"], indent="          ")
        if rate > 0:
            models[name] = fit_shift_gain_model(rows, fixed, broken, answerable, feature_names, l2=args.l2, rate=rate)
            parts_of = {"answerable": models[name].answerable, "fix": models[name].on.fix,
                        "harm": models[name].on.harm, "fix_off": models[name].off.fix,
                        "harm_off": models[name].off.harm}
        else:
            models[name] = fit_gain_model(rows, fixed, broken, feature_names, l2=args.l2)
            parts_of = {"fix": models[name].fix, "harm": models[name].harm}
        weights = {k: dict(zip(m.features, (round(w, 4) for w in m.weights))) for k, m in parts_of.items()}
        report[name] = {"price": round(price, 6), "out_of_fold": table, "learning_curve": curve, "weights": weights}
        if rate > 0:
            report[name].update({"answerable_share": round(float(answerable.mean()), 4), "adapt": rate})
            print(f"{'':>6}  answerable share of these questions {answerable.mean():.3f}; the gate's estimate moves "
                  f"{rate} per question")
        for k in ("answerable", "fix"):
            if k in weights:
                print(f"{'':>6}  weights ({k}): " + ", ".join(f"{f} {w:+.2f}" for f, w in weights[k].items()))
    rows, fixed, broken, cb, rd, groups, answerable = passes[reads[names[0]]]
    kind = "read-prefill" if prefill else f"read-{args.base}" + ("-dense" if names == ["dense"] else "")
    out = Path(args.out) if args.out else home() / "checkpoints" / f"{runtime.model_name}-{kind}"
    check_read_out(out)
    sets = [{"data": d, "n": int((groups == d).sum()), "fixed": int(fixed[groups == d].sum()),
             "broken": int(broken[groups == d].sum()), "closed_book_acc": round(float(cb[groups == d].mean()), 4),
             "read_acc": round(float(rd[groups == d].mean()), 4)} for d in datas]
    meta = {"data": ",".join(datas), "n": len(rows), "seed": args.seed, "fixed": int(fixed.sum()),
            "broken": int(broken.sum()), "l2": args.l2, "closed_book_acc": round(float(cb.mean()), 4),
            "read_acc": round(float(rd.mean()), 4), "sets": sets, "labels_from_reads": reads,
            "k": ReadConfig.k,  # the passes search with the read method's default k (the gate warns at another)
            "price": {k: round(v, 6) for k, v in prices.items()},
            **({"max_loss": args.max_loss} if args.price is None else {"price_given": True}),
            "answerable": int(answerable.sum())}
    if prefill:
        meta = {**meta, "layer": projection.layer, "rank": projection.rank,
                "pass": f"read[base={args.base},collect=true]"}
    save_read_checkpoint(out, models, model=runtime.lm, base=None if prefill else args.base, meta=meta,
                         decide=args.decide, projection=projection)
    _write_json(out / "training.json", {"command": _command(args, runtime.model_name), **meta,
                                        "report": report})
    if not args.no_calibrate:
        _write_calibration(runtime.model_name, out, args, names, prices, meta)
    mode = "--param decide=prefill" if prefill else f"--param base={args.base}"
    print(f"checkpoint: {out} " + ("(no calibration written: --no-calibrate)" if args.no_calibrate else
                                   "(its price of a read written as its calibration; "
                                   f"`fastgate ask --method read {mode} --param checkpoint={out}` uses it)"))
    print(json.dumps({"checkpoint": str(out), **{k: meta[k] for k in ("data", "n", "fixed", "price")}}))
    return 0


def _command(args, model_name: str) -> str:
    """The command that makes this checkpoint again (the training passes resume from their records)."""
    # every flag that changes what is made or where it goes: the same numeric form, store, index and destination
    extra = (f" --layer {args.layer}" if args.layer is not None else "") + (
        f" --price {args.price}" if args.price is not None else f" --max-loss {args.max_loss}")
    where = "".join(f" --{flag.replace('_', '-')} {shlex.quote(str(getattr(args, flag)))}"
                    for flag in ("dtype", "weights", "cache", "index", "out") if getattr(args, flag) is not None)
    return (f"fastgate train read --model {model_name} --decide {args.decide} --base {args.base} --data {args.data} "
            f"--n {args.n} --features {args.features} --l2 {args.l2} --seed {args.seed}"
            + (f" --rank {args.rank}" if args.decide == "prefill" else "") + f" --adapt {args.adapt}" + extra
            + where + f" --batch-size {args.batch_size}" + (" --no-calibrate" if args.no_calibrate else ""))


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def _write_calibration(model_name: str, out: Path, args, names, prices, meta) -> None:
    """The checkpoint's price as the calibration entry of that checkpoint (keyed by its resolved path)."""
    import time

    from fastgate.methods.calibration import checkpoint_key, write_calibration

    for name in names:
        when = {"checkpoint": checkpoint_key(str(out)), "decide": args.decide, "features": name,
                **({} if args.decide == "prefill" else {"base": args.base})}
        write_calibration(model_name, {
            "method": "read", "when": when, "params": {"threshold": round(prices[name], 6)}, "rule": "price",
            "max_loss": args.max_loss, "data": meta["data"], "n": meta["n"], "seed": args.seed,
            "date": time.strftime("%Y-%m-%d"),
            "note": "fastgate train read: the price of a read (expected accuracy gain) chosen out-of-fold on the "
                    "training questions"})


def add_read_parser(kinds) -> None:
    p = kinds.add_parser("read", help="the read gate (fastgate's extension): collect on dev questions, fit, save")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="embedded model or a local HF directory (default: %(default)s)")
    from fastgate.serving.runtime import RuntimeConfig
    from fastgate.settings import add_setting_args

    # where and in which numeric form the pass answers (a --cache of records made in another refuses to resume in
    # this one): RuntimeConfig's flags, as ask and eval have them
    add_setting_args(p, RuntimeConfig, ("device", "dtype", "weights"))
    p.add_argument("--decide", choices=("answer", "prefill"), default="answer",
                   help="answer: the gate after the closed-book answer; prefill: the gate on the closed-book prompt's "
                        "pre-answer state and the search scores, before generating (read[decide=prefill]; default: "
                        "%(default)s)")
    p.add_argument("--base", default="dtr",
                   help="the gated method whose first signal the gate sees (default: dtr); with --decide prefill, the "
                        "base of the training pass whose records it reuses")
    p.add_argument("--layer", type=int, default=None,
                   help="--decide prefill: the layer of the pre-answer state, 0 (the embeddings) to the model's layer "
                        "count (default: the middle, CBDR's)")
    p.add_argument("--rank", type=int, default=16,
                   help="--decide prefill: principal components of the pre-answer state the gate reads (default: 16)")
    p.add_argument("--data", default="nq:dev:balanced",
                   help="dev sets, comma-separated, pooled (dev splits only; default: nq:dev:balanced)")
    p.add_argument("--n", default="400",
                   help="questions of each set's seeded order: one count for all, or one per set; all for every "
                        "question (default: 400)")
    p.add_argument("--features", default="all,dense", help="feature sets to fit, comma-separated (default: both)")
    p.add_argument("--l2", type=float, default=1.0, help="L2 penalty of the logistic model (default: 1)")
    p.add_argument("--max-loss", type=float, default=0.005,
                   help="the price of a read is the highest at which every dev set stays within this much accuracy "
                        "of the better of never and always, out of fold (default: 0.005, half a point)")
    p.add_argument("--adapt", type=float, default=0.02,
                   help="the gate's estimate of the answerable share moves this much per scored question (both modes; "
                        "a shift-gain model; default 0.02); 0: a plain gain model at the training share")
    p.add_argument("--price", type=float, default=None,
                   help="the price of a read (expected accuracy gain), instead of choosing it by --max-loss")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not write the price as this checkpoint's calibration entry")
    p.add_argument("--out", default=None,
                   help="checkpoint directory (default: $FASTGATE_HOME/checkpoints/<model>-read-<base>)")
    p.add_argument("--cache", default=None, help="records of the training pass (default: under $FASTGATE_HOME)")
    add_pass_args(p, "passes")
    p.set_defaults(func=_cmd_read)
