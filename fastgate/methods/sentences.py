"""Sentence-by-sentence active retrieval: FLARE and SCAAR.

Both write a chain-of-thought answer one sentence at a time: generate the next sentence, let the word gate judge it;
if it triggers, retrieve with the gate's query and regenerate the sentence with the passages; append it and go on.
The answer is what follows "So the answer is".
"""

from __future__ import annotations

from dataclasses import dataclass

from fastgate.config import GenerationConfig
from fastgate.embedder import shared_embedder
from fastgate.errors import InputError
from fastgate.gates.words import FlareGate, ScaarGate
from fastgate.methods.base import GateThreshold, Method, MethodConfig, append_sentence
from fastgate.programs import Answer, Decide, Generate, Program, Search
from fastgate.prompts import SENTENCE_STOP, cot_prompt, extract_answer
from fastgate.retrieval.base import Hit

__all__ = ["Flare", "FlareConfig", "Scaar", "ScaarConfig"]


@dataclass(frozen=True)
class SentenceConfig(MethodConfig):
    """Parameters of the sentence loop."""

    max_sentences: int = 5  # rationale + "So the answer is" fits in 2–3 sentences; the cap bounds a rambling model
    sentence_tokens: int = 48  # one sentence of a short rationale; longer ones are cut and continued

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_sentences < 1 or self.sentence_tokens < 1:
            raise InputError("max_sentences and sentence_tokens must be >= 1")


class _SentenceLoop(Method):
    """The shared loop; subclasses build ``self.gate`` (a word gate whose steps carry the search query)."""

    def __init__(self, engine, retriever, config=None) -> None:
        super().__init__(engine, retriever, config)
        self.ops = engine.ops  # the engine's registry, chosen once

    def program(self, question: str) -> Program:
        c = self.config
        gen_cfg = GenerationConfig(max_new_tokens=c.sentence_tokens, stop=SENTENCE_STOP)
        text = ""
        used: list[Hit] = []
        for _ in range(c.max_sentences):
            sentence = (yield Generate(cot_prompt(question, partial=text), gen_cfg)).sequences[0]  # look-ahead
            step = yield Decide(self.gate, (question, sentence))
            if step.retrieve:  # regenerate the sentence from passages found with the gate's query
                (hits,) = yield Search(self.retriever, (step.query,), c.k)
                used += hits
                prompt = cot_prompt(question, [h.passage for h in hits], c.passage_words, text)
                sentence = (yield Generate(prompt, gen_cfg)).sequences[0]
            text, finished = append_sentence(text, sentence)
            if finished:
                break
        return Answer(extract_answer(text), used)


@dataclass(frozen=True)
class FlareConfig(SentenceConfig):
    """FLARE parameters."""

    theta: float = 0.4  # FLARE retrieves when any word of the look-ahead sentence is below this probability
    query_with_question: bool = False  # FLARE's query is the masked sentence alone; True prepends the question

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.theta <= 1.0:
            raise InputError(f"theta must be in [0, 1], got {self.theta}")


class Flare(_SentenceLoop):
    """FLARE (Jiang et al., 2023): look-ahead sentence; retrieve when a word is unconfident; regenerate it."""

    name = "flare"
    black_box = True  # text and token log-probs only: runs on a remote engine too
    threshold = GateThreshold("theta", skip=0.0, retrieve_above=False)  # a word below theta retrieves
    config_class = FlareConfig
    description = "FLARE: retrieve when a word of the next sentence has probability < theta (Jiang et al., 2023)"

    def __init__(self, engine, retriever, config: FlareConfig | None = None) -> None:
        super().__init__(engine, retriever, config)
        self.gate = FlareGate(self.config.theta, engine, self.ops, self.config.query_with_question)


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


class Scaar(_SentenceLoop):
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
        embedder = embedder or getattr(retriever, "embedder", None) or shared_embedder()
        c = self.config
        self.gate = ScaarGate(embedder, c.theta, c.alpha, c.weighting, engine, self.ops)
