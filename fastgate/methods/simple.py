"""Baselines ``never`` and ``always``, and DTR's uncertainty-guided trigger over single-path BM25."""

from __future__ import annotations

from dataclasses import dataclass

from fastgate.errors import InputError
from fastgate.gates.uncertainty import AnswerNLLGate
from fastgate.methods.base import Method, MethodConfig, MethodResult, _Timer

__all__ = ["AlwaysRetrieve", "DtrConfig", "DtrTrigger", "NeverRetrieve"]


class NeverRetrieve(Method):
    """Closed-book answers: one greedy generation, no retrieval."""

    name = "never"
    description = "closed-book baseline: answer from the model's parameters only"
    needs_retriever = False

    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        questions = self.validate(questions)
        timer = _Timer()
        with timer.span("total_s"):
            batch = self.generate_closed_book(questions, timer)
        return [
            MethodResult(q, s.text.strip(), False, [], 0, 1, len(s.token_ids), [], dict(timer.spans), s.truncated,
                         self.name)
            for q, s in zip(questions, batch.sequences)
        ]


class AlwaysRetrieve(Method):
    """Standard RAG: retrieve top-k for the question, answer with the passages."""

    name = "always"
    description = "standard RAG baseline: always retrieve top-k for the question"

    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        questions = self.validate(questions)
        timer = _Timer()
        with timer.span("total_s"):
            hits = self.retrieve(questions, timer)
            batch = self.generate_with_passages(questions, hits, timer)
        return [
            MethodResult(q, s.text.strip(), True, hs, 1, 1, len(s.token_ids), [], dict(timer.spans), s.truncated,
                         self.name)
            for q, hs, s in zip(questions, hits, batch.sequences)
        ]


@dataclass(frozen=True)
class DtrConfig(MethodConfig):
    """DTR trigger parameters."""

    tau: float = 0.001  # DTR's threshold on the answer's normalised NLL (paper default; raise it for small models)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau < 0:
            raise InputError(f"tau must be >= 0, got {self.tau}")


class DtrTrigger(Method):
    """DTR's uncertainty-guided trigger: answer greedily; if the answer's NLL ≥ τ, retrieve top-k and answer again.

    This is DTR's *decide* step with single-path BM25 retrieval; the dual-path retrieval with AIS selection is the
    full method (``fastgate.methods.dtr`` once it lands).
    """

    name = "dtr"
    config_class = DtrConfig
    description = "DTR uncertainty-guided trigger: retrieve iff answer NLL >= tau (Chen et al., 2025)"

    def __init__(self, engine, retriever, config: DtrConfig | None = None) -> None:
        super().__init__(engine, retriever, config)
        self.gate = AnswerNLLGate(self.config.tau)

    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        questions = self.validate(questions)
        timer = _Timer()
        second = {}
        hits_by_index = {}
        with timer.span("total_s"):
            first = self.generate_closed_book(questions, timer)
            with timer.span("gate_s"):
                decision = self.gate.decide(first)
            # batch by decision: only the questions the gate sends to retrieval go through the second pass, together
            todo = [i for i, r in enumerate(decision.retrieve) if r]
            if todo:
                sub = [questions[i] for i in todo]
                hits = self.retrieve(sub, timer)
                batch = self.generate_with_passages(sub, hits, timer)
                for i, hs, s in zip(todo, hits, batch.sequences):
                    second[i], hits_by_index[i] = s, hs
        results = []
        for i, (q, s) in enumerate(zip(questions, first.sequences)):
            step = decision.step(i)
            if i in second:
                s2 = second[i]
                results.append(MethodResult(q, s2.text.strip(), True, hits_by_index[i], 1, 2,
                                            len(s.token_ids) + len(s2.token_ids), [step], dict(timer.spans),
                                            s.truncated or s2.truncated, self.name))
            else:
                results.append(MethodResult(q, s.text.strip(), False, [], 0, 1, len(s.token_ids), [step],
                                            dict(timer.spans), s.truncated, self.name))
        return results
