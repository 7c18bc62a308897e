"""SCAAR: semantic-contribution-aware active retrieval, one sentence at a time.

For one question: generate the next sentence of a chain-of-thought answer; score each word w by its probability P'(w)
(eq. 5: the geometric mean of its token probabilities) and by its semantic contribution r(w) to the sentence (eq. 1:
how far the sentence's embedding moves when w is removed); a word is hallucinated when P'(w) < θ_w = θ·e^{r(w)}
(eq. 3; eq. 2's length-normalised r' with ``weighting=normalized``). If any word is, search with the
Percentile-Filtered Query (Algorithm 1: the question plus the top-α words by contribution that are not hallucinated)
and regenerate the sentence from the passages; append it and go on until the rationale says "So the answer is".

The rule and the query are :class:`~fastgate.gates.words.ScaarGate`'s; this module owns :class:`ScaarConfig` and
:class:`Scaar`, and calls the shared sentence pieces of :mod:`fastgate.methods.sentences`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastgate.assets.embedder import shared_embedder
from fastgate.errors import InputError
from fastgate.gates.words import ScaarGate
from fastgate.methods.base import GateThreshold, Method, append_sentence
from fastgate.methods.sentences import SentenceConfig, next_sentence, regenerate, sentence_config
from fastgate.programs import Answer, Decide, Program
from fastgate.prompts import extract_answer
from fastgate.retrieval.base import Hit

__all__ = ["Scaar", "ScaarConfig"]


@dataclass(frozen=True)
class ScaarConfig(SentenceConfig):
    """SCAAR parameters."""

    theta: float = 0.8  # SCAAR's base word threshold
    alpha: float = 0.5  # PFQ keeps the top 50% of words by semantic contribution
    weighting: str = "literal"  # literal: θ·e^{r} as eq. 3 prints it; normalized: θ·e^{r'} with eq. 2's r'

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weighting not in ("literal", "normalized"):
            raise InputError(f"weighting must be literal or normalized, got {self.weighting!r}")


class Scaar(Method):
    """SCAAR: contribution-weighted word thresholds per sentence, Percentile-Filtered Query, sentence regeneration.

    Args:
        embedder: the similarity model for word contributions (default: the retriever's embedder if it has one, else
            the packaged MiniLM).
    """

    name = "scaar"
    black_box = True  # text and token log-probs only: runs on a remote engine too
    threshold = GateThreshold("theta", skip=0.0, retrieve_above=False)  # a word below theta retrieves
    config_class = ScaarConfig
    description = "SCAAR: word thresholds scaled by semantic contribution; percentile-filtered query"

    def __init__(self, engine, retriever, config: ScaarConfig | None = None, embedder=None) -> None:
        super().__init__(engine, retriever, config)
        self.ops = engine.ops  # the engine's registry, chosen once: word alignment and word log-probs
        embedder = embedder or getattr(retriever, "embedder", None) or shared_embedder()
        c = self.config
        self.gate = ScaarGate(embedder, c.theta, c.alpha, c.weighting, engine, self.ops)

    def program(self, question: str) -> Program:
        c = self.config
        gen_cfg = sentence_config(c)
        text = ""
        used: list[Hit] = []
        for _ in range(c.max_sentences):
            sentence = yield from next_sentence(question, text, gen_cfg)
            step = yield Decide(self.gate, (question, sentence))  # any word with P'(w) < θ·e^{r(w)}?
            if step.retrieve:  # search with the Percentile-Filtered Query, regenerate the sentence from the passages
                sentence, hits = yield from regenerate(self.retriever, step.query, question, text, c, gen_cfg,
                                                         self.fit_passages)
                used += hits
            text, finished = append_sentence(text, sentence)
            if finished:
                break
        return Answer(extract_answer(text), used)
