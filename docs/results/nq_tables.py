"""Tables and plots of docs/RESULTS.md's benchmark section from the eval directories (run from the repo root):

    python docs/results/nq_tables.py docs/results/nq-balanced-qwen2.5-0.5b docs/results/nq-balanced-smollm2-135m

Each directory's records are summarised over all its questions and over its answerable / unanswerable halves (by the
cached corpus split of ``fastgate.eval.datasets``), and every run is compared with ``always`` on the questions both
answered (paired ACC difference with its standard error, answers fixed and broken, retrieval rate relative to
``always``'s) and every gated run with a random gate at its own rate (``fastgate.eval.gate_quality``); writes
``<dir>/tables.md`` and ``<dir>/acc-vs-retrieval.png``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from fastgate.eval.datasets import load_benchmark
from fastgate.eval.gate_quality import BASELINES, coin_section, gate_quality_for_runs
from fastgate.eval.runner import ResultsStore, RunSpec, markdown_table, plot_accuracy_vs_retrieval, summarize
from fastgate.methods import METHODS


def _rows(store, runs, examples, keep) -> list:
    rows = []
    for run in runs:
        recs = [store.records.get((run, e.id)) for e in examples if keep(e)]
        if recs and all(recs):
            rows.append(replace(summarize(RunSpec(recs[0]["method"], recs[0].get("retriever")), recs), run=run))
    return rows


def paired(store, runs, examples, base: str = "always") -> str:
    """Each run against ``base`` on the questions both have: mean ACC difference ± SE, fixed / broken answers."""
    lines = [f"**paired with `{base}`** (same questions; ± one standard error of the mean difference)\n",
             f"| run | n | ACC − {base} | ± SE | fixed | broken | retrievals / {base}'s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        pairs = [(store.records[(run, e.id)], store.records[(base, e.id)]) for e in examples
                 if (run, e.id) in store.records and (base, e.id) in store.records]
        if run == base or len(pairs) < 2:
            continue
        d = [float(a["acc"]) - float(b["acc"]) for a, b in pairs]
        n, m = len(d), sum(d) / len(d)
        se = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n)
        ret = sum(a.get("retrieval_calls") or 0 for a, _ in pairs) / max(1, sum(b.get("retrieval_calls") or 0
                                                                             for _, b in pairs))
        lines.append(f"| {run} | {n} | {m:+.3f} | {se:.3f} | {sum(x > 0 for x in d)} | {sum(x < 0 for x in d)} | "
                     f"{ret:.0%} |")
    return "\n".join(lines) + "\n"


def tables(out: Path) -> str:
    settings = json.loads((out / "eval.json").read_text())
    store = ResultsStore(out / "results.jsonl")
    ids = {i for _, i in store.records}
    examples = [e for e in load_benchmark(settings["data"], seed=settings["seed"], progress=False) if e.id in ids]
    order = {m: i for i, m in enumerate(METHODS)}
    runs = sorted({k for k, _ in store.records}, key=lambda k: (order.get(k.split("[")[0], 99), k))
    text = [f"`{settings['data']}`, model {settings['model']}, seed {settings['seed']}\n"]
    # runs that stopped early cover a prefix of the same seeded order: table them with the others on that prefix
    done = {run: sum((run, e.id) in store.records for e in examples) for run in runs}
    prefixes = sorted({n for n in done.values() if n < len(examples)}, reverse=True)
    full = []
    for size in [len(examples), *prefixes]:
        part = examples[:size]
        for label, keep in (("all", lambda e: True), ("answerable", lambda e: e.meta["answerable"]),
                            ("unanswerable", lambda e: not e.meta["answerable"])):
            rows = _rows(store, runs, part, keep)
            if size == len(examples) and label == "all":
                full = rows
            what = f"first {size} of the {len(examples)}, " if size < len(examples) else ""
            text.append(f"**{label}** ({what}{rows[0].n if rows else 0} questions)\n\n" + markdown_table(rows))
    text.append(paired(store, runs, examples))
    gates = gate_quality_for_runs(store.records, ids=[e.id for e in examples], complete=False,
                                  answerable={e.id: e.meta["answerable"] for e in examples},
                                  runs=[r for r in runs if r.split("[")[0] not in BASELINES])
    if gates:
        text.append(coin_section(gates))
    plot_accuracy_vs_retrieval(full, out / "acc-vs-retrieval.png",
                               f"{settings['data']} ({full[0].n} q), {settings['model']}",
                               labels=[s.method for s in full])
    (out / "tables.md").write_text("\n".join(text))
    return "\n".join(text)


if __name__ == "__main__":
    for d in sys.argv[1:]:
        print(tables(Path(d)))
