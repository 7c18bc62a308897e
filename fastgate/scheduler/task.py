"""A running program's state: :class:`Task` (one question of one method, or a bare program) and the
:class:`Trace` it accumulates from the requests its program made.

Owns the per-task record the scheduler's three parts share (result slots, timings, the trace). Calls nothing: the
driver (:mod:`fastgate.scheduler.driver`) creates tasks and advances them, the batching table
(:mod:`fastgate.scheduler.batching`) and admission (:mod:`fastgate.scheduler.admission`) fill their result slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastgate.errors import FastgateError
from fastgate.gates.base import GateStep
from fastgate.retrieval.base import Hit

__all__ = ["CancelledError", "Task", "Trace"]

NONE = object()  # a result slot not filled yet
RUNNING = object()  # a result slot whose generation is in the decode loop


class CancelledError(FastgateError):
    """The question's program was cancelled (timed out, or its client went away) before it ended."""


@dataclass
class Trace:
    """What one question accumulates from the requests its program made."""

    retrieval_calls: int = 0
    lm_calls: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # of every LM call; the k samples of one prompt share its prefill and count it once
    finish_reason: str = "stop"  # the answer generation's: "length" if it stopped at its token limit
    gate_steps: list[GateStep] = field(default_factory=list)
    passages: list[Hit] = field(default_factory=list)
    truncated: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # seconds of the batched calls it took part in, by phase
    answer: Any = None  # the Generation of its answer generation (Generate with answer=True), once delivered

    def use(self, hits: Iterable[Hit]) -> None:
        """Add ``hits`` to the passages used (deduplicated, in order)."""
        seen = {h.id for h in self.passages}
        for h in hits:
            if h.id not in seen:
                seen.add(h.id)
                self.passages.append(h)


class Task:
    """One running program (one question of one method)."""

    def __init__(self, method, question: str, on_done: Callable[[Task], None] | None = None,
                 program: Generator | None = None, listener: Callable[[dict], None] | None = None) -> None:
        self.method = method
        self.question = question
        self.program = program  # a bare program (no method): its return value is the result
        self.on_done = on_done
        self.listener = listener  # progress events (see the module docstring)
        self.trace = Trace()
        self.submitted = time.perf_counter()
        self.finished: float | None = None
        self.result = None  # a MethodResult once done
        self.error: BaseException | None = None
        self.cancelled = False
        self._gen = None
        self._waiting: list[Any] | None = None  # leaf requests awaited
        self._results: list[Any] = []
        self._fanout = False
        self._phases: set[tuple[int, str]] = set()

    @property
    def done(self) -> bool:
        return self.finished is not None

    def _time(self, call: int, phase: str, seconds: float) -> None:
        """Count a batched call's time once per question, however many of its requests the call served."""
        if (call, phase) not in self._phases:
            self._phases.add((call, phase))
            self.trace.timings[phase] = self.trace.timings.get(phase, 0.0) + seconds

