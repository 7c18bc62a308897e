"""DTR (Chen et al., 2025): decide by the answer's uncertainty, then dual-path retrieval with adaptive information
selection (DPR-AIS)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastgate.config import GenerationConfig
from fastgate.errors import InputError
from fastgate.gates.uncertainty import AnswerNLLGate
from fastgate.methods.base import GateThreshold, Method, MethodConfig
from fastgate.programs import Answer, Batched, Decide, Embed, Generate, PassageVectors, Program, Search, SearchVectors
from fastgate.prompts import PSEUDO_CONTEXT_PREFIX, pseudo_context_prompt
from fastgate.retrieval.base import Hit

__all__ = ["Dtr", "DtrConfig"]


@dataclass(frozen=True)
class DtrConfig(MethodConfig):
    """DTR parameters."""

    tau: float = 0.001  # retrieve iff the greedy answer's normalised NLL >= tau (paper; raise it for small models)
    n: int = 5  # top-n per path: 2n candidates for AIS (paper: 5)
    mode: str = "angle"  # AIS: angle = cos(θ1+θ2) (eq. 7); sum = s1+s2, adaptive = α-weighted angles (released code)
    pseudo_tokens: int = 64  # length of the pseudo-context passage

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau < 0:
            raise InputError(f"tau must be >= 0, got {self.tau}")
        if self.n < 1 or self.pseudo_tokens < 1:
            raise InputError("n and pseudo_tokens must be >= 1")
        if self.mode not in ("angle", "sum", "adaptive"):
            raise InputError(f"mode must be angle, sum or adaptive, got {self.mode!r}")


class Dtr(Method):
    """Answer greedily; if ``NLL >= τ``: write a pseudo-context p, retrieve top-n for q and for p, score the union by
    AIS, answer with the top-k.

    With a dense retriever the stored passage vectors are reused; with BM25 both paths run on BM25 and the candidates
    are embedded with MiniLM for AIS.
    """

    name = "dtr"
    black_box = True  # text and token log-probs only: runs on a remote engine too
    config_class = DtrConfig
    description = "DTR: retrieve iff answer NLL >= tau; dual-path retrieval (q, pseudo-context) + AIS (Chen+ 2025)"
    default_retriever = "dense"
    threshold = GateThreshold("tau", skip=1e9, retrieve_above=True)

    def __init__(self, engine, retriever, config: DtrConfig | None = None, embedder=None) -> None:
        super().__init__(engine, retriever, config)
        self.gate = AnswerNLLGate(self.config.tau)
        self.ops = engine.ops  # the engine's registry, chosen once
        self._embedder = embedder
        # chosen once: a dense index searches by vector and stores passage vectors; anything else searches by text
        # and its candidates are embedded for AIS
        self._dense = hasattr(retriever, "search_vectors") and hasattr(retriever, "passage_vectors")
        engine.cache_prefix(PSEUDO_CONTEXT_PREFIX)  # every retrieving question's pseudo-context prompt starts with it

    def _embed(self, texts: list[str]) -> np.ndarray:
        """MiniLM vectors of ``texts``: the dense index's own encoder, else the shared packaged one."""
        if self._dense:
            return self.retriever.embed(texts)
        if self._embedder is None:
            from fastgate.assets.embedder import shared_embedder

            self._embedder = shared_embedder()
        return self._embedder.encode(texts)

    def program(self, question: str) -> Program:
        first = (yield self.closed_book(question)).sequences[0]
        step = yield Decide(self.gate, first)  # UGT: retrieve iff the answer's NLL >= tau
        if not step.retrieve:
            return Answer(first.text.strip(), generation=first)
        pseudo_cfg = GenerationConfig(max_new_tokens=self.config.pseudo_tokens, stop=("\n",))
        pseudo = (yield Generate(pseudo_context_prompt(question), pseudo_cfg)).sequences[0]
        passage = pseudo.text.strip() or question  # an empty pseudo-context: fall back to the question
        hits = self.fit_passages(question, (yield from self.select(question, passage)))
        answer = (yield self.with_passages(question, hits, answer=True)).sequences[0]
        return Answer(answer.text.strip(), hits)

    def select(self, question: str, pseudo: str) -> Program:
        """DPR-AIS: top-n for the question and for the pseudo-context, the union scored by AIS, the top-k kept."""
        c = self.config
        vecs = yield Embed(self._embed, (question, pseudo))  # [2, dim]
        if self._dense:
            by_q, by_p = yield SearchVectors(self.retriever, vecs, c.n)
        else:
            by_q, by_p = yield Search(self.retriever, (question, pseudo), c.n)
        first: dict[str, Hit] = {}
        for h in by_q + by_p:
            first.setdefault(h.id, h)
        union = list(first.values())
        if not union:
            return []
        if self._dense:
            docs = yield PassageVectors(self.retriever, tuple(union))
        else:
            docs = yield Embed(self._embed, tuple(f"{h.title}. {h.text}" if h.title else h.text for h in union))
        return (yield Batched(self._ais, (vecs, docs, union)))

    def _ais(self, items: list[tuple[np.ndarray, np.ndarray, list[Hit]]]) -> list[list[Hit]]:
        """Top-k of each question's candidates in one ``ais_topk_batch`` call: candidate sets are padded with zero
        rows to the largest, and padded rows are dropped after the top-k."""
        m, n_max = len(items), max(len(u) for _, _, u in items)
        dim = items[0][1].shape[1]
        D = np.zeros((m, n_max, dim), dtype=np.float32)  # [m, n_max, dim]
        for i, (_, docs, union) in enumerate(items):
            D[i, : len(union)] = docs
        Q = torch.from_numpy(np.stack([v[0] for v, _, _ in items]).astype(np.float32))  # [m, dim]
        P = torch.from_numpy(np.stack([v[1] for v, _, _ in items]).astype(np.float32))  # [m, dim]
        scores, idx = self.ops.ais_topk_batch(Q, P, torch.from_numpy(D), n_max, self.config.mode)  # [m, n_max]
        out = []
        for i, (_, _, union) in enumerate(items):
            kept = [(j, s) for j, s in zip(idx[i].tolist(), scores[i].tolist()) if j < len(union)][: self.config.k]
            out.append([Hit(union[j].passage, s) for j, s in kept])
        return out
