"""The report of ``fastgate eval``: the summary table, what each run cost, the coins it is measured against, plots.

Written to ``DIR/summary.md`` (what the command prints), ``DIR/summary.csv`` (one row per run), ``DIR/summary.json``
(every figure below, machine-readable) and ``DIR/*.png``.

**Cost.** A run's seconds per question are its wall time over its questions (:func:`fastgate.eval.runner.summarize`:
each record's share, ``wall_s``, with questions in a sliding window; a batch's time once, with batches), beside the
split of its work: prompt and generated tokens, LM calls, searches (``retrieval_calls``) and reads (the share of
questions whose answer used passages). Every record names the invocation that answered it, and the table says in
how many invocations a run was timed: timings from different sittings are not comparable (machines drift).

**Drift.** When one invocation answers ``always`` beside other runs, it answers ``always`` *again* after every other
run (:func:`run_always_again`, records in ``DIR/always-again.jsonl``, never mixed into ``results.jsonl``): the report
shows both timings, and the time-matched coin uses their mean, so a machine that slows down or speeds up during the
invocation moves ``always``'s cost by half the drift at most instead of all of it.

**The two coins.** Beside the reading-rate coin of :mod:`fastgate.eval.gate_quality` (a random gate that reads on the
run's own share of the questions), the *time-matched coin* (:func:`time_matched_coin`) is the mix of ``never`` and
``always`` that costs what the run cost: it answers a question like ``always`` with probability
``p = (t_run − t_never) / (t_always − t_never)``, clipped to [0, 1], else like ``never``. Its expected accuracy is
``(1 − p)·never_i + p·always_i`` per question; the run's difference to it is paired per question, with the standard
error of the mean difference and a two-sided normal p-value. The timings' own noise is not in that standard error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastgate.errors import InputError
from fastgate.eval.gate_quality import BASELINES, GateQuality, coin_section, gate_quality_for_runs, plot_gate_quality
from fastgate.eval.runner import (
    SLOW_FACTOR,
    ResultsStore,
    RunSpec,
    RunSummary,
    evaluate,
    replace_file,
    save_figure,
    summarize,
    write_summary,
)

__all__ = [
    "AGAIN_FILE",
    "DENSE_ALWAYS",
    "NO_COIN",
    "Oracle",
    "TimeMatched",
    "baseline_keys",
    "dense_always_key",
    "machine_line",
    "new_invocation",
    "oracle_point",
    "plot_cost",
    "reads_dense",
    "run_always_again",
    "time_matched_coin",
    "time_matched_section",
    "write_report",
]

SLOW_SHARE_FLAGGED = 0.2  # a baseline spending more of its time than this in outlier questions is flagged
AGAIN_FILE = "always-again.jsonl"  # always's second pass at the end of an invocation: timing only
DENSE_ALWAYS = "always[retriever=dense]"  # the baseline of a run that reads dense passages, when DIR has it

NO_COIN = ("No coin section: a gated run is measured against a coin only when `never` and `always` have records for "
           "the same questions in this directory; run them in the same invocation as the gate (e.g. `fastgate eval "
           "--method never,always,read`), so that their seconds per question are measured side by side.")

Record = Mapping[str, Any]


def new_invocation() -> str:
    """An id of one ``fastgate eval`` invocation, stored in its records: ``<UTC time>-<pid>``."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{time.perf_counter_ns() % 10**6}"


def machine_line() -> str:
    """The CPU (and GPU) the figures were measured on."""
    import platform

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import torch

    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu} ({os.cpu_count()} cores){gpu}"


def _shared_params(runs: Sequence[RunSpec]) -> tuple[tuple[str, Any], ...]:
    """The parameters (name, value) every run of ``runs`` was given, in the first run's order (keys sort them)."""
    if not runs:
        return ()
    return tuple(p for p in runs[0].params if all(p in r.params for r in runs[1:]))


