"""Baselines ``never`` and ``always``."""

from __future__ import annotations

from fastgate.methods.base import Method
from fastgate.programs import Answer, Program, Search

__all__ = ["AlwaysRetrieve", "NeverRetrieve"]


class NeverRetrieve(Method):
    """Closed-book answers: one greedy generation, no retrieval."""

    name = "never"
    black_box = True  # text and token log-probs only: runs on a remote engine too
    description = "closed-book baseline: answer from the model's parameters only"
    needs_retriever = False

    def program(self, question: str) -> Program:
        answer = (yield self.closed_book(question, answer=True)).sequences[0]
        return Answer(answer.text.strip())


class AlwaysRetrieve(Method):
    """Standard RAG: retrieve top-k for the question, answer with the passages."""

    name = "always"
    black_box = True  # text and token log-probs only: runs on a remote engine too
    description = "standard RAG baseline: always retrieve top-k for the question"

    def program(self, question: str) -> Program:
        (hits,) = yield Search(self.retriever, (question,), self.config.k)
        hits = self.fit_passages(question, hits)
        answer = (yield self.with_passages(question, hits, answer=True)).sequences[0]
        return Answer(answer.text.strip(), hits)
