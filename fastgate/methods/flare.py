"""FLARE (Jiang et al., 2023, "Active Retrieval Augmented Generation"), FLARE-direct: look ahead one sentence, and
retrieve when the model is unsure of a word in it.

For one question: generate the temporary next sentence of a chain-of-thought answer; if any of its words has a
probability below θ (:class:`~fastgate.gates.words.FlareGate`: P'(w), the geometric mean of the word's token
probabilities), search with the sentence with those words masked out and regenerate the sentence from the passages;
append it and go on until the rationale says "So the answer is". Owns :class:`FlareConfig` and :class:`Flare`; calls
the shared sentence pieces of :mod:`fastgate.methods.sentences` and the gate of :mod:`fastgate.gates.words`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastgate.errors import InputError
from fastgate.gates.words import FlareGate
from fastgate.methods.base import GateThreshold, Method, append_sentence
from fastgate.methods.sentences import SentenceConfig, next_sentence, regenerate, sentence_config
from fastgate.programs import Answer, Decide, Program
from fastgate.prompts import extract_answer
from fastgate.retrieval.base import Hit

__all__ = ["Flare", "FlareConfig"]


@dataclass(frozen=True)
class FlareConfig(SentenceConfig):
    """FLARE parameters."""

    theta: float = 0.4  # FLARE retrieves when any word of the look-ahead sentence is below this probability
    query_with_question: bool = False  # FLARE's query is the masked sentence alone; True prepends the question

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.theta <= 1.0:
            raise InputError(f"theta must be in [0, 1], got {self.theta}")


class Flare(Method):
    """FLARE (Jiang et al., 2023): look-ahead sentence; retrieve when a word is unconfident; regenerate it."""

    name = "flare"
    black_box = True  # text and token log-probs only: runs on a remote engine too
    threshold = GateThreshold("theta", skip=0.0, retrieve_above=False)  # a word below theta retrieves
    config_class = FlareConfig
    description = "FLARE: retrieve when a word of the next sentence has probability < theta (Jiang et al., 2023)"

    def __init__(self, engine, retriever, config: FlareConfig | None = None) -> None:
        super().__init__(engine, retriever, config)
        self.ops = engine.ops  # the engine's registry, chosen once: word alignment and word log-probs
        self.gate = FlareGate(self.config.theta, engine, self.ops, self.config.query_with_question)

    def program(self, question: str) -> Program:
        c = self.config
        gen_cfg = sentence_config(c)
        text = ""
        used: list[Hit] = []
        for _ in range(c.max_sentences):
            sentence = yield from next_sentence(question, text, gen_cfg)  # the look-ahead (temporary) sentence
            step = yield Decide(self.gate, (question, sentence))  # any word with P'(w) < θ?
            if step.retrieve:  # search with the masked sentence, regenerate the sentence from the passages
                sentence, hits = yield from regenerate(self.retriever, step.query, question, text, c, gen_cfg,
                                                         self.fit_passages)
                used += hits
            text, finished = append_sentence(text, sentence)
            if finished:
                break
        return Answer(extract_answer(text), used)