def _baseline(runs: Sequence[RunSpec], held: Collection[str], method: str, retriever: str | None) -> str:
    """The key of ``method`` (a baseline) with the parameters every run of ``runs`` shares, when such a run is among
    ``runs`` or ``held``; else its key without parameters."""
    matched = RunSpec(method, retriever, _shared_params(runs)).key
    return matched if matched in {r.key for r in runs} or matched in held else RunSpec(method, retriever).key


def baseline_keys(runs: Sequence[RunSpec], held: Collection[str] = ()) -> tuple[str, str]:
    """The run keys of ``never`` and ``always`` that the gated runs of ``runs`` (one invocation's) are measured
    against: each with the parameters every run of ``runs`` shares where that run is among ``runs`` or ``held`` (the
    keys with records), else the plain one (:data:`~fastgate.eval.gate_quality.BASELINES`).

    ``fastgate eval --method never,always,dtr --param k=2`` gives every run ``k=2``: its gate is measured against
    ``always[k=2]``, which reads the 2 passages ``dtr[k=2]`` reads (the plain ``always`` reads 3, and matching exact
    keys found no baseline at all: no coin section, no second ``always`` pass)."""
    return _baseline(runs, held, "never", None), _baseline(runs, held, "always", None)


def dense_always_key(runs: Sequence[RunSpec], held: Collection[str] = ()) -> str:
    """:data:`DENSE_ALWAYS` as :func:`baseline_keys` matches it: with the parameters every run shares where held."""
    return _baseline(runs, held, "always", "dense")


def run_always_again(runtime, runs: Sequence[RunSpec], examples, out: Path, answered: Mapping[str, int], *,
                     batch_size: int, progress: bool, invocation: str | None, schedule: str = "window"
                     ) -> RunSummary | None:
    """Answer ``always`` again at the end of an invocation that ran it beside other runs (see the module docstring).

    It runs when this invocation answered questions of ``always`` (``answered[key]`` > 0) and at least one other run
    is in ``runs``, or when an earlier second pass was cut short (its store holds some of the questions); it resumes
    like any run. Returns the second pass's summary over ``examples`` (None when there is none for all of them)."""
    always_key = baseline_keys(runs)[1]  # the invocation's always: with the parameters every run was given
    always = next((r for r in runs if r.key == always_key), None)
    if always is None or len(runs) < 2:
        return None
    store = ResultsStore(out / AGAIN_FILE)
    held = sum(store.done(always.key, e.id) for e in examples)
    if answered.get(always.key, 0) > 0 or 0 < held < len(examples):
        print(f"timing: answering {always.key} again after the other runs ({len(examples)} question(s)), so that "
              f"drift during the invocation shows -> {store.path}", file=sys.stderr)
        evaluate(runtime, [always], examples, store, batch_size=batch_size, progress=progress, invocation=invocation,
                 schedule=schedule)
    if not all(store.done(always.key, e.id) for e in examples):
        return None
    return summarize(always, [store.records[(always.key, e.id)] for e in examples])


@dataclass(frozen=True)
class TimeMatched:
    """One run against the mix of ``never`` and ``always`` that costs what it cost (accuracies: fractions)."""

    run: str
    n: int
    s_per_q: float  # the run's seconds per question
    never_s: float
    always_s: float  # what the coin pays for always: the mean of its passes
    always_passes: tuple[float, ...]  # always's seconds per question, first pass then again at the end
    share: float  # p: the coin's probability of answering like always, clipped to [0, 1]
    unclipped: float  # (t_run - t_never) / (t_always - t_never): above 1, the run cost more than always
    coin_acc: float  # (1 - p) * never + p * always, mean over the questions
    coin_se: float  # standard error of that mean (over the questions)
    acc: float
    diff: float  # acc - coin_acc, the mean of the paired differences
    diff_se: float
    p_value: float  # two-sided, normal approximation of diff / diff_se
    one_sitting: bool  # the run, never and always were all timed in one invocation


def _p_two_sided(diff: float, se: float) -> float:
    if se != se:
        return float("nan")
    if se == 0:  # no spread among the paired differences: the normal approximation says nothing
        return 1.0 if diff == 0 else float("nan")
    return math.erfc(abs(diff / se) / math.sqrt(2))


