"""What a method's per-question program may ask for, and what it returns.

A method is written for one question, top to bottom, as a generator (the way SGLang's frontend programs are written
per request): it ``yield``s a request and receives its result, and ``return``s an :class:`Answer`. It never batches,
counts or times anything itself: :class:`~fastgate.scheduler.Scheduler` runs many programs together, groups their
pending requests by kind into one batched call each, and keeps every question's trace (LM calls, retrievals,
generated tokens, gate steps) and its own timings from the requests it made::

    def program(self, question):
        first = (yield Generate(closed_book_prompt(question), self.answer_config())).sequences[0]
        step = yield Decide(self.gate, first)
        if not step.retrieve:
            return Answer(first.text.strip())
        (hits,) = yield Search(self.retriever, (question,), self.config.k)
        ...

Counting rules (what the trace records): every :class:`Generate` and :class:`PromptStates` request is one LM call
(k samples of one prompt, or one prefill over several prompts, count once), every :class:`Search` or
:class:`SearchVectors` request is one retrieval call, and every :class:`Decide` request adds its gate step.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastgate.config import GenerationConfig, TapSpec
from fastgate.errors import InputError
from fastgate.retrieval.base import Hit

__all__ = [
    "All",
    "Answer",
    "Batched",
    "Decide",
    "Embed",
    "Generate",
    "PassageVectors",
    "Program",
    "PromptStates",
    "Request",
    "Score",
    "Search",
    "SearchVectors",
]


@dataclass(frozen=True, eq=False)
class Generate:
    """Decode one prompt: ``k`` samples sharing one prefill. Result: a
    :class:`~fastgate.engine.local.GenerationBatch` of the k sequences with the taps asked for (running sums at
    ``taps.layers``, pre-answer / EOS states).

    ``seed`` makes sampled draws depend only on (seed, sample index), never on the other rows of the call.

    ``answer`` marks the generation whose text, stripped, is the question's answer as soon as it is asked for (the
    program returns it unchanged): the scheduler reports its text to the question's listener as it is decoded, so a
    server can stream it (:mod:`fastgate.entrypoints.http.openai`). It changes nothing that is computed.
    """

    prompt: str
    config: GenerationConfig = field(default_factory=GenerationConfig)
    taps: TapSpec = field(default_factory=TapSpec)
    k: int = 1
    seed: int | None = None
    answer: bool = False

    def __post_init__(self) -> None:
        if self.k < 1:
            raise InputError(f"k must be >= 1, got {self.k}")


@dataclass(frozen=True, eq=False)
class PromptStates:
    """The hidden state at ``layer`` of each prompt's last token, from a prefill only (CBDR's pre-answer state).
    Result: ``[len(prompts), d]`` float32."""

    prompts: tuple[str, ...]
    layer: int


@dataclass(frozen=True, eq=False)
class Search:
    """Top-``k`` hits of each query by text (BM25 or dense). Result: one hit list per query."""

    retriever: Any
    queries: tuple[str, ...]
    k: int


@dataclass(frozen=True, eq=False)
class SearchVectors:
    """Top-``k`` hits of each query vector in a dense index. Result: one hit list per row of ``vectors``."""

    retriever: Any
    vectors: Any  # [n, dim] float32 numpy
    k: int


@dataclass(frozen=True, eq=False)
class PassageVectors:
    """The stored vectors of ``hits`` in a dense index. Result: ``[len(hits), dim]`` float32 numpy."""

    retriever: Any
    hits: tuple[Hit, ...]


@dataclass(frozen=True, eq=False)
class Embed:
    """Embed ``texts`` with ``encode`` (``list[str] -> [n, dim]``); requests with the same ``encode`` share one call.
    Result: ``[len(texts), dim]`` numpy."""

    encode: Callable[[list[str]], Any]
    texts: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Score:
    """A gate's score of one signal, not recorded as a decision (e.g. SeaKR's candidate re-ranking). Requests on
    gates with the same ``batch_key`` share one op launch. Result: the score (a float, or a tensor row)."""

    gate: Any
    signal: Any


@dataclass(frozen=True, eq=False)
class Decide:
    """A gate decision on one signal; the step is added to the question's trace. Result: the
    :class:`~fastgate.gates.base.GateStep`."""

    gate: Any
    signal: Any


@dataclass(frozen=True, eq=False)
class Batched:
    """A call of ``fn(list_of_args) -> list_of_results`` shared by every program waiting on the same ``fn`` (for
    batch ops such as DTR's AIS). ``phase`` names the timing it counts under. Result: this ``arg``'s result."""

    fn: Callable[[list[Any]], list[Any]]
    arg: Any
    phase: str = "retrieval_s"


@dataclass(frozen=True, eq=False)
class All:
    """Several requests at once (a fan-out: SeaKR's greedy step and its samples, one context per candidate).
    Result: their results, in order."""

    requests: tuple[Any, ...]

    def __init__(self, *requests: Any) -> None:
        if len(requests) == 1 and isinstance(requests[0], (list, tuple)):
            requests = tuple(requests[0])
        if any(isinstance(r, All) for r in requests):
            raise InputError("All: nested fan-outs are not supported; flatten them")
        object.__setattr__(self, "requests", tuple(requests))


# what a program may yield (a request to answer with a method is fastgate.serving.runtime.AnswerRequest)
Request = Generate | PromptStates | Search | SearchVectors | PassageVectors | Embed | Score | Decide | Batched | All


@dataclass
class Answer:
    """What a program returns: the answer text, the passages it was answered from, method-specific details for the
    record (the read gate's features and closed-book answer) and, where the answer is the text of a generation that
    was not asked for as the answer (``Generate.answer``: a closed-book answer a gate kept after seeing it), that
    generation, so that the answer's finish reason (``length`` at the token limit) and tokens are its."""

    text: str
    passages: Sequence[Hit] = ()
    details: dict[str, Any] = field(default_factory=dict)
    generation: Any = None  # a fastgate.engine.generation.Sequence (not imported: programs stay below the engine)


Program = Generator[Any, Any, Answer]
