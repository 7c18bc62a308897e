"""SeaKR (Yao et al., 2024): self-aware retrieval, re-ranking and reasoning from the eigenscore of k sampled
generations' EOS states."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from fastgate.config import GenerationConfig
from fastgate.engine.generation import Generation
from fastgate.errors import InputError
from fastgate.gates.eigen import EigenScoreGate, PathChoice
from fastgate.methods.base import GateThreshold, Method, MethodConfig, append_sentence
from fastgate.programs import All, Answer, Decide, Generate, Program, Score, Search
from fastgate.prompts import (
    ANSWER_PHRASE,
    SENTENCE_STOP,
    cot_prompt,
    extract_answer,
    seakr_prompt,
    strip_answer,
)
from fastgate.retrieval.base import Hit

__all__ = ["Seakr", "SeakrConfig"]


@dataclass(frozen=True)
class SeakrConfig(MethodConfig):
    """SeaKR parameters (paper defaults)."""

    samples: int = 20  # k sampled generations per context for the eigenscore
    temperature: float = 1.0  # SeaKR's sampling temperature
    top_k: int = 50  # SeaKR's top-k
    top_p: float = 0.9  # SeaKR's top-p
    alpha: float = 1e-3  # Gram ridge
    delta: float = -6.0  # retrieve iff eigenscore > delta
    n_candidates: int = 3  # N passages re-ranked by the eigenscore of the rationale they lead to
    max_steps: int = 4  # rationale steps (each may retrieve) before the final reasoning
    step_tokens: int = 32  # one rationale sentence; SeaKR stops a step at a period
    answer_tokens: int = 96  # the knowledge path writes a whole chain of thought
    query_theta: float = 0.4  # query = greedy rationale without tokens below this probability (FLARE's masking)
    seed: int = 0  # sampling seed; each question's samples depend only on it and the question

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples < 2:
            raise InputError(f"samples must be >= 2 for an eigenscore, got {self.samples}")
        for name in ("n_candidates", "max_steps", "step_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1")


class Seakr(Method):
    """Iterative rationale steps; at each, the k-sample eigenscore decides retrieval; the passage whose context has
    the lowest eigenscore is kept; finally the rationale path and the knowledge path compete on their eigenscore."""

    name = "seakr"
    threshold = GateThreshold("delta", skip=1e9, retrieve_above=True)
    config_class = SeakrConfig
    description = "SeaKR: eigenscore of k sampled EOS states triggers retrieval, re-ranks passages, picks the reasoning"

    def __init__(self, engine, retriever, config: SeakrConfig | None = None) -> None:
        super().__init__(engine, retriever, config)
        c = self.config
        self.gate = EigenScoreGate(c.samples, c.delta, c.alpha, ops=engine.ops)
        self.path = PathChoice(self.gate)

    def _seed(self, question: str, salt: int) -> int:
        return (zlib.crc32(question.encode("utf-8")) * 7919 + salt * 104729 + self.config.seed) % (2**31)

    def _greedy(self, prompt: str, max_tokens: int, stop: tuple[str, ...], answer: bool = False) -> Generate:
        return Generate(prompt, GenerationConfig(max_new_tokens=max_tokens, stop=stop), answer=answer)

    @classmethod
    def rows_at_once(cls, config: SeakrConfig) -> int:  # type: ignore[override]
        return config.samples  # the k samples of one context decode together

    def _samples(self, prompt: str, max_tokens: int, stop: tuple[str, ...], seed: int) -> Generate:
        """k sampled continuations of ``prompt`` with their EOS states (the eigenscore's input)."""
        c = self.config
        cfg = EigenScoreGate.sampling(max_tokens, stop, c.temperature, c.top_k, c.top_p)
        return Generate(prompt, cfg, self.gate.taps, k=c.samples, seed=seed)

    def _query(self, question: str, seq: Generation) -> str:
        """The greedy rationale sentence without its tokens below ``query_theta`` probability."""
        n = seq.answer_tokens
        pieces = self.engine.token_pieces(seq.token_ids[:n])
        threshold = torch.log(torch.tensor(self.config.query_theta)).item()
        kept = b"".join(p for p, lp in zip(pieces, seq.token_logprobs[:n]) if lp >= threshold)
        query = " ".join(kept.decode("utf-8", errors="ignore").split())
        return query or question

    # ------------------------------------------------------------------ the algorithm
    def program(self, question: str) -> Program:
        c = self.config
        rationale = ""
        knowledge: list[Hit] = []
        for step in range(c.max_steps):
            context = seakr_prompt(question, rationale, (), c.passage_words)
            seed = self._seed(question, step)
            greedy, samples = yield All(self._greedy(context, c.step_tokens, SENTENCE_STOP),
                                        self._samples(context, c.step_tokens, SENTENCE_STOP, seed))
            chosen = greedy.sequences[0]
            decision = yield Decide(self.gate, samples)  # self-aware retrieval: eigenscore > delta
            if decision.retrieve:
                best = yield from self._rerank(question, rationale, chosen, step)
                if best is not None:
                    knowledge.append(best)
                    prompt = seakr_prompt(question, rationale, [best.passage], c.passage_words)
                    chosen = (yield self._greedy(prompt, c.step_tokens, SENTENCE_STOP)).sequences[0]
            rationale, finished = append_sentence(rationale, chosen)
            if finished:
                break
        # the knowledge path's prompt holds the passages that fit the context (the record lists those)
        knowledge = self.fit_passages(question, knowledge, self._knowledge_prompt, c.answer_tokens)
        answer = yield from self._reason(question, rationale, knowledge)
        return Answer(answer, knowledge)

    def _rerank(self, question: str, rationale: str, greedy: Generation, step: int) -> Program:
        """Self-aware re-ranking: retrieve top-N and keep the passage whose context gives the lowest eigenscore
        (None when the query finds nothing)."""
        c = self.config
        (cands,) = yield Search(self.retriever, (self._query(question, greedy),), c.n_candidates)
        if not cands:
            return None
        seed = self._seed(question, 1000 + step)  # the same draws for every candidate: a fair comparison
        batches = yield All(*(self._samples(seakr_prompt(question, rationale, [h.passage], c.passage_words),
                                            c.step_tokens, SENTENCE_STOP, seed) for h in cands))
        scores = yield All(*(Score(self.gate, b) for b in batches))
        best = min(range(len(cands)), key=lambda j: scores[j])  # the first of equal scores
        return Hit(cands[best].passage, float(scores[best]))

    def _knowledge_prompt(self, question: str, knowledge: list[Hit]) -> str:
        return cot_prompt(question, [h.passage for h in knowledge], self.config.passage_words)

    def _reason(self, question: str, rationale: str, knowledge: list[Hit]) -> Program:
        """Self-aware reasoning: the rationale path's answer, or, where passages were retrieved, whichever of the
        rationale path and the knowledge path has the lower eigenscore."""
        c = self.config
        prefix = strip_answer(rationale).rstrip() + " " + ANSWER_PHRASE
        r_prompt = seakr_prompt(question, prefix, (), c.passage_words)
        # without passages the rationale path's answer is the answer (a streaming server can send it as decoded)
        r_answer = (yield self._greedy(r_prompt, c.max_answer_tokens, SENTENCE_STOP, answer=not knowledge)).sequences[0]
        if not knowledge:
            return r_answer.text.strip()
        k_prompt = self._knowledge_prompt(question, knowledge)
        seed = self._seed(question, 2000)
        k_answer, r_samples, k_samples = yield All(
            self._greedy(k_prompt, c.answer_tokens, ("\n",)),
            self._samples(r_prompt, c.max_answer_tokens, SENTENCE_STOP, seed),
            self._samples(k_prompt, c.answer_tokens, ("\n",), seed),
        )
        choice = yield Decide(self.path, (k_samples, r_samples))
        return extract_answer(k_answer.sequences[0].text) if choice.retrieve else r_answer.text.strip()
