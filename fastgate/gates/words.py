"""Word-level confidence gates on one generated sentence: FLARE's low-probability trigger and SCAAR's
semantic-contribution-aware thresholds (with its Percentile-Filtered Query).

The rules of the two papers live here, beside the word alignment they share; their sentence loops are the methods
:mod:`fastgate.methods.flare` and :mod:`fastgate.methods.scaar`. The words come from the engine's ops
(``align_word_logprobs_batch``, :func:`fastgate.ops.build_ops`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from fastgate.engine.generation import Generation
from fastgate.errors import InputError
from fastgate.gates.base import Gate, GateStep
from fastgate.ops import Ops

if TYPE_CHECKING:  # annotations only: the gates depend on the result types, not on the engine (no import cycle)
    from fastgate.engine.local import Engine

__all__ = ["FlareGate", "ScaarGate", "SentenceWords", "WordStep", "sentence_words"]


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


def sentence_words(engine: Engine, ops: Ops, seqs: list[Generation]) -> list[SentenceWords]:
    """Split each sequence's answer tokens into words and score them, all sequences in one
    ``align_word_logprobs_batch`` call (op 4, docs/ARCHITECTURE.md)."""
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


@dataclass(frozen=True)
class WordStep(GateStep):
    """A word gate's step, with the search query it builds from the sentence (reported like any gate step)."""

    query: str = ""


class _WordGate(Gate):
    """The signal of a word gate is ``(question, sentence Generation)``; one batched alignment serves all of them."""

    def __init__(self, engine: Engine | None = None, ops: Ops | None = None) -> None:
        self.engine = engine
        self.ops = ops

    def words(self, signals: Sequence[tuple[str, Generation]]) -> list[SentenceWords]:
        if self.engine is None or self.ops is None:
            raise InputError(f"{type(self).__name__} needs engine= and ops= to read sentences")
        return sentence_words(self.engine, self.ops, [seq for _, seq in signals])


class FlareGate(_WordGate):
    """FLARE (Jiang et al., 2023): retrieve iff any word of the next sentence has P'(w) < θ.

    The search query is the sentence with those low-confidence words removed (FLARE's masked query). The reported
    score is the lowest word probability (1 for a sentence without words).
    """

    name = "min_word_prob"

    def __init__(self, theta: float = 0.4, engine: Engine | None = None, ops: Ops | None = None,
                 query_with_question: bool = False) -> None:
        super().__init__(engine, ops)
        if not 0.0 <= theta <= 1.0:
            raise InputError(f"theta must be in [0, 1], got {theta}")
        self.theta = float(theta)
        self.query_with_question = query_with_question

    def word_scores(self, sentences: list[SentenceWords]) -> torch.Tensor:
        """The lowest word probability per sentence ``[N]`` (1 for a sentence without words)."""
        return torch.tensor([float(s.prob.min()) if len(s.words) else 1.0 for s in sentences], dtype=torch.float32)

    def scores(self, signals):
        return self.word_scores(self.words(signals))

    def step(self, score: float, signal=None) -> GateStep:
        return GateStep(self.name, float(score), self.theta, bool(score < self.theta))

    def decide(self, signals: Sequence[tuple[str, Generation]]) -> list[WordStep]:
        """Steps with FLARE's masked query (the question is prepended when asked for or when nothing is left)."""
        sentences = self.words(signals)
        out = []
        for (q, _), s, x in zip(signals, sentences, self.word_scores(sentences).tolist()):
            masked = self.query(s)
            query = f"{q} {masked}" if self.query_with_question or not masked.strip() else masked
            out.append(WordStep(self.name, x, self.theta, bool(x < self.theta), query))
        return out

    def query(self, sentence: SentenceWords) -> str:
        keep = [w for w, p in zip(sentence.words, sentence.prob) if p >= self.theta]
        return " ".join(keep)


class ScaarGate(_WordGate):
    """SCAAR: per-word thresholds scaled by semantic contribution; retrieve iff any ``P'(w) < θ_w``.

    ``r(w) = clip(1 − sim([q, s], [q, s∖w]), 0, 1)`` with ``sim`` the cosine of the embedder's vectors (SCAAR eq. 1
    uses a cross-encoder; none ships offline). ``θ_w = θ·e^{r(w)}`` (eq. 3 as printed, ``weighting="literal"``) or
    ``θ·e^{r'(w)}`` with eq. 2's length-normalised ``r' = |s|·r/Σr`` (``weighting="normalized"``). The reported
    score is the θ at which the rule flips, ``min_w P'(w)·e^{−r(w)}`` (``r'`` when normalised): retrieve iff it is
    < θ, the same decision as "any ``P'(w) < θ_w``", and a score that does not depend on θ, so ``fastgate calibrate``
    (which scores at θ = 0) cuts the rule's own quantity (``min_w P'(w)`` before, which ignored the contributions).

    Args:
        embedder: anything with ``encode(list[str]) -> [n, dim]`` unit vectors (the packaged MiniLM by default).
        theta: base threshold (SCAAR: 0.8). alpha: PFQ keeps the top ``alpha`` fraction of words by contribution (SCAAR:
        50%). weighting: ``literal`` or ``normalized`` (see above).
    """

    name = "scaar"

    def __init__(self, embedder, theta: float = 0.8, alpha: float = 0.5,
                 weighting: Literal["literal", "normalized"] = "literal", engine: Engine | None = None,
                 ops: Ops | None = None) -> None:
        super().__init__(engine, ops)
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

    def scales(self, r: np.ndarray) -> np.ndarray:
        """``e^{r(w)}`` (or ``e^{r'(w)}``) per word ``[W]``: θ_w / θ."""
        if self.weighting == "normalized":
            total = float(r.sum())
            r = len(r) * r / total if total > 0 else np.ones_like(r)
        return np.exp(r)

    def thresholds(self, r: np.ndarray) -> np.ndarray:
        """θ_w per word ``[W]``."""
        return self.theta * self.scales(r)

    def word_scores(self, sentences: list[SentenceWords], contribs: list[np.ndarray]) -> torch.Tensor:
        """``min_w P'(w)·e^{−r(w)}`` per sentence ``[N]`` (1 for a sentence without words)."""
        scores = [float((s.prob / self.scales(r)).min()) if len(s.words) else 1.0
                  for s, r in zip(sentences, contribs)]
        return torch.tensor(scores, dtype=torch.float64)

    def scores(self, signals):
        sentences = self.words(signals)
        return self.word_scores(sentences, self.contributions([q for q, _ in signals], sentences))

    def step(self, score: float, signal=None) -> GateStep:
        return GateStep(self.name, float(score), self.theta, bool(score < self.theta))

    def decide(self, signals: Sequence[tuple[str, Generation]]) -> list[WordStep]:
        """Steps with SCAAR's Percentile-Filtered Query, from one alignment and one batched encode."""
        questions = [q for q, _ in signals]
        sentences = self.words(signals)
        contribs = self.contributions(questions, sentences)
        out = []
        for q, s, r, x in zip(questions, sentences, contribs, self.word_scores(sentences, contribs).tolist()):
            out.append(WordStep(self.name, float(torch.tensor(x, dtype=torch.float32)), self.theta,
                                bool(x < self.theta), self.query(q, s, r)))
        return out

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
