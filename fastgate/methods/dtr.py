"""DTR (Chen et al., 2025): decide by the answer's uncertainty, then dual-path retrieval with adaptive information
selection (DPR-AIS)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastgate.config import GenerationConfig
from fastgate.errors import InputError
from fastgate.gates.uncertainty import AnswerNLLGate
from fastgate.methods.base import Method, MethodConfig, MethodResult, _Timer, _Trace
from fastgate.ops import load as load_ops
from fastgate.prompts import pseudo_context_prompt
from fastgate.retrieval.base import Hit

__all__ = ["Dtr", "DtrConfig"]


@dataclass(frozen=True)
class DtrConfig(MethodConfig):
    """DTR parameters."""

    tau: float = 0.001  # retrieve iff the greedy answer's normalised NLL >= tau (paper; raise it for small models)
    n: int = 5  # top-n per path: 2n candidates for AIS (paper: 5)
    mode: str = "angle"  # AIS: angle = cos(θ1+θ2) (eq. 7); sum = s1+s2 (DTR's released code)
    pseudo_tokens: int = 64  # length of the pseudo-context passage

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau < 0:
            raise InputError(f"tau must be >= 0, got {self.tau}")
        if self.n < 1 or self.pseudo_tokens < 1:
            raise InputError("n and pseudo_tokens must be >= 1")
        if self.mode not in ("angle", "sum"):
            raise InputError(f"mode must be angle or sum, got {self.mode!r}")


class Dtr(Method):
    """Answer greedily; if ``NLL >= τ``: write a pseudo-context p, retrieve top-n for q and for p, score the union by
    AIS, answer with the top-k.

    With a dense retriever the stored passage vectors are reused; with BM25 both paths run on BM25 and the candidates
    are embedded with MiniLM for AIS.
    """

    name = "dtr"
    config_class = DtrConfig
    description = "DTR: retrieve iff answer NLL >= tau; dual-path retrieval (q, pseudo-context) + AIS (Chen+ 2025)"
    default_retriever = "dense"

    def __init__(self, engine, retriever, config: DtrConfig | None = None, ops_backend: str = "auto",
                 embedder=None) -> None:
        super().__init__(engine, retriever, config)
        self.gate = AnswerNLLGate(self.config.tau)
        self.ops = load_ops(ops_backend)
        self._embedder = embedder
        # chosen once: a dense index searches by vector and stores passage vectors; anything else searches by text
        # and its candidates are embedded for AIS
        self._dense = hasattr(retriever, "search_vectors") and hasattr(retriever, "passage_vectors")

    def _embed(self, texts: list[str]) -> np.ndarray:
        if self._dense:
            return self.retriever.embed(texts)
        if self._embedder is None:
            from fastgate.embedder import shared_embedder

            self._embedder = shared_embedder()
        return self._embedder.encode(texts)

    def _candidate_vectors(self, hits: list[Hit]) -> np.ndarray:
        if self._dense:
            return self.retriever.passage_vectors(hits)
        return self._embed([f"{h.title}. {h.text}" if h.title else h.text for h in hits])

    def select(self, questions: list[str], pseudo: list[str], timer: _Timer) -> list[list[Hit]]:
        """DPR-AIS for a batch: the top-k passages of each question."""
        c = self.config
        with timer.span("retrieval_s"):
            vecs = self._embed(questions + pseudo)  # [2m, dim]: q_1..q_m, p_1..p_m
            if self._dense:
                paths = self.retriever.search_vectors(vecs, c.n)
            else:
                paths = self.retriever.search_batch(questions + pseudo, c.n)
            m = len(questions)
            cands = []
            for i in range(m):
                union: dict[str, Hit] = {}
                for h in paths[i] + paths[m + i]:
                    union.setdefault(h.id, h)
                cands.append(list(union.values()))
            if not any(cands):
                return [[] for _ in range(m)]
            # all questions' candidates in one lookup (dense) or one embedding call (BM25), then one AIS call for the
            # batch: D is padded with zero rows to the largest union, and padded rows are dropped after the top-k
            flat = self._candidate_vectors([h for hs in cands for h in hs])  # [Σ n_i, dim]
            n_max = max(len(hs) for hs in cands)
            D = np.zeros((m, n_max, flat.shape[1]), dtype=np.float32)  # [m, n_max, dim]
            start = 0
            for i, hs in enumerate(cands):
                D[i, : len(hs)] = flat[start : start + len(hs)]
                start += len(hs)
            scores, idx = self.ops.ais_topk_batch(torch.from_numpy(vecs[:m]), torch.from_numpy(vecs[m:]),
                                                  torch.from_numpy(D), n_max, c.mode)  # [m, n_max] each, best first
            out = []
            for i in range(m):
                kept = [(j, s) for j, s in zip(idx[i].tolist(), scores[i].tolist()) if j < len(cands[i])][: c.k]
                out.append([Hit(cands[i][j].passage, s) for j, s in kept])
        return out

    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        questions = self.validate(questions)
        timer = _Timer()
        traces = [_Trace() for _ in questions]
        answers = []
        with timer.span("total_s"):
            first = self.generate_closed_book(questions, timer)
            with timer.span("gate_s"):
                decision = self.gate.decide(first)
            for i, s in enumerate(first.sequences):
                traces[i].generation(s)
                traces[i].gate_steps.append(decision.step(i))
                answers.append(s.text.strip())
            # batch by decision: only the questions the gate sends to retrieval continue, together
            todo = [i for i, r in enumerate(decision.retrieve) if r]
            if todo:
                sub = [questions[i] for i in todo]
                pseudo_cfg = GenerationConfig(max_new_tokens=self.config.pseudo_tokens, stop=("\n",))
                with timer.span("generation_s"):
                    pseudo = self.engine.generate([pseudo_context_prompt(q) for q in sub], pseudo_cfg)
                texts = [s.text.strip() or q for s, q in zip(pseudo.sequences, sub)]  # an empty passage: fall back to q
                hits = self.select(sub, texts, timer)
                final = self.generate_with_passages(sub, hits, timer)
                for i, p, hs, s in zip(todo, pseudo.sequences, hits, final.sequences):
                    traces[i].generation(p)
                    traces[i].retrieval(hs)
                    traces[i].generation(s)
                    answers[i] = s.text.strip()
        return [t.result(q, a, self.name, timer.spans) for q, t, a in zip(questions, traces, answers)]
