"""SeaKR (Yao et al., 2024): self-aware retrieval, re-ranking and reasoning from the eigenscore of k sampled
generations' EOS states."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from fastgate.config import GenerationConfig
from fastgate.engine import Generation
from fastgate.errors import InputError
from fastgate.gates.base import GateStep
from fastgate.gates.eigen import EigenScoreGate
from fastgate.methods.base import Method, MethodConfig, MethodResult, _Timer, _Trace, append_sentence
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
    sample_batch: int = 80  # sequences per generate call; bounds KV-cache memory (k samples × prompts)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples < 2:
            raise InputError(f"samples must be >= 2 for an eigenscore, got {self.samples}")
        for name in ("n_candidates", "max_steps", "step_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1")
        if self.sample_batch < self.samples:
            raise InputError(f"sample_batch ({self.sample_batch}) must hold the {self.samples} samples of one context")


class Seakr(Method):
    """Iterative rationale steps; at each, the k-sample eigenscore decides retrieval; the passage whose context has
    the lowest eigenscore is kept; finally the rationale path and the knowledge path compete on their eigenscore."""

    name = "seakr"
    config_class = SeakrConfig
    description = "SeaKR: eigenscore of k sampled EOS states triggers retrieval, re-ranks passages, picks the reasoning"

    def __init__(self, engine, retriever, config: SeakrConfig | None = None) -> None:
        super().__init__(engine, retriever, config)
        c = self.config
        self.gate = EigenScoreGate(c.samples, c.delta, c.alpha, ops=engine.gate_ops)

    # ------------------------------------------------------------------ helpers
    def _seed(self, question: str, salt: int) -> int:
        return (zlib.crc32(question.encode("utf-8")) * 7919 + salt * 104729 + self.config.seed) % (2**31)

    def _greedy(self, prompts: list[str], max_tokens: int, stop: tuple[str, ...], timer: _Timer) -> list[Generation]:
        with timer.span("generation_s"):
            return self.engine.generate(prompts, GenerationConfig(max_new_tokens=max_tokens, stop=stop)).sequences

    def _uncertainty(self, prompts: list[str], seeds: list[int], max_tokens: int, stop: tuple[str, ...],
                     timer: _Timer) -> tuple[torch.Tensor, list[list[Generation]]]:
        """Eigenscore ``[P]`` of each prompt from k samples (chunked to ``sample_batch`` sequences per call)."""
        c = self.config
        cfg = EigenScoreGate.sampling(max_tokens, stop, c.temperature, c.top_k, c.top_p)
        per_call = max(1, c.sample_batch // c.samples)
        scores, samples = [], []
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start:start + per_call]
            with timer.span("generation_s"):
                batch = self.engine.generate(chunk, cfg, taps=self.gate.taps, k=c.samples,
                                             seeds=seeds[start:start + per_call])
            with timer.span("gate_s"):
                scores.append(self.gate.scores(batch))
            seqs = batch.sequences
            samples.extend(seqs[j * c.samples:(j + 1) * c.samples] for j in range(len(chunk)))
        return torch.cat(scores), samples

    def _query(self, question: str, seq: Generation) -> str:
        n = seq.answer_tokens
        pieces = self.engine.token_pieces(seq.token_ids[:n])
        threshold = torch.log(torch.tensor(self.config.query_theta)).item()
        kept = b"".join(p for p, lp in zip(pieces, seq.token_logprobs[:n]) if lp >= threshold)
        query = " ".join(kept.decode("utf-8", errors="ignore").split())
        return query or question

    # ------------------------------------------------------------------ main
    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        questions = self.validate(questions)
        c = self.config
        timer = _Timer()
        traces = [_Trace() for _ in questions]
        rationale = [""] * len(questions)
        knowledge: list[list[Hit]] = [[] for _ in questions]
        done = [False] * len(questions)
        with timer.span("total_s"):
            for step in range(c.max_steps):
                act = [i for i, d in enumerate(done) if not d]
                if not act:
                    break
                contexts = [seakr_prompt(questions[i], rationale[i], (), c.passage_words) for i in act]
                greedy = self._greedy(contexts, c.step_tokens, SENTENCE_STOP, timer)
                scores, samples = self._uncertainty(contexts, [self._seed(questions[i], step) for i in act],
                                                    c.step_tokens, SENTENCE_STOP, timer)
                chosen = list(greedy)
                retrieve = [bool(x > c.delta) for x in scores.tolist()]
                for j, i in enumerate(act):
                    traces[i].generation(greedy[j])
                    traces[i].generation(*samples[j])
                    traces[i].gate_steps.append(GateStep(self.gate.name, float(scores[j]), c.delta, retrieve[j]))
                todo = [j for j, r in enumerate(retrieve) if r]
                best = self._rerank(questions, act, todo, greedy, rationale, step, traces, timer) if todo else {}
                if best:
                    prompts = [seakr_prompt(questions[act[j]], rationale[act[j]], [h.passage], c.passage_words)
                               for j, h in best.items()]
                    regen = self._greedy(prompts, c.step_tokens, SENTENCE_STOP, timer)
                    for (j, h), s in zip(best.items(), regen):
                        i = act[j]
                        knowledge[i].append(h)
                        traces[i].use([h])
                        traces[i].generation(s)
                        chosen[j] = s
                for j, i in enumerate(act):
                    rationale[i], done[i] = append_sentence(rationale[i], chosen[j])
            answers = self._reason(questions, rationale, knowledge, traces, timer)
        return [t.result(q, a, self.name, timer.spans) for q, t, a in zip(questions, traces, answers)]

    def _rerank(self, questions, act, todo, greedy, rationale, step, traces, timer) -> dict[int, Hit]:
        """Self-aware re-ranking: retrieve top-N for each triggered question and keep the passage whose context gives
        the lowest eigenscore. Returns ``{position in act: kept passage}``; a query that finds nothing keeps none."""
        c = self.config
        queries = [self._query(questions[act[j]], greedy[j]) for j in todo]
        with timer.span("retrieval_s"):
            cands = self.retriever.search_batch(queries, c.n_candidates)
        prompts, seeds, owner = [], [], []
        for j, hs in zip(todo, cands):
            i = act[j]
            traces[i].retrieval(hs, keep=False)
            for h in hs:
                prompts.append(seakr_prompt(questions[i], rationale[i], [h.passage], c.passage_words))
                seeds.append(self._seed(questions[i], 1000 + step))  # same draws for every candidate: a fair comparison
                owner.append(j)
        scores, samples = self._uncertainty(prompts, seeds, c.step_tokens, SENTENCE_STOP, timer) if prompts else (
            torch.zeros(0), [])
        best: dict[int, tuple[float, Hit]] = {}
        pos = 0
        for j, hs in zip(todo, cands):
            for h in hs:
                traces[act[j]].generation(*samples[pos])
                score = float(scores[pos])
                if j not in best or score < best[j][0]:
                    best[j] = (score, Hit(h.passage, score))
                pos += 1
        return {j: hit for j, (_, hit) in best.items()}

    def _reason(self, questions, rationale, knowledge, traces, timer) -> list[str]:
        """Self-aware reasoning: the rationale path's answer, or — where passages were retrieved — whichever of the
        rationale path and the knowledge path has the lower eigenscore."""
        c = self.config
        prefixes = [strip_answer(r).rstrip() + " " + ANSWER_PHRASE for r in rationale]
        r_prompts = [seakr_prompt(q, p, (), c.passage_words) for q, p in zip(questions, prefixes)]
        r_answers = self._greedy(r_prompts, c.max_answer_tokens, SENTENCE_STOP, timer)
        answers = []
        for i, s in enumerate(r_answers):
            traces[i].generation(s)
            answers.append(s.text.strip())
        both = [i for i, k in enumerate(knowledge) if k]
        if not both:
            return answers
        k_prompts = [cot_prompt(questions[i], [h.passage for h in knowledge[i]], c.passage_words) for i in both]
        k_answers = self._greedy(k_prompts, c.answer_tokens, ("\n",), timer)
        seeds = [self._seed(questions[i], 2000) for i in both]
        r_scores, r_samples = self._uncertainty([r_prompts[i] for i in both], seeds, c.max_answer_tokens,
                                                SENTENCE_STOP, timer)
        k_scores, k_samples = self._uncertainty(k_prompts, seeds, c.answer_tokens, ("\n",), timer)
        for j, i in enumerate(both):
            traces[i].generation(k_answers[j])
            traces[i].generation(*r_samples[j])
            traces[i].generation(*k_samples[j])
            use_knowledge = bool(k_scores[j] < r_scores[j])
            traces[i].gate_steps.append(GateStep("knowledge_path_eigenscore", float(k_scores[j]), float(r_scores[j]),
                                                 use_knowledge))
            if use_knowledge:
                answers[i] = extract_answer(k_answers[j].text)
        return answers

