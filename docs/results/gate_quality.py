"""Do the gates beat a coin? Every gated run of the committed eval directories against a random gate that retrieves at
the same rate (``fastgate.eval.gate_quality``), from the records alone (run from the repo root):

    python docs/results/gate_quality.py                      # every directory under docs/results with never and always
    python docs/results/gate_quality.py docs/results/nq-balanced400-qwen2.5-0.5b

Prints one table over all the directories' questions (docs/RESULTS.md, "Do the gates beat a coin?"); writes
``docs/results/gate-quality.md`` with it and, per directory, the same on the answerable half alone, and
``<dir>/gate-quality.png``. The answerable / unanswerable halves come from the corpus split of
``fastgate.eval.datasets.load_benchmark`` (the default corpus's BM25 index; cached after the first run); a directory
whose questions are not all in today's split (the v1 directories, made under the first split) gets no split.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastgate.errors import FastgateError
from fastgate.eval.datasets import is_benchmark, load_benchmark, parse_benchmark
from fastgate.eval.gate_quality import (
    BASELINES,
    GateQuality,
    gate_quality_for_runs,
    gate_quality_table,
    plot_gate_quality,
)
from fastgate.eval.runner import ResultsStore
from fastgate.methods import METHODS

ROOT = Path(__file__).resolve().parent


def _split(settings: dict, ids: set[str]) -> tuple[list[str] | None, dict[str, bool] | None, str]:
    """The directory's questions in the benchmark's seeded order and their answerability, or None with the reason."""
    data = settings["data"]
    if not is_benchmark(data) or parse_benchmark(data).subset == "all":
        return None, None, f"`{data}` has no corpus split"
    try:
        examples = load_benchmark(data, seed=settings["seed"], progress=False)
    except FastgateError as exc:
        return None, None, f"no corpus split ({exc})"
    found = {e.id: e for e in examples if e.id in ids}
    if len(found) < len(ids):
        return None, None, f"{len(ids) - len(found)} of its {len(ids)} questions are not in today's split of `{data}`"
    order = [e.id for e in examples if e.id in ids]
    return order, {q: bool(found[q].meta["answerable"]) for q in order}, ""


def directory(path: Path, seed: int = 0) -> tuple[list[GateQuality], str]:
    """The gated runs of one eval directory against its never and always: the results on all its questions, and the
    markdown of its section (all questions, then the answerable half)."""
    settings = json.loads((path / "eval.json").read_text())
    store = ResultsStore(path / "results.jsonl")
    runs = {k for k, _ in store.records}
    order = {m: i for i, m in enumerate(METHODS)}
    gated = sorted((k for k in runs if k.split("[")[0] not in BASELINES),
                   key=lambda k: (order.get(k.split("[")[0], 99), k))
    ids = {q for (k, q) in store.records if k == BASELINES[0]} & {q for (k, q) in store.records if k == BASELINES[1]}
    ids_ordered, answerable, why = _split(settings, ids)
    # a run that stopped early is measured on the questions it has (its n says so)
    every = gate_quality_for_runs(store.records, ids=ids_ordered or sorted(ids), answerable=answerable, runs=gated,
                                  complete=False, seed=seed)
    head = f"### {path.name}\n\n`{settings['data']}`, model {settings['model']}, seed {settings['seed']}: " \
           f"{len(ids)} questions with `never` and `always`"
    if not every:
        return [], head + "; no gated run.\n"
    text = [head + (f"; {why}" if why else "") + ".\n", "**all questions**\n", gate_quality_table(every)]
    if answerable is not None:
        half = [q for q in ids_ordered if answerable[q]]
        text += [f"**answerable half** ({len(half)} questions)\n",
                 gate_quality_table(gate_quality_for_runs(store.records, ids=half, runs=gated, complete=False,
                                                          seed=seed))]
    plot_gate_quality(every, path / "gate-quality.png",
                      f"{settings['data']} ({len(ids)} q), {settings['model']}: do the gates beat a coin?")
    return every, "\n".join(text)


def main(argv: list[str]) -> int:
    dirs = [Path(a) for a in argv] or sorted(p.parent for p in ROOT.glob("*/eval.json"))
    rows, labels, sections = [], [], []
    for d in dirs:
        store_runs = {run for run, _ in ResultsStore(d / "results.jsonl").records}  # or results.jsonl.gz
        if not set(BASELINES) <= store_runs:
            continue
        every, text = directory(d)
        rows += every
        labels += [f"{d.name}: {g.run}" for g in every]
        sections.append(text)
    summary = gate_quality_table(rows, labels)
    out = ROOT / "gate-quality.md"
    out.write_text("# Do the gates beat a coin?\n\nWritten by `python docs/results/gate_quality.py` (the columns: "
                   "`fastgate/eval/gate_quality.py`; differences in points).\n\n## Every directory, all questions\n\n"
                   + summary + "\n## By directory\n\n" + "\n".join(sections))
    print(summary)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
