"""Baselines ``never`` and ``always``."""

from __future__ import annotations

from fastgate.methods.base import Method, MethodResult, _Timer

__all__ = ["AlwaysRetrieve", "NeverRetrieve"]


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
