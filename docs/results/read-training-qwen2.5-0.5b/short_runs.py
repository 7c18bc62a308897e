"""Issue 43: does a short balanced run (TriviaQA test: 200 questions) lose more than the dev sets out of fold, and
would the read gate's answerable-share estimate gain from moving faster at the start of a run?

The shipped gate's features, model (shift-gain, --l2 10) and price (0.086), fitted out of fold (five folds within each
dev set) on the committed training records (docs/results/read-training-qwen2.5-0.5b: all of NQ dev balanced 998,
TriviaQA dev balanced 2,224, the natural sets' 500 each; the records are copied to a temporary directory first, as
the training pass may write its settings). Each dev set is then replayed as many runs of a test set's size (200
TriviaQA, 400 NQ, 500 natural: random draws in random order), the share estimate starting at the training share and
moving after every question as the gate moves it: at a constant rate (the shipped 0.02, and 0.05), or by a running
mean with a pseudo-count n0 of the training share (step max(0.02, 1/(n0 + t + 1))). Printed: the mean loss against the
better of `never` and `always` (points) and the reading rate over the draws, and the whole set's as one run.

Run (15 s; loads qwen2.5-0.5b and its BM25 index): python docs/results/read-training-qwen2.5-0.5b/short_runs.py
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from fastgate.gates.read import FEATURE_SETS, fit_shift_gain_model
from fastgate.serving.runtime import Runtime
from fastgate.train.read import (
    _folds,
    answerable_labels,
    backfill_passage_features,
    collect_rows,
    search_again,
    training_pass,
)

HERE = Path(__file__).resolve().parent
SETS = {"nq:dev:balanced": (998, 400), "triviaqa:dev:balanced": (2224, 200), "nq:dev:all": (500, 500),
        "triviaqa:dev:all": (500, 500)}
PRICE, L2, RATE = 0.086, 10.0, 0.02
POLICIES = [("rate 0.02 (shipped)", 0.02, 0), ("rate 0.05", 0.05, 0), ("n0 5", 0.02, 5), ("n0 10", 0.02, 10),
            ("n0 20", 0.02, 20), ("n0 40", 0.02, 40)]
DRAWS = 100


def load(tmp: Path):
    runtime = Runtime("qwen2.5-0.5b", weights="float")  # the records' form (they predate auto's int4-dense weights)
    parts = []
    for data, (n, _) in SETS.items():
        where = tmp / data.replace(":", "-")
        shutil.copytree(HERE / where.name, where)
        records = training_pass(runtime, "dtr", data, n, where, progress=False)  # all answered: read, not run
        hits = search_again(records, runtime.retriever("bm25"))
        backfill_passage_features(records, hits)
        rows, fixed, cb, rd = collect_rows(records)
        parts.append((data, rows, fixed, cb, rd, answerable_labels(records, hits)))
    rows = [r for p in parts for r in p[1]]
    fixed, cb, rd, answerable = (np.concatenate([p[i] for p in parts]) for i in (2, 3, 4, 5))
    groups = np.array([p[0] for p in parts for _ in p[1]])
    return rows, fixed, cb, rd, answerable, groups


def out_of_fold_parts(rows, fixed, cb, rd, answerable, groups):
    p, on, off, prior = (np.zeros(len(rows)) for _ in range(4))
    fold = _folds(groups, 5)
    for j in range(5):
        train, test = np.flatnonzero(fold != j), np.flatnonzero(fold == j)
        m = fit_shift_gain_model([rows[i] for i in train], fixed[train], (cb > rd).astype(int)[train],
                                 answerable[train], FEATURE_SETS["all"], l2=L2, rate=RATE)
        p[test], on[test], off[test] = m.parts([rows[i] for i in test])
        prior[test] = m.prior
    return p, on, off, prior


def replay(idx, p, on, off, prior, rate: float, n0: int) -> np.ndarray:
    """The gains of the questions ``idx`` scored in order, the share moved after each (ReadGate's rule, generalised)."""
    share, out = float(prior[idx[0]]), np.empty(len(idx))
    for t, i in enumerate(idx):
        a, b = share * p[i] / prior[i], (1 - share) * (1 - p[i]) / (1 - prior[i])
        q = a / (a + b)
        out[t] = q * on[i] + (1 - q) * off[i]
        step = max(rate, 1.0 / (n0 + t + 1)) if n0 else rate
        share = min(max((1 - step) * share + step * q, 1e-4), 1 - 1e-4)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows, fixed, cb, rd, answerable, groups = load(Path(tmp))
    p, on, off, prior = out_of_fold_parts(rows, fixed, cb, rd, answerable, groups)
    rng = np.random.default_rng(0)
    draws = {g: [rng.permutation(np.flatnonzero(groups == g))[:size] for _ in range(DRAWS)]
             for g, (_, size) in SETS.items()}

    def loss(idx, read):
        return 100 * (np.where(read, rd[idx], cb[idx]).mean() - max(rd[idx].mean(), cb[idx].mean()))

    print(f"points against the better of never and always at price {PRICE} (mean of {DRAWS} draws @ reading rate; "
          "the whole set as one run)")
    for name, rate, n0 in POLICIES:
        cells = []
        for g in SETS:
            runs = [(loss(idx, r), r.mean()) for idx in draws[g] for r in [replay(idx, p, on, off, prior, rate, n0)
                                                                              >= PRICE]]
            whole = np.flatnonzero(groups == g)
            r = replay(whole, p, on, off, prior, rate, n0) >= PRICE
            cells.append(f"{g} {np.mean([x for x, _ in runs]):+.2f}@{np.mean([y for _, y in runs]):.0%} "
                         f"(whole {loss(whole, r):+.2f}@{r.mean():.0%})")
        print(f"{name:20} " + " | ".join(cells))
    g = "triviaqa:dev:balanced"
    gaps = np.array([loss(idx, replay(idx, p, on, off, prior, RATE, 0) >= PRICE) for idx in draws[g]])
    print(f"{g}, runs of 200 at the shipped rate: mean {gaps.mean():+.2f}, sd {gaps.std():.2f}; share of runs at or "
          f"below -3.5: {(gaps <= -3.5).mean():.2f}; at or above -1.0: {(gaps >= -1.0).mean():.2f}")


if __name__ == "__main__":
    main()
