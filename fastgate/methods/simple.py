"""Baselines ``never`` and ``always``."""

from __future__ import annotations

from fastgate.methods.base import Method, MethodResult, _Timer, _Trace

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
        traces = [_Trace() for _ in questions]
        for t, s in zip(traces, batch.sequences):
            t.generation(s)
        return [t.result(q, s.text.strip(), self.name, timer.spans)
                for q, t, s in zip(questions, traces, batch.sequences)]


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
        traces = [_Trace() for _ in questions]
        for t, hs, s in zip(traces, hits, batch.sequences):
            t.retrieval(hs)
            t.generation(s)
        return [t.result(q, s.text.strip(), self.name, timer.spans)
                for q, t, s in zip(questions, traces, batch.sequences)]