def time_matched_coin(gated: Mapping[str, Record], never: Mapping[str, Record], always: Mapping[str, Record],
                      ids: Sequence[str], *, s_run: float, s_never: float, s_always: Sequence[float],
                      run: str = "gated", one_sitting: bool = True) -> TimeMatched:
    """The run (records by question id) against the coin that costs ``s_run`` seconds a question, given ``never``'s
    and ``always``'s (``s_always``: one value per pass; their mean is used). Only questions all three hold count.

    Raises:
        InputError: no question is shared, or no timing of ``always``.
    """
    qids = [q for q in dict.fromkeys(ids) if q in gated and q in never and q in always]
    if not qids:
        raise InputError("time-matched coin: no question has records in the gated run, never and always")
    if not s_always:
        raise InputError("time-matched coin: no timing of always")
    t_always = float(np.mean(s_always))
    span = t_always - s_never
    if not (span == span and s_run == s_run):
        share = unclipped = float("nan")
    elif span <= 0:  # always no dearer than never here: a coin can cost anything between, p is undefined
        share = unclipped = float("nan")
    else:
        unclipped = (s_run - s_never) / span
        share = min(1.0, max(0.0, unclipped))
    acc = np.array([float(gated[q].get("acc") or 0.0) for q in qids])
    nv = np.array([float(never[q].get("acc") or 0.0) for q in qids])
    al = np.array([float(always[q].get("acc") or 0.0) for q in qids])
    n = len(qids)
    coin = (1 - share) * nv + share * al
    diffs = acc - coin
    diff = float(diffs.mean())

    def se(x: np.ndarray) -> float:
        return float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")

    diff_se = se(diffs)
    return TimeMatched(run=run, n=n, s_per_q=float(s_run), never_s=float(s_never), always_s=t_always,
                       always_passes=tuple(float(x) for x in s_always), share=share, unclipped=float(unclipped),
                       coin_acc=float(coin.mean()),
                       coin_se=se(coin), acc=float(acc.mean()), diff=diff, diff_se=diff_se,
                       p_value=_p_two_sided(diff, diff_se), one_sitting=one_sitting)


@dataclass(frozen=True)
class Oracle:
    """Reads exactly where ``never`` is wrong and ``always`` right; its cost on the ``never``–``always`` line."""

    rate: float
    acc: float
    s_per_q: float


def oracle_point(never: Mapping[str, Record], always: Mapping[str, Record], ids: Sequence[str], s_never: float,
                 s_always: float) -> Oracle:
    qids = [q for q in dict.fromkeys(ids) if q in never and q in always]
    nv = np.array([float(never[q].get("acc") or 0.0) for q in qids])
    al = np.array([float(always[q].get("acc") or 0.0) for q in qids])
    fix = (nv <= 0) & (al > 0)
    rate = float(fix.mean()) if len(qids) else float("nan")
    return Oracle(rate=rate, acc=float(np.maximum(nv, al).mean()) if len(qids) else float("nan"),
                  s_per_q=s_never + rate * (s_always - s_never))


def _f(x: float, spec: str) -> str:
    return "–" if x is None or x != x else format(x, spec)


def _share(t: TimeMatched) -> str:
    """The coin's share; a run outside the never-always span says where it is (the clipped share alone read as a
    match: a run costing 1.5x always showed "100.0%" and a difference as if a coin had cost what it cost)."""
    if t.unclipped == t.unclipped and not 0.0 <= t.unclipped <= 1.0:
        return f"{t.share:.1%} (costs {t.unclipped:.0%})"
    return _f(t.share, ".1%")


def _pts(x: float, se: float) -> str:
    return "–" if x != x else f"{100 * x:+.1f}" + (f" ± {100 * se:.1f}" if se == se else "")


