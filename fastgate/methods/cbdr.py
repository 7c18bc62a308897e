"""CBDR (2025): confidence-based dynamic retrieval. A confidence model on the pre-answer state decides whether to
retrieve; retrieved candidates are re-ranked by the confidence shift they cause."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastgate.errors import CheckpointError, InputError
from fastgate.gates.prober import ConfidenceGate
from fastgate.methods.base import Method, MethodConfig, MethodResult, _Timer, _Trace
from fastgate.probes import load_probe_checkpoint, resolve_checkpoint
from fastgate.prompts import closed_book_prompt, rag_prompt
from fastgate.retrieval.base import Hit

__all__ = ["Cbdr", "CbdrConfig"]


@dataclass(frozen=True)
class CbdrConfig(MethodConfig):
    """CBDR parameters."""

    checkpoint: str = ""  # confidence-model checkpoint directory (`fastgate train confidence`); required
    beta: float = 0.95  # skip retrieval iff Conf > beta (paper: 0.95 for top-1, 0.98 for top-3)
    n_candidates: int = 20  # passages retrieved before re-ranking (paper: 20)
    reranker: str = "shift"  # shift: Inc(Q,C) = Conf(Q+C) - Conf(Q); trained: a fine-tuned embedder; none: as retrieved
    reranker_path: str = ""  # the trained reranker's directory (`fastgate train reranker`), for reranker=trained

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.beta <= 1.0:
            raise InputError(f"beta must be in [0, 1], got {self.beta}")
        if self.n_candidates < self.k:
            raise InputError(f"n_candidates ({self.n_candidates}) must be >= k ({self.k})")
        if self.reranker not in ("shift", "trained", "none"):
            raise InputError(f"reranker must be shift, trained or none, got {self.reranker!r}")
        if self.reranker == "trained" and not self.reranker_path:
            raise InputError("reranker=trained needs reranker_path=DIR (train one: `fastgate train reranker`)")


class Cbdr(Method):
    """Pre-answer confidence from one prefill; skip iff Conf > β; else retrieve N, re-rank by Inc(Q,C), answer
    with the top-k."""

    name = "cbdr"
    config_class = CbdrConfig
    description = "CBDR: pre-answer confidence gate; candidates re-ranked by confidence shift Inc(Q,C)"

    @classmethod
    def preflight(cls, config: CbdrConfig, model_name: str | None = None) -> Path:
        """The checkpoint to load: ``config.checkpoint``, or the one shipped for ``model_name``."""
        return resolve_checkpoint(config.checkpoint, model_name, "confidence", cls.name, "fastgate train confidence")

    def __init__(self, engine, retriever, config: CbdrConfig | None = None) -> None:
        super().__init__(engine, retriever, config)
        path = self.preflight(self.config, engine.lm.name)
        ckpt = load_probe_checkpoint(path, engine.lm, kind="confidence")
        if len(ckpt.layers) != 1:
            raise CheckpointError(f"{ckpt.path}: a confidence model reads one layer, not {list(ckpt.layers)}")
        self.checkpoint = ckpt
        self.gate = ConfidenceGate(ckpt.params.to(engine.device), ckpt.layers[0], self.config.beta, engine.gate_ops)
        self._reranker = None  # the trained reranker's embedder, loaded on first use

    def rerank(self, questions: list[str], conf_q: list[float], cands: list[list[Hit]], timer: _Timer
               ) -> list[list[Hit]]:
        """Top-k of each candidate list by confidence shift, from one batched prefill of all (question, passage)."""
        c = self.config
        if c.reranker == "none":
            return [hs[: c.k] for hs in cands]
        if c.reranker == "trained":
            return self._rerank_trained(questions, cands)
        prompts = [rag_prompt(q, [h.passage], c.passage_words) for q, hs in zip(questions, cands) for h in hs]
        if not prompts:
            return [[] for _ in cands]
        with timer.span("rerank_s"):
            conf = self.gate.confidence(self.engine.prompt_states(prompts, self.gate.layer)).tolist()  # [Σ n_i]
        out, pos = [], 0
        for cq, hs in zip(conf_q, cands):
            inc = [conf[pos + j] - cq for j in range(len(hs))]
            pos += len(hs)
            order = sorted(range(len(hs)), key=lambda j: -inc[j])[: c.k]
            out.append([Hit(hs[j].passage, inc[j]) for j in order])
        return out

    def _rerank_trained(self, questions: list[str], cands: list[list[Hit]]) -> list[list[Hit]]:
        """Top-k by cosine between the question and each passage under the fine-tuned embedder."""
        if self._reranker is None:
            from fastgate.embedder import Embedder

            self._reranker = Embedder(self.config.reranker_path)
        out = []
        for q, hs in zip(questions, cands):
            if not hs:
                out.append([])
                continue
            vecs = self._reranker.encode([q] + [f"{h.title}. {h.text}" if h.title else h.text for h in hs])
            sims = (vecs[1:] @ vecs[0]).tolist()
            order = sorted(range(len(hs)), key=lambda j: -sims[j])[: self.config.k]
            out.append([Hit(hs[j].passage, sims[j]) for j in order])
        return out

    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        questions = self.validate(questions)
        c = self.config
        timer = _Timer()
        traces = [_Trace() for _ in questions]
        answers = [""] * len(questions)
        with timer.span("total_s"):
            with timer.span("gate_s"):
                states = self.engine.prompt_states([closed_book_prompt(q) for q in questions], self.gate.layer)
                decision = self.gate.decide_states(states)
            for i, t in enumerate(traces):
                t.lm_calls += 1  # the prefill that read the pre-answer state
                t.gate_steps.append(decision.step(i))
            skip = [i for i, r in enumerate(decision.retrieve) if not r]
            todo = [i for i, r in enumerate(decision.retrieve) if r]
            if skip:
                batch = self.generate_closed_book([questions[i] for i in skip], timer)
                for i, s in zip(skip, batch.sequences):
                    traces[i].generation(s)
                    answers[i] = s.text.strip()
            if todo:
                sub = [questions[i] for i in todo]
                with timer.span("retrieval_s"):
                    cands = self.retriever.search_batch(sub, c.n_candidates)
                conf_q = [float(decision.scores[i]) for i in todo]
                hits = self.rerank(sub, conf_q, cands, timer)
                if c.reranker == "shift":
                    for i in todo:
                        traces[i].lm_calls += 1  # the batched prefill over its candidates
                batch = self.generate_with_passages(sub, hits, timer)
                for i, hs, s in zip(todo, hits, batch.sequences):
                    traces[i].retrieval(hs)
                    traces[i].generation(s)
                    answers[i] = s.text.strip()
        return [t.result(q, a, self.name, timer.spans) for q, t, a in zip(questions, traces, answers)]
