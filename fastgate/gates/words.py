"""Word-level confidence gates on one generated sentence: FLARE's low-probability trigger and SCAAR's
semantic-contribution-aware thresholds (with its Percentile-Filtered Query)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fastgate.engine import Engine, Generation
from fastgate.errors import InputError
from fastgate.gates.base import GateDecision
from fastgate.ops import CpuOps

__all__ = ["FlareGate", "ScaarGate", "SentenceWords", "sentence_words"]


@dataclass(frozen=True)
class SentenceWords:
    """The words of a generated sentence with their confidence."""

    text: str  # the sentence as decoded from its tokens
    words: list[str]
    spans: list[tuple[int, int]]  # [start, end) of each word in `text`
    prob: np.ndarray  # [W] P'(w) = geometric-mean probability of the word's tokens (SCAAR eq. 5)

    def without(self, i: int) -> str:
        """The sentence with word ``i`` removed (s ∖ w)."""
        a, b = self.spans[i]
        return " ".join((self.text[:a].rstrip() + " " + self.text[b:].lstrip()).split())


def sentence_words(engine: Engine, ops: CpuOps, seqs: list[Generation]) -> list[SentenceWords]:
    """Split each sequence's answer tokens into words and score them, all sequences in one
    ``align_word_logprobs_batch`` call (SPEC §4 op 4)."""
    pieces = [engine.token_pieces(s.token_ids[: s.answer_tokens]) for s in seqs]
    lps = [np.asarray(s.token_logprobs[: s.answer_tokens], dtype=np.float64) for s in seqs]
    out = []
    for p, (words, _, wlp) in zip(pieces, ops.align_word_logprobs_batch(pieces, lps)):
        text = b"".join(p).decode("utf-8", errors="replace")
        spans, pos = [], 0
        for w in words:
            start = text.find(w, pos)
            if start < 0:  # cannot happen for words cut from `text`; keep the span empty rather than fail
                start = pos
            spans.append((start, start + len(w)))
            pos = start + len(w)
        out.append(SentenceWords(text, words, spans, np.exp(wlp.numpy().astype(np.float64))))
    return out


class FlareGate:
    """FLARE (Jiang et al., 2023): retrieve iff any word of the next sentence has P'(w) < θ.

    The search query is the sentence with those low-confidence words removed (FLARE's masked query). The reported
    score is the lowest word probability (1 for a sentence without words).
    """

    name = "min_word_prob"

    def __init__(self, theta: float = 0.4) -> None:
        if not 0.0 <= theta <= 1.0:
            raise InputError(f"theta must be in [0, 1], got {theta}")
        self.theta = float(theta)

    def decide_words(self, sentences: list[SentenceWords]) -> GateDecision:
        scores = torch.tensor([float(s.prob.min()) if len(s.words) else 1.0 for s in sentences], dtype=torch.float32)
        return GateDecision(scores, [bool(x < self.theta) for x in scores.tolist()], self.theta, self.name)

    def query(self, sentence: SentenceWords) -> str:
        keep = [w for w, p in zip(sentence.words, sentence.prob) if p >= self.theta]
        return " ".join(keep)


class ScaarGate:
    """SCAAR: per-word thresholds scaled by semantic contribution; retrieve iff any ``P'(w) < θ_w``.

    ``r(w) = clip(1 − sim([q, s], [q, s∖w]), 0, 1)`` with ``sim`` the cosine of the embedder's vectors (SCAAR eq. 1
    uses a cross-encoder; none ships offline). ``θ_w = θ·e^{r(w)}`` (eq. 3 as printed, ``weighting="literal"``) or
    ``θ·e^{r'(w)}`` with eq. 2's length-normalised ``r' = |s|·r/Σr`` (``weighting="normalized"``). The reported
    score is ``min_w (P'(w) − θ_w)``: retrieve iff it is < 0.

    Args:
        embedder: anything with ``encode(list[str]) -> [n, dim]`` unit vectors (the packaged MiniLM by default).
        theta: base threshold (SCAAR: 0.8).
        alpha: PFQ keeps the top ``alpha`` fraction of words by contribution (SCAAR: 50%).
        weighting: ``literal`` or ``normalized`` (see above).
    """

    name = "scaar"

    def __init__(self, embedder, theta: float = 0.8, alpha: float = 0.5,
                 weighting: Literal["literal", "normalized"] = "literal") -> None:
        if not 0.0 <= theta <= 1.0:
            raise InputError(f"theta must be in [0, 1], got {theta}")
        if not 0.0 < alpha <= 1.0:
            raise InputError(f"alpha must be in (0, 1], got {alpha}")
        if weighting not in ("literal", "normalized"):
            raise InputError(f"weighting must be literal or normalized, got {weighting!r}")
        self.embedder = embedder
        self.theta = float(theta)
        self.alpha = float(alpha)
        self.weighting = weighting

    def contributions(self, questions: list[str], sentences: list[SentenceWords]) -> list[np.ndarray]:
        """``r(w)`` for every word of every sentence, from one batched encode of all ``[q, s]`` / ``[q, s∖w]``."""
        texts: list[str] = []
        for q, s in zip(questions, sentences):
            texts.append(f"{q} {s.text.strip()}")
            texts.extend(f"{q} {s.without(i)}" for i in range(len(s.words)))
        emb = np.asarray(self.embedder.encode(texts), dtype=np.float64) if texts else np.zeros((0, 1))  # [n, dim]
        out, pos = [], 0
        for s in sentences:
            ref, rest = emb[pos], emb[pos + 1: pos + 1 + len(s.words)]
            pos += 1 + len(s.words)
            out.append(np.clip(1.0 - rest @ ref, 0.0, 1.0))  # [W]
        return out

    def thresholds(self, r: np.ndarray) -> np.ndarray:
        """θ_w per word ``[W]``."""
        if self.weighting == "normalized":
            total = float(r.sum())
            r = len(r) * r / total if total > 0 else np.ones_like(r)
        return self.theta * np.exp(r)

    def decide_words(self, questions: list[str], sentences: list[SentenceWords]) -> tuple[GateDecision,
                                                                                           list[np.ndarray]]:
        """Decision per sentence, and each sentence's contributions (reused by :meth:`query`)."""
        contribs = self.contributions(questions, sentences)
        scores = []
        for s, r in zip(sentences, contribs):
            scores.append(float((s.prob - self.thresholds(r)).min()) if len(s.words) else 1.0)
        t = torch.tensor(scores, dtype=torch.float32)
        return GateDecision(t, [bool(x < 0) for x in scores], 0.0, self.name), contribs

    def query(self, question: str, sentence: SentenceWords, r: np.ndarray) -> str:
        """SCAAR's Percentile-Filtered Query: the question plus the top-α words by contribution that are not
        hallucinated (P'(w) ≥ θ_w), in descending order of contribution (Algorithm 1)."""
        if not len(sentence.words):
            return question
        keep_n = max(1, math.ceil(self.alpha * len(sentence.words)))
        order = np.argsort(-r, kind="stable")[:keep_n]
        thresholds = self.thresholds(r)
        words = [sentence.words[i] for i in order if sentence.prob[i] >= thresholds[i]]
        return " ".join([question, *words])
