"""Prompt templates. Small models answer best with a few-shot "Q: … A:" prompt (SPEC §2): SmolLM2-135M then gets
Berlin, Tokyo, Shakespeare and 1889 right and misses Ouagadougou and Bishkek, the mix gating has to separate."""

from __future__ import annotations

from collections.abc import Sequence

from fastgate.corpus import Passage

__all__ = ["ANSWER_STOP", "FEW_SHOT_QA", "closed_book_prompt", "format_passages", "rag_prompt"]

FEW_SHOT_QA = (
    "Q: What is the capital of Spain?\nA: Madrid\n"
    "Q: Who wrote the novel 1984?\nA: George Orwell\n"
    "Q: What is the largest planet in the Solar System?\nA: Jupiter\n"
    "Q: In what year did World War I begin?\nA: 1914\n"
)

# The answer is the first line after "A:".
ANSWER_STOP = ("\n",)


def closed_book_prompt(question: str) -> str:
    """Few-shot prompt for a direct short answer without passages."""
    return f"{FEW_SHOT_QA}Q: {question.strip()}\nA:"


def format_passages(passages: Sequence[Passage], max_words: int = 120) -> str:
    """Numbered passages, each cut to ``max_words`` words so k passages fit a small model's attention span."""
    lines = []
    for i, p in enumerate(passages, start=1):
        words = p.text.split()
        text = " ".join(words[:max_words]) + (" …" if len(words) > max_words else "")
        lines.append(f"[{i}] {p.title}: {text}" if p.title else f"[{i}] {text}")
    return "\n".join(lines)


def rag_prompt(question: str, passages: Sequence[Passage], max_words: int = 120) -> str:
    """Few-shot prompt with retrieved passages placed before the questions."""
    context = format_passages(passages, max_words)
    return f"Use the passages to answer the question.\n{context}\n\n{FEW_SHOT_QA}Q: {question.strip()}\nA:"
