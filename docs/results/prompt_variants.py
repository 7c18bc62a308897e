"""Prompt variants for a model reading its BM25 top-3 on NQ dev answerable questions (never test questions).

Run: python docs/results/prompt_variants.py N VARIANTS [MODEL]
     e.g. python docs/results/prompt_variants.py 64 rag,rev,fewfirst,fewfirst_rev qwen2.5-0.5b
Prints ACC and EM per variant (docs/RESULTS.md, NQ split v2, "Prompt").
"""

from __future__ import annotations

import sys
import time

from fastgate.assets.models import load
from fastgate.config import GenerationConfig
from fastgate.engine.local import Engine
from fastgate.eval.datasets import load_benchmark
from fastgate.eval.metrics import accuracy, exact_match
from fastgate.prompts import FEW_SHOT_QA, closed_book_prompt, format_passages, rag_prompt
from fastgate.retrieval import open_retriever

INSTRUCTION = "Use the passages to answer the question."

# Reading demonstrations: each example shows passages (one of them a distractor) and the answer copied from them.
READ_FEW_SHOT = (
    "[1] Nineteen Eighty-Four: Nineteen Eighty-Four is a dystopian novel by the English writer George Orwell, "
    "published in 1949.\n[2] Animal Farm: Animal Farm is a satirical allegorical novella published in 1945.\n"
    "Q: Who wrote the novel 1984?\nA: George Orwell\n\n"
    "[1] Solar System: The Solar System is the gravitationally bound system of the Sun and the objects that orbit "
    "it.\n[2] Jupiter: Jupiter is the fifth planet from the Sun and the largest in the Solar System.\n"
    "Q: What is the largest planet in the Solar System?\nA: Jupiter\n\n"
)


def _variants(tokenizer) -> dict:
    def chat(q, ps):
        msgs = [{"role": "system", "content": "Answer the question with a short phrase taken from the passages."},
                {"role": "user", "content": f"Passages:\n{format_passages(ps)}\n\nQuestion: {q}"}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    return {
        "never": lambda q, ps: closed_book_prompt(q),
        "rag": lambda q, ps: rag_prompt(q, ps),
        "nofew": lambda q, ps: f"{INSTRUCTION}\n{format_passages(ps)}\n\nQ: {q}\nA:",
        "qfirst": lambda q, ps: f"Question: {q}\n{INSTRUCTION}\n{format_passages(ps)}\n\n{FEW_SHOT_QA}Q: {q}\nA:",
        "chat": chat,
        "rev": lambda q, ps: rag_prompt(q, ps[::-1]),
        "fewfirst": lambda q, ps: f"{FEW_SHOT_QA}{INSTRUCTION}\n{format_passages(ps)}\n\nQ: {q}\nA:",
        "fewfirst_rev": lambda q, ps: f"{FEW_SHOT_QA}{INSTRUCTION}\n{format_passages(ps[::-1])}\n\nQ: {q}\nA:",
        "readfew": lambda q, ps: f"{INSTRUCTION}\n\n{READ_FEW_SHOT}{format_passages(ps)}\nQ: {q}\nA:",
        "readfew_qa": lambda q, ps: (f"{INSTRUCTION}\n\n{READ_FEW_SHOT}{format_passages(ps)}\n\n{FEW_SHOT_QA}"
                                     f"Q: {q}\nA:"),
        "copy": lambda q, ps: (f"Answer the question with words copied from the passages.\n{format_passages(ps)}"
                               f"\n\n{FEW_SHOT_QA}Q: {q}\nA:"),
        "k2": lambda q, ps: rag_prompt(q, ps[:2]),
        "short": lambda q, ps: (f"Use the passages to answer the question with a few words.\n{format_passages(ps)}"
                                f"\n\nQuestion: {q}\nShort answer:"),
    }


def main() -> None:
    n, which = int(sys.argv[1]), sys.argv[2].split(",")
    model = sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-0.5b"
    exs = load_benchmark("nq:dev:answerable", n=n, progress=False)
    ret = open_retriever("bm25")
    lm = load(model)
    eng = Engine(lm)
    variants = _variants(lm.tokenizer)
    cfg = GenerationConfig(max_new_tokens=24, stop=("\n",))
    for name in which:
        t, accs, ems = time.time(), [], []
        for i in range(0, len(exs), 8):
            chunk = exs[i:i + 8]
            prompts = [variants[name](e.question, [h.passage for h in ret.search(e.question, k=3)]) for e in chunk]
            out = eng.generate(prompts, cfg)
            for e, g in zip(chunk, out.sequences):
                a = g.text.strip()
                accs.append(accuracy(a, e.answers))
                ems.append(exact_match(a, e.answers))
        print(f"{model} {name}: n={len(accs)} acc={sum(accs) / len(accs):.3f} em={sum(ems) / len(ems):.3f} "
              f"{time.time() - t:.0f}s", flush=True)


if __name__ == "__main__":
    main()
