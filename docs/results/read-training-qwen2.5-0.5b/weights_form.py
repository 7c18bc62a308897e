"""Issue 43: does the read gate lose more where `auto` serves int4-dense weights than on the records it was trained
on (bf16 with float weights, answered before `auto` chose int4-dense)?

The first 400 TriviaQA dev balanced questions were answered again in `auto`'s form (2026-11-29, `fastgate train read
--model qwen2.5-0.5b --data triviaqa:dev:balanced --n 400 --cache DIR`: `triviaqa-dev-balanced-int4-dense/`). The
shipped gate's model (shift-gain, --l2 10, the shipped features) is fitted on every committed training record but
those 400 questions', then applied to the 400 in each form, the answerable-share estimate moving as in a run, at the
shipped price 0.086 and at a 48% reading rate. Printed per form: never, always, the gate, its reading rate and loss
against always, and the model-side features' means.

Run (~1 minute; loads the BM25 index, no model): python docs/results/read-training-qwen2.5-0.5b/weights_form.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from fastgate.gates.read import FEATURE_SETS, adapt_gains, fit_shift_gain_model
from fastgate.serving.runtime import Runtime
from fastgate.train.read import answerable_labels, backfill_passage_features, collect_rows, search_again, training_pass

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from short_runs import L2, PRICE, RATE, SETS  # noqa: E402  (the shipped fit's settings and the training records)

HELD = "triviaqa:dev:balanced"
INT4 = HERE / "triviaqa-dev-balanced-int4-dense"


def part(runtime, data: str, n: int, where: Path):
    records = training_pass(runtime, "dtr", data, n, where, progress=False)  # all answered: read, not run
    hits = search_again(records, runtime.retriever("bm25"))
    backfill_passage_features(records, hits)
    rows, fixed, cb, rd = collect_rows(records)
    return records, rows, fixed, cb, rd, answerable_labels(records, hits)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        float_runtime = Runtime("qwen2.5-0.5b", weights="float")  # the training records' form
        parts = {}
        for data, (n, _) in SETS.items():
            where = Path(tmp) / data.replace(":", "-")
            shutil.copytree(HERE / where.name, where)
            parts[data] = part(float_runtime, data, n, where)
        shutil.copytree(INT4, Path(tmp) / "int4")
        int4 = part(Runtime("qwen2.5-0.5b"), HELD, 400, Path(tmp) / "int4")
    held = [r["id"] for r in int4[0]]
    rows, fixed, broken, answerable = [], [], [], []
    for data, (records, rw, fx, cb, rd, an) in parts.items():
        for j, r in enumerate(records):
            if data == HELD and r["id"] in set(held):
                continue
            rows.append(rw[j])
            fixed.append(fx[j])
            broken.append(int(cb[j] > rd[j]))
            answerable.append(an[j])
    model = fit_shift_gain_model(rows, np.array(fixed), np.array(broken), np.array(answerable), FEATURE_SETS["all"],
                                 l2=L2, rate=RATE)
    records, rw, _, cb, rd, _ = parts[HELD]
    at = {r["id"]: j for j, r in enumerate(records)}
    idx = np.array([at[i] for i in held])
    same = np.mean([records[at[r["id"]]]["details"]["closed_book_answer"] == r["details"]["closed_book_answer"]
                    for r in int4[0]])
    print(f"{len(held)} held-out questions; closed-book answers identical in both forms: {same:.3f}")
    forms = {"bf16, float weights": ([rw[j] for j in idx], cb[idx], rd[idx]),
             "bf16, int4-dense": (int4[1], int4[3], int4[4])}
    for name, (form_rows, never, always) in forms.items():
        gains, _ = adapt_gains(*model.parts(form_rows), model.prior, model.prior, RATE)
        read = gains >= PRICE
        acc = np.where(read, always, never).mean()
        top = np.zeros(len(gains), bool)
        top[np.argsort(-gains)[:round(0.48 * len(gains))]] = True
        acc48 = np.where(top, always, never).mean()
        print(f"{name:20} never {never.mean():.3f} always {always.mean():.3f} gate {acc:.3f} reading {read.mean():.1%}"
              f" ({100 * (acc - always.mean()):+.2f}); at 48% {acc48:.3f} ({100 * (acc48 - always.mean()):+.2f}); "
              f"fixes {int((always > never).sum())} breaks {int((never > always).sum())}")
        for f in ("cb_nll", "cb_min_logprob", "cb_tokens"):
            v = np.array([r[f] for r in form_rows])
            print(f"{'':20} {f}: mean {v.mean():.3f} sd {v.std():.3f}")


if __name__ == "__main__":
    main()
