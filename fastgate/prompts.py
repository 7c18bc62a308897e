"""Prompt templates. Small models answer best with a few-shot "Q: … A:" prompt: SmolLM2-135M then gets
Berlin, Tokyo, Shakespeare and 1889 right and misses Ouagadougou and Bishkek, the mix gating has to separate."""

from __future__ import annotations

from collections.abc import Sequence

from fastgate.assets.corpus import Passage

__all__ = [
    "ANSWER_PHRASE",
    "ANSWER_STOP",
    "COT_FEW_SHOT",
    "FEW_SHOT_QA",
    "PSEUDO_CONTEXT_INSTRUCTION",
    "PSEUDO_CONTEXT_PREFIX",
    "SENTENCE_STOP",
    "closed_book_prompt",
    "cot_prompt",
    "extract_answer",
    "format_passages",
    "has_answer",
    "passage_text",
    "pseudo_context_prompt",
    "rag_prompt",
    "seakr_prompt",
    "strip_answer",
]

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


def passage_text(p: Passage, max_words: int = 120) -> str:
    """``Title: text`` cut to ``max_words`` words, so k passages fit a small model's attention span."""
    words = p.text.split()
    text = " ".join(words[:max_words]) + (" …" if len(words) > max_words else "")
    return f"{p.title}: {text}" if p.title else text


def format_passages(passages: Sequence[Passage], max_words: int = 120) -> str:
    """Numbered passages, one per line."""
    return "\n".join(f"[{i}] {passage_text(p, max_words)}" for i, p in enumerate(passages, start=1))


def rag_prompt(question: str, passages: Sequence[Passage], max_words: int = 120) -> str:
    """Few-shot prompt with retrieved passages placed before the questions."""
    context = format_passages(passages, max_words)
    return f"Use the passages to answer the question.\n{context}\n\n{FEW_SHOT_QA}Q: {question.strip()}\nA:"


# Chain-of-thought answers end with "So the answer is X." (the phrase SeaKR and IRCoT-style prompts stop on).
COT_FEW_SHOT = (
    "Q: What is the capital of Spain?\n"
    "A: Spain is a country in southern Europe. Its capital and largest city is Madrid. So the answer is Madrid.\n"
    "Q: Who wrote the novel 1984?\n"
    "A: 1984 is a dystopian novel published in 1949. It was written by the English author George Orwell. "
    "So the answer is George Orwell.\n"
    "Q: What is the largest planet in the Solar System?\n"
    "A: The Solar System has eight planets. Jupiter is the largest of them. So the answer is Jupiter.\n"
    "Q: In what year did World War I begin?\n"
    "A: World War I began in 1914 after the assassination of Archduke Franz Ferdinand. So the answer is 1914.\n"
)
ANSWER_PHRASE = "So the answer is"
_ANSWER_MARK = "the answer is"
SENTENCE_STOP = (".", "\n")  # one rationale step (SeaKR App. B.1 stops on a period)
PSEUDO_CONTEXT_INSTRUCTION = "Write a passage to answer this question."  # DTR Fig. 13


def cot_prompt(question: str, passages: Sequence[Passage] = (), max_words: int = 120, partial: str = "",
               header: str = "Use the passages to answer the question.") -> str:
    """Few-shot chain-of-thought prompt, optionally with passages, ending with the answer written so far.

    ``partial`` (the rationale sentences already generated) is appended after ``A:`` so the model continues it: this
    is how FLARE, SCAAR and SeaKR generate one sentence at a time.
    """
    context = f"{header}\n{format_passages(passages, max_words)}\n\n" if passages else ""
    return f"{context}{COT_FEW_SHOT}Q: {question.strip()}\nA:{partial}"


def seakr_prompt(question: str, rationale: str = "", knowledge: Sequence[Passage] = (), max_words: int = 120) -> str:
    """SeaKR's rationale context (§3.1–3.2): examples, optional ``Knowledge Evidence``, question, rationale so far."""
    evidence = "".join(f"Knowledge Evidence: {passage_text(p, max_words)}\n" for p in knowledge)
    return f"{COT_FEW_SHOT}{evidence}Q: {question.strip()}\nA:{rationale}"


# every pseudo-context prompt starts with this (the example, then the instruction again): DTR caches its KV once
PSEUDO_CONTEXT_PREFIX = (
    f"{PSEUDO_CONTEXT_INSTRUCTION}\nQuestion: Who painted the Mona Lisa?\n"
    "Passage: The Mona Lisa is a portrait painted by the Italian artist Leonardo da Vinci in the early 16th "
    "century. It hangs in the Louvre in Paris.\n\n"
    f"{PSEUDO_CONTEXT_INSTRUCTION}\nQuestion:"
)


def pseudo_context_prompt(question: str) -> str:
    """DTR's pseudo-context prompt (Fig. 13) with one example so a small model writes a passage, not a list."""
    return f"{PSEUDO_CONTEXT_PREFIX} {question.strip()}\nPassage:"


def extract_answer(text: str) -> str:
    """The final answer of a chain-of-thought text: what follows the last "(So) the answer is", up to the end of its
    line, without a final period; the whole (stripped) text when the phrase is missing."""
    lowered = text.lower()
    pos = lowered.rfind(_ANSWER_MARK)  # small models often drop the "So"
    if pos < 0:
        return text.strip()
    answer = text[pos + len(_ANSWER_MARK):].split("\n", 1)[0].strip()
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    return answer.lstrip(":").strip()


def strip_answer(text: str) -> str:
    """``text`` without its final "(So) the answer is …" part (SeaKR re-asks for the answer after the rationale)."""
    lowered = text.lower()
    pos = lowered.rfind(_ANSWER_MARK)
    if pos < 0:
        return text
    if lowered[:pos].endswith("so "):
        pos -= 3
    return text[:pos]


def has_answer(text: str) -> bool:
    """Whether a rationale has reached its final answer."""
    return _ANSWER_MARK in text.lower()
