"""The pieces FLARE (:mod:`fastgate.methods.flare`) and SCAAR (:mod:`fastgate.methods.scaar`) share: both write a
chain-of-thought answer one sentence at a time and may regenerate a sentence from retrieved passages.

Owns :class:`SentenceConfig` (the loop's bounds) and two sub-programs, :func:`next_sentence` (generate the next
sentence of the rationale) and :func:`regenerate` (search with a gate's query, then generate the sentence again with
the passages). Each method file writes its own loop around them; the answer is what follows "So the answer is"
(:func:`fastgate.prompts.extract_answer`). Calls the programs' requests (:mod:`fastgate.programs`) and the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastgate.config import GenerationConfig
from fastgate.engine.generation import Generation
from fastgate.errors import InputError
from fastgate.methods.base import MethodConfig
from fastgate.programs import Generate, Program, Search
from fastgate.prompts import SENTENCE_STOP, cot_prompt

__all__ = ["SentenceConfig", "next_sentence", "regenerate", "sentence_config"]


@dataclass(frozen=True)
class SentenceConfig(MethodConfig):
    """Parameters of the sentence loop."""

    max_sentences: int = 5  # rationale + "So the answer is" fits in 2–3 sentences; the cap bounds a rambling model
    sentence_tokens: int = 48  # one sentence of a short rationale; longer ones are cut and continued

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_sentences < 1 or self.sentence_tokens < 1:
            raise InputError("max_sentences and sentence_tokens must be >= 1")


def sentence_config(config: SentenceConfig) -> GenerationConfig:
    """The decoding settings of one sentence: up to ``sentence_tokens``, stopped at the end of the sentence."""
    return GenerationConfig(max_new_tokens=config.sentence_tokens, stop=SENTENCE_STOP)


def next_sentence(question: str, text: str, gen_cfg: GenerationConfig) -> Program:
    """Generate the sentence that follows the rationale ``text`` so far, without passages; returns it."""
    return (yield Generate(cot_prompt(question, partial=text), gen_cfg)).sequences[0]


def regenerate(retriever, query: str, question: str, text: str, config: SentenceConfig,
               gen_cfg: GenerationConfig, fit) -> Program:
    """Search ``query`` (top ``config.k``), then generate the sentence again after ``text`` with those passages in
    the prompt; returns ``(sentence, hits)``. ``fit``: the method's ``fit_passages`` (the leading hits whose prompt
    fits the context)."""
    (hits,) = yield Search(retriever, (query,), config.k)

    def build(q: str, ps) -> str:
        return cot_prompt(q, [h.passage for h in ps], config.passage_words, text)

    hits = fit(question, hits, build, gen_cfg.max_new_tokens)
    prompt = build(question, hits)
    sentence: Generation = (yield Generate(prompt, gen_cfg)).sequences[0]
    return sentence, hits
