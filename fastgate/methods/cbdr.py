"""CBDR (2025): confidence-based dynamic retrieval. A confidence model on the pre-answer state decides whether to
retrieve; retrieved candidates are re-ranked by the confidence shift they cause."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastgate.errors import CheckpointError, InputError
from fastgate.gates.checkpoints import load_probe_checkpoint, resolve_checkpoint
from fastgate.gates.prober import ConfidenceGate
from fastgate.methods.base import GateThreshold, Method, MethodConfig
from fastgate.programs import All, Answer, Decide, Embed, Program, PromptStates, Score, Search
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
    threshold = GateThreshold("beta", skip=0.0, retrieve_above=False)  # skip iff Conf > beta
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
        self.gate = ConfidenceGate(ckpt.params.to(engine.device), ckpt.layers[0], self.config.beta, engine.ops)
        self._reranker = None  # the trained reranker's embedder, loaded on first use

    def program(self, question: str) -> Program:
        c = self.config
        (state,) = yield PromptStates((closed_book_prompt(question),), self.gate.layer)  # one half-depth prefill
        step = yield Decide(self.gate, state)  # skip iff Conf > beta
        if not step.retrieve:
            answer = (yield self.closed_book(question, answer=True)).sequences[0]
            return Answer(answer.text.strip())
        (cands,) = yield Search(self.retriever, (question,), c.n_candidates)
        hits = self.fit_passages(question, (yield from self.rerank(question, step.score, cands)))
        answer = (yield self.with_passages(question, hits, answer=True)).sequences[0]
        return Answer(answer.text.strip(), hits)

    def rerank(self, question: str, conf_q: float, cands: list[Hit]) -> Program:
        """The top-k candidates by confidence shift ``Inc(Q,C) = Conf(Q+C) - Conf(Q)``, from one prefill of all
        (question, passage) prompts (or by the trained reranker's cosine, or as retrieved)."""
        c = self.config
        if c.reranker == "none" or not cands:
            return cands[: c.k]
        if c.reranker == "trained":
            texts = (question, *(f"{h.title}. {h.text}" if h.title else h.text for h in cands))
            vecs = yield Embed(self._encode_trained, texts)  # [1 + n, dim]
            sims = (vecs[1:] @ vecs[0]).tolist()
            order = sorted(range(len(cands)), key=lambda j: -sims[j])[: c.k]
            return [Hit(cands[j].passage, sims[j]) for j in order]
        prompts = tuple(rag_prompt(question, [h.passage], c.passage_words) for h in cands)
        states = yield PromptStates(prompts, self.gate.layer)  # [n, d]
        conf = yield All(*(Score(self.gate, s) for s in states))
        inc = [float(x) - conf_q for x in conf]
        order = sorted(range(len(cands)), key=lambda j: -inc[j])[: c.k]
        return [Hit(cands[j].passage, inc[j]) for j in order]

    def _encode_trained(self, texts: list[str]):
        """The fine-tuned embedder's unit vectors (loaded on first use)."""
        if self._reranker is None:
            from fastgate.assets.embedder import Embedder

            self._reranker = Embedder(self.config.reranker_path)
        return self._reranker.encode(texts)
