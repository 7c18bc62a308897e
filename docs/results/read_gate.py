"""The read gate on the committed test runs: against the random gate at its own reading rate, the oracle and `always`,
on all questions and on the answerable half (run from the repo root):

    python docs/results/read_gate.py docs/results/nq-balanced400-qwen2.5-0.5b \
        docs/results/triviaqa-balanced-qwen2.5-0.5b --replay-dense

For each directory and each run of the read gate (``read``, ``read[features=dense]``) it prints the gate-quality row
(``fastgate.eval.gate_quality``), the paired difference with ``always`` (± SE), and how many of the questions the gate
read were answered exactly as ``always`` answered them (same passages, same prompt: they should all be). A run missing
from a directory is left out; ``--replay-dense`` adds the dense-only gate's decisions computed from the features the
``read`` run recorded (its logistic model on the same feature values, at its calibrated threshold), replayed on
``never``'s and ``always``'s answers, labelled as a replay.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from fastgate.eval.datasets import load_benchmark, parse_benchmark
from fastgate.eval.gate_quality import gate_quality, gate_quality_table
from fastgate.eval.runner import ResultsStore

RUNS = ("read", "read[features=dense]")


def _split(directory: Path) -> dict[str, bool] | None:
    import json

    settings = json.loads((directory / "eval.json").read_text())
    spec = parse_benchmark(settings["data"])
    answerable = {e.id: True for e in load_benchmark(parse_benchmark(f"{spec.name}:{spec.split}:answerable"),
                                                     progress=False)}
    unanswerable = {e.id: False for e in load_benchmark(parse_benchmark(f"{spec.name}:{spec.split}:unanswerable"),
                                                        progress=False)}
    return {**answerable, **unanswerable}


def _replayed_dense(read: dict[str, dict], model_name: str) -> dict[str, dict]:
    """The dense-only gate's decisions on the features the ``read`` run recorded (no model run)."""
    from fastgate.gates.checkpoints import DEFAULT_CHECKPOINTS
    from fastgate.gates.read import load_read_checkpoint
    from fastgate.methods.calibration import calibrated_params

    model = load_read_checkpoint(DEFAULT_CHECKPOINTS / f"{model_name}-read-dtr", "dense")
    threshold = calibrated_params(model_name, "read", {"features": "dense"})["threshold"]
    qids = list(read)
    logits = model.logits([read[q]["details"]["features"] for q in qids])
    out = {}
    for q, z in zip(qids, logits):
        rec = dict(read[q])
        rec["retrieved"] = bool(z >= threshold)
        rec["gate_steps"] = [{"gate": "read", "score": float(z), "threshold": threshold,
                              "retrieve": bool(z >= threshold)}]
        rec["acc"] = float("nan")  # its own answers were not generated: only the replay counts
        out[q] = rec
    return out


def report(directory: Path, replay_dense: bool) -> str:
    store = ResultsStore(directory / "results.jsonl")
    by_run: dict[str, dict[str, dict]] = {}
    for (key, qid), rec in store.records.items():
        by_run.setdefault(key, {})[qid] = rec
    never, always = by_run["never"], by_run["always"]
    split = _split(directory)
    lines = [f"### {directory.name}\n"]
    runs = [(r, by_run[r], False) for r in RUNS if r in by_run]
    if replay_dense and "read" in by_run and "read[features=dense]" not in by_run:
        model_name = next(iter(by_run["read"].values()))["model"]
        runs.append(("read[features=dense] (replayed from read's features)", _replayed_dense(by_run["read"],
                                                                                             model_name), True))
    for half, ids in (("all", None), ("answerable", [q for q, a in split.items() if a and q in never])):
        results, labels = [], []
        for name, recs, _replayed in runs:
            g = gate_quality(recs, never, always, ids=ids, answerable=split, run=name)
            results.append(g)
            labels.append(name)
        if results:
            lines.append(f"**{half}** ({results[0].n} questions)\n")
            lines.append(gate_quality_table(results, labels))
    for name, recs, replayed in runs:
        if replayed:
            continue
        qids = [q for q in recs if q in always]
        d = np.array([recs[q]["acc"] - always[q]["acc"] for q in qids])
        se = d.std(ddof=1) / math.sqrt(len(d))
        read_q = [q for q in qids if recs[q]["retrieved"]]
        same = sum(recs[q]["answer"] == always[q]["answer"] for q in read_q)
        searches = np.mean([recs[q]["retrieval_calls"] for q in qids])
        lines.append(f"- `{name}`: ACC − `always` = {100 * d.mean():+.1f} ± {100 * se:.1f} points on {len(qids)} "
                     f"questions; read on {len(read_q)} ({len(read_q) / len(qids):.1%}), {searches:.1f} searches a "
                     f"question; {same} of the {len(read_q)} read answers are `always`'s answer verbatim\n")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    replay = "--replay-dense" in argv
    dirs = [Path(a) for a in argv if not a.startswith("--")]
    for d in dirs:
        print(report(d, replay))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
