"""A running program's state: :class:`Task` (one question of one method, or a bare program) and the
:class:`Trace` it accumulates from the requests its program made.

Owns the per-task record the scheduler's three parts share (result slots, timings, the trace) behind public methods,
the :class:`Delivery` contract through which the parts hand results to the driver, and the shared call
:class:`Counters`. Calls nothing but the program: the driver (:mod:`fastgate.scheduler.driver`) creates tasks and
advances them, the batching table (:mod:`fastgate.scheduler.batching`) and admission
(:mod:`fastgate.scheduler.admission`) fill their result slots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastgate.errors import FastgateError
from fastgate.gates.base import GateStep
from fastgate.programs import All
from fastgate.retrieval.base import Hit

__all__ = ["CancelledError", "Counters", "Delivery", "Task", "Trace"]

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

    def set_answer(self, seq: Any) -> Any:
        """``seq`` (a generated sequence) is the answer's generation: its finish reason is the answer's."""
        self.answer = seq
        self.finish_reason = "length" if seq.finish_reason == "length" else "stop"
        return seq

    def use(self, hits: Iterable[Hit]) -> None:
        """Add ``hits`` to the passages used (deduplicated, in order)."""
        seen = {h.id for h in self.passages}
        for h in hits:
            if h.id not in seen:
                seen.add(h.id)
                self.passages.append(h)


class Task:
    """One running program (one question of one method): its generator, the requests it waits on and their result
    slots, and the trace. The driver starts and resumes it; the parts that answer its requests (the batching table,
    admission) fill its slots through :meth:`fill` / :meth:`mark_running` and count their time with
    :meth:`count_time`."""

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
        self._gen: Generator | None = None
        self._waiting: list[Any] | None = None  # leaf requests awaited
        self._results: list[Any] = []
        self._fanout = False
        self._phases: set[tuple[int, str]] = set()

    @property
    def done(self) -> bool:
        return self.finished is not None

    # ------------------------------------------------------------------ the program
    def start(self) -> Any:
        """Start the program (the method's for this question, or the bare one); its first request."""
        self._gen = self.program if self.program is not None else self.method.program(self.question)
        return next(self._gen)

    def send(self, value: Any) -> Any:
        """Resume the program with ``value``; its next request (``StopIteration`` carries its return value)."""
        return self._gen.send(value)

    def wait_on(self, request: Any) -> None:
        """The program now waits on ``request`` (an :class:`~fastgate.programs.All` waits on each of its parts)."""
        self._fanout = isinstance(request, All)
        self._waiting = list(request.requests) if self._fanout else [request]
        self._results = [NONE] * len(self._waiting)

    @property
    def waiting(self) -> list[Any]:
        """The requests the program waits on (empty when it waits on nothing: an empty fan-out, or ended)."""
        return list(self._waiting or ())

    def end(self, error: BaseException | None) -> None:
        """Mark the program ended (closing its generator on an error)."""
        self.finished = time.perf_counter()
        self._waiting, self._results = None, []
        if self._gen is not None and error is not None:
            try:
                self._gen.close()
            except Exception as exc:  # noqa: BLE001 - a program's own cleanup failed: it ends regardless
                # (raised, it stopped the tick: the other programs never finished and kept their KV rows)
                logging.getLogger("fastgate.scheduler").warning(
                    "fastgate: warning: a program's cleanup raised on %s (%s: %s); it ends anyway",
                    type(error).__name__, type(exc).__name__, exc)

    # ------------------------------------------------------------------ result slots
    def pending(self) -> list[tuple[int, Any]]:
        """(slot, request) of each request not answered nor running yet."""
        return [(i, r) for i, r in enumerate(self._waiting or ()) if self._results[i] is NONE]

    def fill(self, i: int, out: Any) -> None:
        """Slot ``i``'s result."""
        self._results[i] = out

    def mark_running(self, i: int) -> None:
        """Slot ``i``'s generation is decoding in a loop (not pending any more, not answered yet)."""
        self._results[i] = RUNNING

    @property
    def ready(self) -> bool:
        """Whether every request the program waits on is answered (it can be resumed)."""
        return (not self.done and self._waiting is not None
                and all(r is not NONE and r is not RUNNING for r in self._results))

    @property
    def results(self) -> Any:
        """What the program is resumed with: the list of a fan-out's results, else the one result."""
        return self._results if self._fanout else self._results[0]

    @property
    def fanout(self) -> bool:
        return self._fanout

    def count_time(self, call: int, phase: str, seconds: float) -> None:
        """Count a batched call's time once per question, however many of its requests the call served."""
        if (call, phase) not in self._phases:
            self._phases.add((call, phase))
            self.trace.timings[phase] = self.trace.timings.get(phase, 0.0) + seconds


class Delivery(Protocol):
    """Where the parts that answer requests (the batching table, admission) hand results back: the driver."""

    def deliver(self, task: Task, i: int, req: Any, out: Any, elapsed: float) -> None:
        """``out`` answers ``task``'s request ``req`` in slot ``i``; count it in the trace and tell the listener."""
        ...

    def finish(self, task: Task, answer: Any = None, error: BaseException | None = None) -> None:
        """End ``task`` with ``answer`` or ``error``."""
        ...

    def emit(self, task: Task, event: dict) -> None:
        """Give ``event`` to the task's listener."""
        ...


class Counters:
    """The scheduler's call counters, shared by its parts: the id of the batched call running now (a task counts a
    call's time once however many of its requests it served) and the history of engine generate calls (rows and the
    methods sharing each: a server's metrics read them)."""

    HISTORY = 1000  # generate calls kept

    def __init__(self) -> None:
        self.call = 0
        self.generation_calls = 0
        self.generation_rows: list[int] = []  # sequences per engine generate call (bounded history)
        self.generation_methods: list[frozenset[str]] = []  # the methods whose rows shared each generate call

    def next_call(self) -> int:
        """A new batched call's id."""
        self.call += 1
        return self.call

    def generated(self, rows: int, methods: frozenset[str]) -> None:
        """An engine generate call (or decode step) of ``rows`` sequences from programs of ``methods``."""
        self.generation_calls += 1
        self.generation_rows = (self.generation_rows + [rows])[-self.HISTORY:]
        self.generation_methods = (self.generation_methods + [methods])[-self.HISTORY:]
