"""Gate quality: does a gate beat a coin that retrieves at the same rate?

A gated run decides per question whether to retrieve. Its accuracy alone says little: retrieving more usually helps,
so a gate that retrieves on 70% of the questions should be compared with a *random gate* at 70%, which scores
``(1 - r) * never_i + r * always_i`` per question in expectation (``never`` and ``always`` being the two ungated runs
on the same questions). This module measures, for one gated run against ``never`` and ``always``:

* ``acc - random``: the gate's own accuracy minus the random gate's at the gate's rate, paired per question (± the
  standard error of the mean difference);
* ``replay - random``: the gate's decisions replayed on ``never``'s and ``always``'s answers (retrieve: ``always``'s
  score, else ``never``'s), so answer differences between the gated run and ``always`` drop out; its p-value comes from
  a permutation test that shuffles the decisions across the questions (two-sided, on ``|replay - random|``);
* the *oracle* at the same rate: retrieve where ``never`` is wrong and ``always`` right, then where it makes no
  difference, then where it breaks an answer;
* AUROCs of the gate's first score (``gate_steps[0].score``, oriented so that higher means retrieve: the orientation
  comes from the gate's own decisions against its threshold) for "``never`` is wrong", for "``always`` fixes it" among
  the questions ``never`` gets wrong, and for "the corpus can answer it" when the split is given;
* the threshold curve: retrieve on the top fraction ``r`` of the questions by that score (ties in expectation), for
  every ``r``; its area above the random line as a share of the oracle curve's.

A question's decision is its record's ``retrieved`` (a run may fetch passages and decide not to read them: what
counts is whether it used them); records without the field fall back to ``retrieval_calls > 0``. A record with no gate
step (a rejected question) ranks by that decision: above every score when it retrieved, below otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastgate.errors import InputError
from fastgate.eval.metrics import decision

__all__ = [
    "BASELINES",
    "GateQuality",
    "auroc",
    "coin_section",
    "decision",
    "gate_quality",
    "gate_quality_for_runs",
    "gate_quality_table",
    "oriented_scores",
    "plot_gate_quality",
    "threshold_curve",
]

# the ungated methods a gate is measured against, and their runs' keys in an eval store when given no parameters
BASELINES = ("never", "always")

Record = Mapping[str, Any]


@dataclass(frozen=True)
class GateQuality:
    """One gated run against a random gate, the oracle and its own score's threshold curve, on ``n`` questions.

    Accuracies are fractions of the ``n`` questions; differences too (multiply by 100 for points). NaN where a figure
    is undefined (an AUROC with one class empty, a standard error of one question, an oracle with nothing to gain).
    """

    run: str
    gate: str  # name of the first gate step's signal ("" when no record has one)
    n: int
    rate: float  # share of the questions the gate retrieved on
    acc: float  # the gated run's own accuracy
    never_acc: float
    always_acc: float
    random_acc: float  # (1 - rate) * never_acc + rate * always_acc
    diff: float  # acc - random_acc, the mean of the per-question paired differences
    diff_se: float  # standard error of that mean
    replay_acc: float  # the gate's decisions on never's / always's answers
    replay_diff: float  # replay_acc - random_acc
    perm_p: float  # two-sided permutation p-value of replay_diff (decisions shuffled across questions)
    n_permutations: int
    oracle_acc: float  # the oracle at the gate's rate
    auroc_wrong: float  # first score for "never's answer is wrong"
    auroc_fixes: float  # among never-wrong questions: first score for "always's answer is right"
    auroc_answerable: float  # first score for "the corpus answers it" (NaN without the split or with one class)
    curve_rates: tuple[float, ...]  # 0, 1/n, ..., 1
    curve_accs: tuple[float, ...]  # retrieve on the top fraction by first score (ties in expectation)
    oracle_accs: tuple[float, ...]  # the oracle at the same rates
    area: float  # area of the curve above the random line / the oracle curve's (1: oracle, 0: a coin, < 0: worse)
    n_scored: int  # questions whose record has a gate step


def _acc(record: Record) -> float:
    return float(record.get("acc") or 0.0)


def oriented_scores(records: Sequence[Record]) -> tuple[np.ndarray, str, int]:
    """The first gate score of each record, signed so that higher means retrieve; its gate name; how many had one.

    The sign is the one under which the gate's own first decisions agree more often with ``score > threshold`` (a
    gate retrieving below its threshold, like a confidence, is negated). Records without a gate step get +inf when
    they retrieved and -inf otherwise.
    """
    firsts = [(r.get("gate_steps") or [None])[0] for r in records]
    above = below = 0
    for step in firsts:
        if step is None or step.get("score") is None or step.get("threshold") is None:
            continue
        score, threshold, retrieve = float(step["score"]), float(step["threshold"]), bool(step.get("retrieve"))
        if score == threshold:
            continue
        above += retrieve == (score > threshold)
        below += retrieve == (score < threshold)
    sign = 1.0 if above >= below else -1.0
    out = np.empty(len(records))
    for i, (rec, step) in enumerate(zip(records, firsts)):
        if step is None or step.get("score") is None or not math.isfinite(float(step["score"])):
            out[i] = math.inf if decision(rec) else -math.inf
        else:
            out[i] = sign * float(step["score"])
    names = [s.get("gate", "") for s in firsts if s is not None]
    gate = max(set(names), key=names.count) if names else ""
    return out, gate, sum(s is not None and s.get("score") is not None for s in firsts)


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x))
    start = 0
    while start < len(x):
        stop = start
        while stop + 1 < len(x) and xs[stop + 1] == xs[start]:
            stop += 1
        ranks[order[start:stop + 1]] = (start + stop) / 2 + 1
        start = stop + 1
    return ranks


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """P(score of a positive > score of a negative), ties counting one half; NaN when a class is empty."""
    x = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=bool)
    if x.shape != y.shape:
        raise InputError(f"auroc: {len(x)} scores but {len(y)} labels")
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    ranks = _average_ranks(x)
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def threshold_curve(scores: Sequence[float], never: Sequence[float], always: Sequence[float]) -> np.ndarray:
    """Accuracy when retrieving on the top ``k`` questions by score, for ``k = 0 .. n`` (``n + 1`` values).

    A retrieved question scores ``always``'s accuracy, another ``never``'s. Within a group of tied scores the order is
    random: the curve is its expectation, linear across the group.
    """
    x = np.asarray(scores, dtype=float)
    nv = np.asarray(never, dtype=float)
    al = np.asarray(always, dtype=float)
    n = len(x)
    if not (len(nv) == len(al) == n) or n == 0:
        raise InputError(f"threshold_curve: needs as many (> 0) scores as never and always values, got {n}, "
                         f"{len(nv)}, {len(al)}")
    order = np.argsort(-x, kind="mergesort")
    xs, gain = x[order], (al - nv)[order]
    cum = np.zeros(n + 1)
    start = 0
    while start < n:
        stop = start
        while stop + 1 < n and xs[stop + 1] == xs[start]:
            stop += 1
        size = stop - start + 1
        total = gain[start:stop + 1].sum()
        cum[start + 1:stop + 2] = cum[start] + total * np.arange(1, size + 1) / size
        start = stop + 1
    return (nv.sum() + cum) / n


def _area_above(curve: np.ndarray, lo: float, hi: float) -> float:
    rates = np.linspace(0.0, 1.0, len(curve))
    gap = curve - (lo + (hi - lo) * rates)
    return float(np.sum((gap[1:] + gap[:-1]) / 2) / (len(curve) - 1)) if len(curve) > 1 else 0.0


def _perm(g: GateQuality) -> str:
    """The permutation p as printed: at its floor (no shuffle as extreme) the bound, not an estimate ("<= 1e-04")."""
    if g.n_permutations > 0 and g.perm_p == g.perm_p and g.perm_p <= 1.0 / (1 + g.n_permutations) + 1e-15:
        return f"≤ {1.0 / (1 + g.n_permutations):.0e}"
    return _fmt(g.perm_p, ".2g")


def _permutation_p(d: np.ndarray, gain: np.ndarray, n_permutations: int, seed: int) -> float:
    """Two-sided: the share of shuffles of ``d`` whose replayed gain is at least as far from a coin's as ``d``'s,
    counting ``d`` itself ((1 + hits) / (1 + permutations))."""
    n, k = len(d), int(d.sum())
    if n_permutations <= 0:
        return float("nan")
    expected = k * gain.mean()
    observed = abs(float(gain[d].sum()) - expected)
    rng = np.random.default_rng(seed)
    hits, done, chunk = 0, 0, max(1, min(n_permutations, 2_000_000 // max(n, 1)))
    tolerance = 1e-9 * max(1.0, float(np.abs(gain).sum()))
    while done < n_permutations:
        m = min(chunk, n_permutations - done)
        shuffled = rng.permuted(np.broadcast_to(d, (m, n)), axis=1)
        hits += int(np.count_nonzero(np.abs(shuffled @ gain - expected) >= observed - tolerance))
        done += m
    return (1 + hits) / (1 + n_permutations)


def gate_quality(gated: Mapping[str, Record], never: Mapping[str, Record], always: Mapping[str, Record], *,
                 ids: Iterable[str] | None = None, answerable: Mapping[str, bool] | None = None,
                 n_permutations: int = 10_000, seed: int = 0, run: str | None = None) -> GateQuality:
    """Measure one gated run against ``never`` and ``always`` (records keyed by question id).

    Args:
        gated, never, always: records of the three runs, by question id (keys ``acc``, ``retrieved`` or
            ``retrieval_calls``, ``gate_steps``).
        ids: restrict to these questions (e.g. the answerable half); default: all. Either way only the questions all
            three runs hold are used, in the order of ``ids`` (or of ``gated``).
        answerable: question id -> whether the corpus answers it, for ``auroc_answerable`` (questions it does not name
            are left out of that AUROC only).
        n_permutations: shuffles for ``perm_p`` (0: no test, NaN).
        seed: of the shuffles.
        run: the name in tables (default: the ``run`` field of the gated records).

    Raises:
        InputError: no question is shared by the three runs.
    """
    wanted = list(ids) if ids is not None else list(gated)
    qids = [q for q in dict.fromkeys(wanted) if q in gated and q in never and q in always]
    if not qids:
        raise InputError("gate quality: no question has records in the gated run, never and always")
    recs = [gated[q] for q in qids]
    name = run if run is not None else str(recs[0].get("run", "gated"))
    n = len(qids)
    acc = np.array([_acc(r) for r in recs])
    nv = np.array([_acc(never[q]) for q in qids])
    al = np.array([_acc(always[q]) for q in qids])
    d = np.array([decision(r) for r in recs], dtype=bool)
    rate = float(d.mean())
    random_i = (1 - rate) * nv + rate * al
    diffs = acc - random_i
    diff = float(diffs.mean())
    diff_se = float(diffs.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    random_acc = float(random_i.mean())
    gain = al - nv
    replay_acc = float(np.where(d, al, nv).mean())
    scores, gate, n_scored = oriented_scores(recs)
    curve = threshold_curve(scores, nv, al)
    oracle = threshold_curve(gain, nv, al)  # fixes first, then no difference, then breaks
    k = int(d.sum())
    wrong = nv <= 0
    area_oracle = _area_above(oracle, float(nv.mean()), float(al.mean()))
    area = _area_above(curve, float(nv.mean()), float(al.mean()))
    if answerable is not None:
        known = [i for i, q in enumerate(qids) if q in answerable]
        auroc_ans = auroc(scores[known], [bool(answerable[qids[i]]) for i in known]) if known else float("nan")
    else:
        auroc_ans = float("nan")
    return GateQuality(
        run=name, gate=gate, n=n, rate=rate, acc=float(acc.mean()), never_acc=float(nv.mean()),
        always_acc=float(al.mean()), random_acc=random_acc, diff=diff, diff_se=diff_se, replay_acc=replay_acc,
        replay_diff=replay_acc - random_acc, perm_p=_permutation_p(d, gain, n_permutations, seed),
        n_permutations=n_permutations, oracle_acc=float(oracle[k]), auroc_wrong=auroc(scores, wrong),
        auroc_fixes=auroc(scores[wrong], al[wrong] > 0), auroc_answerable=auroc_ans,
        curve_rates=tuple(float(x) for x in np.linspace(0.0, 1.0, n + 1)), curve_accs=tuple(float(x) for x in curve),
        oracle_accs=tuple(float(x) for x in oracle),
        area=area / area_oracle if area_oracle > 0 else float("nan"), n_scored=n_scored,
    )


def gate_quality_for_runs(records: Mapping[tuple[str, str], Record], *, ids: Iterable[str] | None = None,
                          answerable: Mapping[str, bool] | None = None, runs: Sequence[str] | None = None,
                          complete: bool = True, n_permutations: int = 10_000, seed: int = 0,
                          baselines: tuple[str, str] = BASELINES) -> list[GateQuality]:
    """Every gated run of an eval store's records (``(run, id) -> record``) against its ``never`` and ``always``.

    Args:
        records: e.g. ``ResultsStore(path).records``.
        ids: the questions (default: every question ``never`` and ``always`` both answered).
        answerable: question id -> corpus answerability (for ``auroc_answerable``).
        runs: the gated runs to measure, in order (default: every run whose method is neither baseline, in the
            store's order).
        complete: skip a run that lacks a record for one of ``ids`` (the summary tables' rule) instead of measuring it
            on the questions it has.
        n_permutations, seed: of the permutation tests.
        baselines: the run keys of ``never`` and ``always`` (e.g. ``never[k=2]``, ``always[k=2]`` for gated runs
            given ``k=2`` too: :func:`fastgate.eval.report.baseline_keys`).

    Returns:
        One :class:`GateQuality` per run; empty when ``never`` or ``always`` has none of the questions.
    """
    by_run: dict[str, dict[str, Record]] = {}
    for (key, qid), rec in records.items():
        by_run.setdefault(key, {})[qid] = rec
    never, always = by_run.get(baselines[0], {}), by_run.get(baselines[1], {})
    wanted = list(ids) if ids is not None else [q for q in never if q in always]
    shared = [q for q in wanted if q in never and q in always]
    if not shared or (complete and len(shared) < len(wanted)):
        return []
    if runs is None:
        runs = [k for k, recs in by_run.items()
                if k not in baselines and next(iter(recs.values())).get("method") not in BASELINES]
    out = []
    for key in runs:
        recs = by_run.get(key, {})
        if not any(q in recs for q in shared) or (complete and not all(q in recs for q in shared)):
            continue
        out.append(gate_quality(recs, never, always, ids=shared, answerable=answerable, n_permutations=n_permutations,
                                seed=seed, run=key))
    return out


def _points(x: float, se: float | None = None) -> str:
    if x != x:
        return "–"
    text = f"{100 * x:+.1f}"
    return text + (f" ± {100 * se:.1f}" if se is not None and se == se else "")


def _fmt(x: float, spec: str) -> str:
    return "–" if x != x else format(x, spec)


def gate_quality_table(results: Sequence[GateQuality], labels: Sequence[str] | None = None) -> str:
    """A markdown table, one row per gated run (``labels`` replace the run names); differences in points."""
    names = list(labels) if labels is not None else [g.run for g in results]
    head = ("| run | first score | n | retrieves | ACC | random gate at that rate | ACC − random (± SE) "
            "| own decisions − random (perm. p) | oracle at that rate | AUROC wrong | AUROC fixes | AUROC answerable "
            "| curve area above random / oracle's |")
    rule = "|---|---|" + "---:|" * 11
    rows = [f"| {name} | {g.gate or '–'} | {g.n} | {g.rate:.1%} | {g.acc:.3f} | {g.random_acc:.3f} "
            f"| {_points(g.diff, g.diff_se)} | {_points(g.replay_diff)} ({_perm(g)}) "
            f"| {g.oracle_acc:.3f} | {_fmt(g.auroc_wrong, '.2f')} | {_fmt(g.auroc_fixes, '.2f')} "
            f"| {_fmt(g.auroc_answerable, '.2f')} | {_fmt(g.area, '+.2f')} |" for name, g in zip(names, results)]
    return "\n".join([head, rule, *rows]) + "\n"


COIN_HEADING = "Do the gates beat a coin?"


def coin_section(results: Sequence[GateQuality], labels: Sequence[str] | None = None) -> str:
    """The markdown section of an eval summary: a heading, what the columns mean, the table."""
    return (f"## {COIN_HEADING}\n\n"
            "Each gated run against a random gate that retrieves on the same share of these questions (per question "
            "(1 − r)·never + r·always), paired per question; \"own decisions\" replays the run's retrieve / skip "
            "decisions on never's and always's answers, its p from shuffling the decisions across questions "
            "(two-sided); the oracle retrieves where never is wrong and always right first; AUROCs of the first gate "
            "score (oriented: higher = retrieve) for never wrong, for always right among those, and for the corpus "
            "answering the question; the curve retrieves on the top fraction by that score. Differences in points.\n\n"
            + gate_quality_table(results, labels))


def plot_gate_quality(results: Sequence[GateQuality], path: str | Path, title: str,
                      labels: Sequence[str] | None = None) -> Path:
    """Accuracy against retrieval rate: the random line from ``never`` to ``always``, the oracle curve, and per gate
    its thresholded first-score curve and its own point (the gated run's accuracy at its rate).

    Runs measured on other questions (other baselines) get their own random line and oracle, drawn once each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'fastgate[eval]'") from None
    if not results:
        raise InputError("plot_gate_quality: no gated run to plot")
    names = list(labels) if labels is not None else [g.run for g in results]
    fig, ax = plt.subplots(figsize=(6.4, 4.6), dpi=120)
    drawn = set()
    for g in results:
        key = (g.n, g.never_acc, g.always_acc, g.oracle_accs)
        if key in drawn:
            continue
        first = not drawn
        drawn.add(key)
        ax.plot([0, 1], [g.never_acc, g.always_acc], "--", color="0.4", lw=1, zorder=1,
                label="random gate (never → always)" if first else None)
        ax.plot(g.curve_rates, g.oracle_accs, "-", color="0.75", lw=1.5, zorder=1, label="oracle" if first else None)
        ax.scatter([0, 1], [g.never_acc, g.always_acc], color="0.3", s=14, zorder=3)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    for i, (name, g) in enumerate(zip(names, results)):
        c = colors[i % len(colors)]
        ax.plot(g.curve_rates, g.curve_accs, "-", color=c, lw=1, alpha=0.8, zorder=2,
                label=f"{name}: {g.gate or 'score'} thresholded")
        ax.scatter([g.rate], [g.acc], color=c, edgecolor="k", s=36, zorder=4)
        ax.annotate(name, (g.rate, g.acc), textcoords="offset points", xytext=(4, 4), fontsize=7,
                    annotation_clip=False)
    ax.set_xlabel("questions that retrieved")
    ax.set_ylabel("accuracy (ACC)")
    ax.set_xlim(-0.03, 1.03)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    from fastgate.eval.runner import save_figure  # written beside its place and renamed into it

    return save_figure(fig, path)
