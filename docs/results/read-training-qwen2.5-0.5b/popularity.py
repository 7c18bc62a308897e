"""Does how familiar a question is tell the read gate more? Out of fold on the committed training records (issue 43;
an experiment, not part of the package; 2026-11-29).

Popularity predicts what a model knows closed-book (Mallen et al. 2023, PopQA): two cheap proxies, each added beside
the shipped features and judged as ``signals.py`` judges a candidate (the same shift-gain model, folds and cells):

- the question's own NLL under qwen2.5-0.5b after "Question:" (mean, largest, mean of the three largest, sum of its
  tokens' surprisals, tokens per word): rare names cost more;
- the corpus's document frequency of the question's content words (log1p of the rarest, mean log1p, how many are in
  no passage).

Run from the repository root (the qwen2.5-0.5b weights installed; ~10 minutes of prefill on two cores, cached)::

    .venv/bin/python docs/results/read-training-qwen2.5-0.5b/popularity.py
"""

import hashlib
import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parents[2]))
import signals as S  # noqa: E402

from fastgate.assets.corpus import load_corpus  # noqa: E402
from fastgate.assets.models import prepare  # noqa: E402
from fastgate.gates.read import _content, _words  # noqa: E402
from fastgate.serving.runtime import Runtime  # noqa: E402


def question_nll(questions: list[str], cache: Path) -> list[list[float]]:
    """Each question's tokens' surprisals under the model after "Question:" (batches of 32, shortest first)."""
    if cache.exists():
        return json.loads(cache.read_text())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(prepare("qwen2.5-0.5b", quiet=True))  # the converted HF directory
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    pre = tok("Question:")["input_ids"]
    order = sorted(range(len(questions)), key=lambda i: len(questions[i]))
    out: dict[int, list[float]] = {}
    for n0 in range(0, len(order), 32):
        idx = order[n0:n0 + 32]
        batch = [pre + tok(" " + questions[i])["input_ids"] for i in idx]
        ids = torch.full((len(batch), max(map(len, batch))), tok.pad_token_id or 0)  # [B, L]
        att = torch.zeros_like(ids)
        for j, b in enumerate(batch):
            ids[j, :len(b)] = torch.tensor(b)
            att[j, :len(b)] = 1
        with torch.no_grad():
            h = model.model(input_ids=ids, attention_mask=att).last_hidden_state  # [B, L, d]
            for j, b in enumerate(batch):
                t = torch.tensor(b[len(pre):])  # [T] the question's tokens
                logits = model.lm_head(h[j, len(pre) - 1:len(b) - 1]).float()  # [T, V]
                out[idx[j]] = (torch.logsumexp(logits, -1) - logits.gather(1, t[:, None])[:, 0]).tolist()
    nll = [out[i] for i in range(len(questions))]
    cache.write_text(json.dumps(nll))
    return nll


def main() -> None:
    torch.set_num_threads(2)
    data = S.load(Runtime("qwen2.5-0.5b", "cpu").retriever("bm25"))
    questions = [r["question"] for s in S.STORES for r in data[s]["usable"]]
    key = hashlib.sha256("\n".join(questions).encode()).hexdigest()[:16]  # these questions, this model
    nlls = question_nll(questions, Path(f"/tmp/popularity-qnll-qwen2.5-0.5b-{key}.json"))
    assert len(nlls) == len(questions), (len(nlls), len(questions))
    _, passages = load_corpus()
    df: Counter = Counter()
    for p in passages:
        df.update(set(_words(f"{p.title} {p.text}")))
    extra = []
    for q, nll in zip(questions, nlls):
        nll = np.array(nll)
        dfs = np.array([df.get(w, 0) for w in sorted(_content(q))] or [len(passages)])
        top = np.sort(nll)[::-1]
        extra.append({"q_nll_mean": float(nll.mean()), "q_nll_max": float(nll.max()),
                      "q_nll_top3": float(top[:3].mean()), "q_nll_sum": float(nll.sum()),
                      "q_tok_word": len(nll) / max(1, len(_words(q))),
                      "df_min": math.log1p(dfs.min()), "df_logmean": float(np.log1p(dfs).mean()),
                      "df_zero": float((dfs == 0).sum())})
    print("| signal | TriviaQA 48% | TriviaQA 40% | NQ 48% | NQ 40% | price: reads / points, per dev set |")
    print("|---|---:|---:|---:|---:|---|")
    S.judge(data, None, (), "the shipped features")
    S.judge(data, extra, tuple(extra[0]), "both")
    S.judge(data, extra, tuple(k for k in extra[0] if k.startswith("q_")), "question NLL")
    S.judge(data, extra, tuple(k for k in extra[0] if k.startswith("df_")), "corpus document frequency")


if __name__ == "__main__":
    main()
