"""Answer scoring: SQuAD-style normalisation, exact match, token F1 and ACC (a gold answer appears in the answer), and
whether a record read (:func:`decision`)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["accuracy", "decision", "exact_match", "normalize_answer", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace (the SQuAD evaluation rule)."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def exact_match(answer: str, golds: Sequence[str]) -> float:
    """1 if the normalised answer equals a normalised gold answer. A gold that normalises to nothing (NQ's "*") is
    skipped, as :func:`accuracy` skips it: SQuAD's rule matched it with any empty or punctuation-only answer (an
    error record's "" among them)."""
    a = normalize_answer(answer)
    return float(any(g and a == g for g in map(normalize_answer, golds)))


def token_f1(answer: str, golds: Sequence[str]) -> float:
    """Best token-overlap F1 against any gold answer."""
    pred = normalize_answer(answer).split()
    best = 0.0
    for g in golds:
        gold = normalize_answer(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common:
            p, r = common / len(pred), common / len(gold)
            best = max(best, 2 * p * r / (p + r))
    return best


def accuracy(answer: str, golds: Sequence[str]) -> float:
    """1 if a normalised gold answer occurs in the normalised answer as a whole word sequence (the papers' ACC: "2"
    is not in "12", "m" not in "sir miles"), else 0."""
    a = f" {normalize_answer(answer)} "
    return float(any(normalize_answer(g) and f" {normalize_answer(g)} " in a for g in golds))


def decision(record: Mapping[str, Any]) -> bool:
    """Whether a record's run used retrieval for its answer: ``retrieved``, else ``retrieval_calls > 0`` (one rule
    for the summary's reading rate and the coins')."""
    if "retrieved" in record:
        return bool(record["retrieved"])
    return (record.get("retrieval_calls") or 0) > 0
