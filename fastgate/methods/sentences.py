"""Sentence-by-sentence active retrieval: FLARE and SCAAR.

Both write a chain-of-thought answer one sentence at a time. Each round, every unfinished question of the batch
generates its next sentence together; the gate scores all of them; the triggered ones build a query, retrieve, and
regenerate that sentence with the passages, together; the (possibly regenerated) sentence is appended and the next
round starts. The answer is what follows "So the answer is".
"""

from __future__ import annotations

from dataclasses import dataclass

from fastgate.config import GenerationConfig
from fastgate.embedder import shared_embedder
from fastgate.engine import Generation
from fastgate.errors import InputError
from fastgate.gates.base import GateDecision
from fastgate.gates.words import FlareGate, ScaarGate, SentenceWords, sentence_words
from fastgate.methods.base import Method, MethodConfig, MethodResult, _Timer, _Trace, append_sentence
from fastgate.ops import load as load_ops
from fastgate.prompts import SENTENCE_STOP, cot_prompt, extract_answer

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
    """The shared loop; subclasses provide :meth:`judge` (decision + query per sentence)."""

    def __init__(self, engine, retriever, config=None, ops_backend: str = "auto") -> None:
        super().__init__(engine, retriever, config)
        self.ops = load_ops(ops_backend)

    def judge(self, questions: list[str], sentences: list[SentenceWords]) -> tuple[GateDecision, list[str]]:
        raise NotImplementedError  # pragma: no cover

    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        questions = self.validate(questions)
        cfg = self.config
        gen_cfg = GenerationConfig(max_new_tokens=cfg.sentence_tokens, stop=SENTENCE_STOP)
        timer = _Timer()
        traces = [_Trace() for _ in questions]
        text = [""] * len(questions)
        done = [False] * len(questions)
        with timer.span("total_s"):
            for _ in range(cfg.max_sentences):
                act = [i for i, d in enumerate(done) if not d]
                if not act:
                    break
                with timer.span("generation_s"):
                    batch = self.engine.generate([cot_prompt(questions[i], partial=text[i]) for i in act], gen_cfg)
                with timer.span("gate_s"):
                    words = sentence_words(self.engine, self.ops, batch.sequences)
                    decision, queries = self.judge([questions[i] for i in act], words)
                chosen: list[Generation] = list(batch.sequences)
                todo = [j for j, r in enumerate(decision.retrieve) if r]
                if todo:
                    hits = self.retrieve([queries[j] for j in todo], timer)
                    prompts = [cot_prompt(questions[act[j]], [h.passage for h in hs], cfg.passage_words, text[act[j]])
                               for j, hs in zip(todo, hits)]
                    with timer.span("generation_s"):
                        again = self.engine.generate(prompts, gen_cfg)
                    for j, hs, s in zip(todo, hits, again.sequences):
                        traces[act[j]].retrieval(hs)
                        traces[act[j]].generation(s)
                        chosen[j] = s
                for j, i in enumerate(act):
                    traces[i].generation(batch.sequences[j])
                    traces[i].gate_steps.append(decision.step(j))
                    text[i], done[i] = append_sentence(text[i], chosen[j])
        return [t.result(q, extract_answer(x), self.name, timer.spans) for q, t, x in zip(questions, traces, text)]


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
    config_class = FlareConfig
    description = "FLARE: retrieve when a word of the next sentence has probability < theta (Jiang et al., 2023)"

    def __init__(self, engine, retriever, config: FlareConfig | None = None, ops_backend: str = "auto") -> None:
        super().__init__(engine, retriever, config, ops_backend)
        self.gate = FlareGate(self.config.theta)

    def judge(self, questions, sentences):
        decision = self.gate.decide_words(sentences)
        queries = []
        for q, s in zip(questions, sentences):
            masked = self.gate.query(s)
            queries.append(f"{q} {masked}" if self.config.query_with_question or not masked.strip() else masked)
        return decision, queries


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
    config_class = ScaarConfig
    description = "SCAAR: word thresholds scaled by semantic contribution; percentile-filtered query"

    def __init__(self, engine, retriever, config: ScaarConfig | None = None, ops_backend: str = "auto",
                 embedder=None) -> None:
        super().__init__(engine, retriever, config, ops_backend)
        embedder = embedder or getattr(retriever, "embedder", None) or shared_embedder()
        c = self.config
        self.gate = ScaarGate(embedder, c.theta, c.alpha, c.weighting)

    def judge(self, questions, sentences):
        decision, contribs = self.gate.decide_words(questions, sentences)
        queries = [self.gate.query(q, s, r) for q, s, r in zip(questions, sentences, contribs)]
        return decision, queries
