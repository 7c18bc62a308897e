"""Do the question's rare words tell the read gate more than its plain word counts? Out of fold on the committed
training records (issue 43; an experiment, not part of the package; 2026-11-30), judged as ``signals.py`` judges a
candidate: the question's words weighted by their inverse document frequency in the corpus, the share of that weight
in the top passage, the best passage and all three (the shipped ``cover`` counts words alike); whether the rarest one
or two words appear in the passages; the top BM25 score over the question's idf mass, and the k-th score over the
top (BM25 and dense).

Run from the repository root (the BM25 index prepared; ~20 s)::

    .venv/bin/python docs/results/read-training-qwen2.5-0.5b/coverage.py
"""
import math
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parents[2]))
import signals as S  # noqa: E402

from fastgate.assets.corpus import load_corpus  # noqa: E402
from fastgate.gates.read import _content, _words  # noqa: E402
from fastgate.serving.runtime import Runtime  # noqa: E402

t = time.time()
data = S.load(Runtime("qwen2.5-0.5b", "cpu").retriever("bm25"))
print("loaded", time.time() - t, file=sys.stderr)
_, passages = load_corpus()
df = Counter()
for p in passages:
    df.update(set(_words(f"{p.title} {p.text}")))
N = len(passages)


def idf(w: str) -> float:
    return math.log(1 + (N - df.get(w, 0) + 0.5) / (df.get(w, 0) + 0.5))  # BM25's


extra = []
for s in S.STORES:
    for r, hits, row in zip(data[s]["usable"], data[s]["hits"], data[s]["rows"]):
        q = sorted(_content(r["question"]))
        w = {x: idf(x) for x in q}
        tot = sum(w.values()) or 1.0
        sets = [_content(f"{h.title} {h.text}") for h in hits]
        covs = [sum(v for x, v in w.items() if x in c) / tot for c in sets] or [0.0]
        union = set().union(*sets) if sets else set()
        rare = max(w, key=w.get) if w else None
        top = row["bm25_top"]
        extra.append({"cov_idf_top": covs[0], "cov_idf_best": max(covs),
                      "cov_idf_all": sum(v for x, v in w.items() if x in union) / tot,
                      "rare_in": float(rare is not None and rare in union),
                      "rare2_in": float(sum(x in union for x in sorted(w, key=w.get)[-2:]) / max(1, min(2, len(w)))),
                      "bm25_norm": top / tot,
                      "bm25_kratio": (top - row["bm25_drop"]) / top if top else 0.0,
                      "dense_kratio": (row["dense_top"] - row["dense_drop"]) / row["dense_top"]
                      if row["dense_top"] else 0.0})
print("| signal | TriviaQA 48% | TriviaQA 40% | NQ 48% | NQ 40% | price: reads / points, per dev set |")
print("|---|---:|---:|---:|---:|---|")
S.judge(data, None, (), "the shipped features")
S.judge(data, extra, tuple(extra[0]), "all new")
S.judge(data, extra, ("cov_idf_top", "cov_idf_best", "cov_idf_all"), "idf coverage")
S.judge(data, extra, ("rare_in", "rare2_in"), "rarest words in passages")
S.judge(data, extra, ("bm25_norm", "bm25_kratio", "dense_kratio"), "normalised scores")