def cost_section(table: Sequence[RunSummary], again: RunSummary | None) -> str:
    """What each run cost, per question, with ``always``'s second pass (when there is one) as a row of its own."""
    rows = [(s.run, s) for s in table] + ([(f"{again.run} (again, at the end)", again)] if again else [])
    lines = ["| run | s/question | timed in | prompt tokens/q | generated tokens/q | LM calls/q | searches/q | reads |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in rows:
        sittings = f"{s.invocations} invocations" if s.invocations > 1 else ("one" if s.invocations else "–")
        lines.append(f"| {name} | {_f(s.s_per_q, '.3f')} | {sittings} | {s.prompt_tokens_per_q:.0f} "
                     f"| {s.tokens_per_q:.1f} | {s.lm_calls_per_q:.2f} | {s.retrievals_per_q:.2f} "
                     f"| {s.retrieval_rate:.1%} |")
    text = ("## What each run cost\n\n"
            "Seconds per question: a run's wall time over its questions (questions in a sliding window, or batches "
            "one after another: the records' `schedule`); \"timed in\": the invocations whose records these are "
            "(timings from several sittings are not comparable: machines drift). Searches count retrieval calls "
            "(the read gate searches every "
            "question); reads: the questions whose answer used passages.")
    if again is not None:
        text += (" `always` was answered again after the other runs of the invocation; the time-matched coin pays "
                 "the mean of its two timings.")
        if again.invocations > 1:
            text += (f" Its second pass was answered over {again.invocations} invocations (cut short, then finished "
                     "by a later one): its timing is not from one sitting.")
    for name, s in rows:  # a baseline does the same work for every question: outliers are the machine's
        if s.method in BASELINES and s.slow_share > SLOW_SHARE_FLAGGED:
            text += (f" **{name}'s timing is suspect**: {s.slow_share:.0%} of its wall time went to questions that "
                     f"took over {SLOW_FACTOR:g} times its median question (the machine busy with other work?); the "
                     "coins priced with it move with it.")
    return text + "\n\n" + "\n".join(lines) + "\n"


def time_matched_section(results: Sequence[TimeMatched], oracle: Oracle | None = None) -> str:
    """The markdown of the time-matched coins (part of the coin section)."""
    head = ("| run | s/question | coin: share answered as always | coin's expected ACC (± SE over questions) | ACC "
            "| ACC − coin (± SE) | p | timed in one sitting |")
    rows = [f"| {t.run} | {_f(t.s_per_q, '.3f')} | {_share(t)} | {_f(t.coin_acc, '.3f')} ± "
            f"{_f(t.coin_se, '.3f')} | {t.acc:.3f} | {_pts(t.diff, t.diff_se)} | {_f(t.p_value, '.2g')} "
            f"| {'yes' if t.one_sitting else 'no'} |" for t in results]
    first = next((t for t in results if " (vs " not in t.run), results[0] if results else None)
    times = ""
    if first is not None:
        passes = ", ".join(f"{x:.3f}" for x in first.always_passes)
        times = (f" `never` {first.never_s:.3f} s a question, `always` {passes} s"
                 + (f" (first pass, again at the end; mean {first.always_s:.3f})" if len(first.always_passes) > 1
                    else "") + ".")
    orc = ""
    if oracle is not None and oracle.rate == oracle.rate:
        orc = (f" The oracle (reads where `never` is wrong and `always` right) reads {oracle.rate:.1%} for ACC "
               f"{oracle.acc:.3f}, about {oracle.s_per_q:.3f} s a question on that line.")
    return ("### Against a coin matched on time\n\n"
            "The mix of `never` and `always` that costs what the run cost: p = (t_run − t_never) / (t_always − "
            "t_never), clipped to [0, 1]; per question (1 − p)·never + p·always, paired with the run's answers; p "
            "two-sided from the paired differences (normal approximation; the timings' noise is not in the SE). A run "
            "that cost more than `always` (or less than `never`) is matched with `always` (`never`), its share "
            "marked with what it cost on that line (\"costs 156%\")."
            + times + orc + "\n\n" + "\n".join([head, "|---|" + "---:|" * 6 + "---|", *rows]) + "\n")


def plot_cost(summaries: Sequence[RunSummary], never: RunSummary, always_s: float, always_acc: float,
              oracle: Oracle | None, path: str | Path, title: str,
              dense: tuple[float, float] | None = None, ends: tuple[str, str] = ("always", DENSE_ALWAYS)) -> Path:
    """Accuracy against seconds per question: each run, the ``never``–``always`` line (the time-matched coins) and
    the oracle point; ``dense``: (seconds, ACC) of ``always[retriever=dense]``, whose line the dense runs' coins lie
    on; ``ends``: the run keys of the two ``always`` runs the lines end at (:func:`baseline_keys`,
    :func:`dense_always_key`); written beside ``path`` and renamed into it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'fastgate[eval]'") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.6), dpi=120)
    ax.plot([never.s_per_q, always_s], [never.acc, always_acc], "--", color="0.4", lw=1, zorder=1,
            label="coin matched on time (never → always)")
    if dense is not None:
        ax.plot([never.s_per_q, dense[0]], [never.acc, dense[1]], ":", color="0.4", lw=1, zorder=1,
                label="coin of the dense runs (never → always, dense)")
    if oracle is not None and oracle.rate == oracle.rate:
        ax.scatter([oracle.s_per_q], [oracle.acc], marker="*", s=90, color="0.2", zorder=3,
                   label=f"oracle (reads {oracle.rate:.0%})")
    pts = [s for s in summaries if s.s_per_q == s.s_per_q]
    # `always` where the line ends (the mean of its passes, what the coins pay), not at its first pass's time
    at = {ends[0]: always_s, **({ends[1]: dense[0]} if dense is not None else {})}
    xs = [at.get(s.run, s.s_per_q) for s in pts]
    ax.scatter(xs, [s.acc for s in pts], zorder=4, edgecolor="k")
    for s, x in zip(pts, xs):
        ax.annotate(s.run, (x, s.acc), textcoords="offset points", xytext=(4, 4), fontsize=7,
                    annotation_clip=False)
    ax.set_xlabel("seconds per question (measured)")
    ax.set_ylabel("accuracy (ACC)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return None if x != x or x in (math.inf, -math.inf) else x
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _coin_json(g: GateQuality) -> dict[str, Any]:
    skip = {"curve_rates", "curve_accs", "oracle_accs"}
    return {f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.name not in skip}


def write_report(out: Path, store: ResultsStore, examples, runs: Sequence[RunSpec], summaries: Sequence[RunSummary],
                 *, header: str | Callable[[Sequence[Record]], str], again: RunSummary | None = None,
                 plot_all: bool = False, sweep: tuple[str, str, str] | None = None) -> list[Path]:
    """Summarise every run recorded in ``store`` for ``examples`` (earlier invocations included), print the summary,
    write ``summary.md|csv|json`` and the plots; returns the files written.

    ``header``: the summary's first line, or a function of the records it summarises that makes it (so that it
    says how they were answered, e.g. their schedule, whatever this invocation's flags: they may all be earlier
    ones'). ``again``: ``always``'s second pass (:func:`run_always_again`); ``plot_all``: ``--all``'s plot;
    ``sweep``: ``(method, param, the --sweep text)`` of a sweep. The gated runs are measured against the
    baselines :func:`baseline_keys` names for ``runs``."""
    from fastgate.eval.runner import plot_accuracy_vs_retrieval
    from fastgate.methods import METHODS

    order = {m: i for i, m in enumerate(METHODS)}
    keys = sorted({k for k, _ in store.records}, key=lambda k: (order.get(k.split("[")[0], 99), k))
    ids = [ex.id for ex in examples]
    never_key, always_key = baseline_keys(runs, {k for k, _ in store.records})
    held = ResultsStore(out / AGAIN_FILE)  # always's second pass (none: no records; reading writes nothing)
    if again is None and ids:
        # a report re-rendered by an invocation that did not run always beside others (`--method never`, one run)
        # ignored the second pass on disk: the time-matched coin moved (cost-nq-balanced400: p 0.025 -> 0.045)
        recs = [held.records.get((always_key, q)) for q in ids]
        if all(recs):
            spec = RunSpec(recs[0]["method"], recs[0].get("retriever"))
            again = dataclasses.replace(summarize(spec, recs), run=always_key)
    again_recs: dict[str, Record] = {}
    if again is not None:
        again_recs = {q: held.records[(again.run, q)] for q in ids if (again.run, q) in held.records}
    again_sittings = _sittings(again_recs, ids)
    table: list[RunSummary] = []
    summarised: list[Record] = list(again_recs.values())
    for key in keys:
        recs = [store.records.get((key, ex.id)) for ex in examples]
        if all(recs):
            spec = next((r for r in runs if r.key == key), RunSpec(recs[0]["method"], recs[0].get("retriever")))
            table.append(dataclasses.replace(summarize(spec, recs), run=key))  # an earlier run keeps its parameters
            summarised += recs
    _one_form(store.path, summarised)
    if callable(header):
        header = header(summarised)
    dense_key = dense_always_key(runs, {k for k, _ in store.records})
    by_run: dict[str, dict[str, Record]] = {}
    for (key, qid), rec in store.records.items():
        by_run.setdefault(key, {})[qid] = rec
    split = {ex.id: bool(ex.meta["answerable"]) for ex in examples if "answerable" in ex.meta}
    gated_runs = [s.run for s in table if s.method not in BASELINES]
    # a run that reads dense passages is measured against `always` reading dense passages when DIR has that run
    complete = {k for k, recs in by_run.items() if all(q in recs for q in ids)}
    against = {run: dense_key if dense_key in complete and reads_dense(by_run[run]) else always_key
               for run in gated_runs}
    baselines = (never_key, always_key)
    gates = gate_quality_for_runs(store.records, ids=ids, answerable=split or None,
                                  runs=[r for r in gated_runs if against[r] == always_key], baselines=baselines)
    dense_runs = [r for r in gated_runs if against[r] == dense_key]
    if dense_runs:
        view = {(always_key if k == dense_key else k, q): rec for (k, q), rec in store.records.items()
                if k != always_key}
        gates += gate_quality_for_runs(view, ids=ids, answerable=split or None, runs=dense_runs,
                                       baselines=baselines)
        gates.sort(key=lambda g: gated_runs.index(g.run))
    labels = [g.run + (f" (vs {dense_key})" if against[g.run] == dense_key else "") for g in gates]
    rows = {s.run: s for s in table}
    never_s, always_s = rows.get(never_key), rows.get(always_key)
    timed: list[TimeMatched] = []
    oracle, oracle_always_s = None, float("nan")
    if gates and never_s is not None:
        timings = {key: [x for x in [rows[key].s_per_q] + ([again.s_per_q] if again is not None
                                                           and key == always_key else []) if x == x]
                   for key in (always_key, dense_key) if key in rows}
        if timings.get(always_key):
            oracle_always_s = float(np.mean(timings[always_key]))
            oracle = oracle_point(by_run[never_key], by_run[always_key], ids, never_s.s_per_q, oracle_always_s)
        never_sittings = _sittings(by_run[never_key], ids)
        for g, label in zip(gates, labels):
            key = against[g.run]
            if not timings.get(key):
                continue
            union = _sittings(by_run[g.run], ids) | never_sittings | _sittings(by_run[key], ids)
            if key == always_key and again is not None:  # the coin pays the second pass's timing too
                union |= again_sittings
            timed.append(time_matched_coin(by_run[g.run], by_run[never_key], by_run[key], ids,
                                           s_run=rows[g.run].s_per_q, s_never=never_s.s_per_q,
                                           s_always=timings[key], run=label,
                                           one_sitting=len(union) == 1 and "" not in union))
    sections = [cost_section(table, again)]
    no_coin = None
    if gates:
        # baselines given the invocation's parameters: the section says which runs "never" and "always" are
        named = "" if baselines == BASELINES else (f"The baselines are `{never_key}` and `{always_key}` (the "
                                                   "parameters every run of the invocation was given).\n\n")
        sections.append(named + coin_section(gates, labels)
                        + ("\n" + time_matched_section(timed, oracle) if timed else ""))
    elif gated_runs:
        no_coin = NO_COIN
        sections.append(NO_COIN + "\n")
    md, cs = write_summary(out, table, header=header, sections=sections)
    print(header + "\n")
    print(md.read_text().split("\n\n", 1)[-1], end="")
    doc = {"header": header, "runs": [dataclasses.asdict(s) for s in table],
           "always_again": dataclasses.asdict(again) if again is not None else None,
           "coin": [_coin_json(g) for g in gates], "time_matched": [dataclasses.asdict(t) for t in timed],
           "oracle": dataclasses.asdict(oracle) if oracle is not None else None, "no_coin": no_coin}
    js = out / "summary.json"
    replace_file(js, lambda tmp: tmp.write_text(json.dumps(_jsonable(doc), indent=1) + "\n"))
    written = [md, cs, js]
    n = len(examples)
    try:
        if gates:
            written.append(plot_gate_quality(gates, out / "gate-quality.png", f"do the gates beat a coin? ({n} q)",
                                             labels=labels))
        if oracle is not None and never_s is not None and always_s is not None:
            dense = rows.get(dense_key)
            dense_line = (float(np.mean(timings[dense_key])), dense.acc) \
                if dense is not None and timings.get(dense_key) else None
            written.append(plot_cost(table, never_s, oracle_always_s, always_s.acc, oracle, out / "cost.png",
                                     f"accuracy against time ({n} q)", dense=dense_line, ends=(always_key, dense_key)))
        if sweep is not None:
            method, key, text = sweep
            anchors = [s for s in table if s.run in baselines]
            points = [s for s in summaries if s.run not in baselines]
            labels = [s.run for s in anchors] + [f"{key}={dict(r.params).get(key)}" for r, s in zip(runs, summaries)
                                                 if s.run not in baselines]
            written.append(plot_accuracy_vs_retrieval(anchors + points, out / f"sweep-{method}-{key}.png",
                                                      f"{method}: {text} ({n} q)", labels=labels))
        elif plot_all:
            written.append(plot_accuracy_vs_retrieval(summaries, out / "all.png", f"all methods ({n} q)",
                                                      labels=[s.method for s in summaries]))
    except InputError as exc:  # matplotlib missing: the tables are written all the same (every plot, once said)
        print(f"fastgate: no plot: {exc}", file=sys.stderr)
    if no_coin:
        print(f"fastgate: {no_coin}", file=sys.stderr)
    return written


def reads_dense(recs: Mapping[str, Record]) -> bool:
    """Whether a run reads dense passages: the read gate with ``features=dense`` (it searches and reads only dense),
    else a run whose retriever is ``dense``."""
    first = next(iter(recs.values()), {})
    if first.get("method") == "read":
        return (first.get("params") or {}).get("features") == "dense"
    return first.get("retriever") == "dense"


def _one_form(where: Path, records: Sequence[Record]) -> None:
    """Refuse to put records of more than one engine, dtype or weights format into one table (the records that name
    them; :func:`fastgate.eval.runner.check_form` refuses them before an evaluation answers anything)."""
    for field in ("engine", "dtype", "weights"):
        seen: dict[Any, Record] = {}
        for rec in records:
            if field in rec:
                seen.setdefault(rec[field], rec)
        if len(seen) > 1:
            made = ", ".join(f"{v} (run {r.get('run')!r}, e.g. question {r.get('id')})" for v, r in seen.items())
            raise InputError(f"{where} holds records of more than one {field}: {made}; they are never summarised in "
                             "one table: evaluate into a new --out directory")


def _sittings(recs: Mapping[str, Record], ids: Sequence[str]) -> set[str]:
    """The invocations that answered these questions ("" for records from before records named theirs)."""
    return {str(recs[q].get("invocation") or "") for q in ids if q in recs}
