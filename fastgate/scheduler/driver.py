"""The program driver: :class:`Scheduler` runs per-question programs (:mod:`fastgate.programs`) a tick at a time.

Owns the programs' lives: :meth:`Scheduler.submit` / :meth:`Scheduler.cancel` (thread-safe), admission of the
programs submitted since the last tick, advancing each program until it waits on a request (a fan-out, ``All``,
waits on several), the order of a tick (the cheap requests first, in rounds, then the engine calls, then a decode
step), delivering each result into the program's trace and its listener's events, and ending a program with its
result or error. Calls the batching table (:mod:`fastgate.scheduler.batching`) for every batched call, admission
(:mod:`fastgate.scheduler.admission`) for the engine calls and the decode loop, and the method (``program``,
``result``) of each task; :class:`~fastgate.methods.base.Method` and :class:`~fastgate.serving.service.AnswerService`
call it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

from fastgate.engine.local import Engine
from fastgate.errors import InputError
from fastgate.programs import All, Answer, Batched, Decide, Generate, PromptStates, Search, SearchVectors
from fastgate.scheduler.admission import Admission
from fastgate.scheduler.batching import PHASES, BatchingTable, group_key
from fastgate.scheduler.config import WHOLE_PROMPTS, SchedulerConfig
from fastgate.scheduler.task import NONE, RUNNING, CancelledError, Task

__all__ = ["Scheduler"]

_CHEAP_ROUNDS = 16  # rounds of searches / gate ops / embeddings per tick before the engine calls run


class Scheduler(Admission, BatchingTable):
    """Runs per-question programs together on one engine (see :mod:`fastgate.scheduler`).

    Args:
        engine: the engine every generation and prefill runs on.
        config: the :class:`~fastgate.scheduler.config.SchedulerConfig` (default: the library's, for batch
            throughput).
        **settings: fields of the config to set instead (``max_rows=``, ``prefill_budget=``, ...; on top of
            ``config`` when both are given). ``prefill_budget=None`` is read as
            :data:`~fastgate.scheduler.config.WHOLE_PROMPTS`, as earlier versions took it.

    Raises:
        InputError: a setting out of range, or ``layout="packed"`` on a model that cannot run packed passes.
    """

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None, **settings: Any) -> None:
        if settings.get("prefill_budget", WHOLE_PROMPTS) is None:
            settings["prefill_budget"] = WHOLE_PROMPTS
        config = config or SchedulerConfig()
        self.config = dataclasses.replace(config, **settings) if settings else config
        self.engine = engine
        self._init_state()
        self._init_loops(engine, self.config)

    @property
    def max_rows(self) -> int:
        return self.config.max_rows

    @property
    def admit_every(self) -> int:
        return self.config.admit_every

    @property
    def prefill_budget(self) -> int:
        return self.config.prefill_budget

    @property
    def kv_budget(self) -> int | None:
        return self.config.kv_budget

    def _init_state(self) -> None:
        """The scheduler's running state (programs, loops, counters), whatever the engine."""
        self._loops: dict[int, Any] = {}  # pre-answer / EOS layer -> DecodeLoop (rows asking for none join any)
        self._inflight: dict[int, tuple[Any, Any]] = {}  # id(ticket) -> (loop, ticket); ticket.owner: (task, i, req)
        self._streams: dict[int, list[Any]] = {}  # id(ticket) -> [ticket, text sent]: answers with a listener
        self._inbox: list[Task] = []
        self._lock = threading.Lock()
        self._live: list[Task] = []
        self._calls = 0
        self._methods: frozenset[str] = frozenset()
        self.ticks = 0
        self.generation_calls = 0
        self.generation_rows: list[int] = []  # sequences per engine generate call (bounded history)
        self.generation_methods: list[frozenset[str]] = []  # the methods whose rows shared each generate call

    # ------------------------------------------------------------------ submitting
    def submit(self, method, question: str, on_done: Callable[[Task], None] | None = None,
               listener: Callable[[dict], None] | None = None, program: Generator | None = None) -> Task:
        """Queue ``method``'s program for ``question`` (already validated); it joins at the next tick. ``listener``
        gets its progress events (see the module docstring). ``program``: a bare program to run instead (``method``
        None; its return value is the task's result), e.g. a server's plain completion. Thread-safe."""
        task = Task(method, question, on_done, program=program, listener=listener)
        with self._lock:
            self._inbox.append(task)
        return task

    def cancel(self, task: Task) -> None:
        """Stop ``task`` at the next tick: its pending requests are dropped and it ends with
        :class:`CancelledError`. Thread-safe."""
        task.cancelled = True

    @property
    def live(self) -> int:
        """Programs admitted or queued and not yet ended."""
        with self._lock:
            return len(self._live) + len(self._inbox)

    @property
    def idle(self) -> bool:
        return self.live == 0

    @property
    def kv_bytes(self) -> int:
        """Bytes the decode loops' KV caches hold now (spare included). Read from other threads too: the lists are
        copied first (each copy is atomic under the GIL)."""
        return sum(loop.kv_bytes for loop in list(self._loops.values()))

    # ------------------------------------------------------------------ running
    def run(self, tasks: list[Task]) -> list[Task]:
        """Tick until every task in ``tasks`` has ended (other programs advance alongside)."""
        while not all(t.done for t in tasks):
            self.step()
        return tasks

    def answer(self, method, questions: list[str]) -> list:
        """Run ``method``'s program for each question; the results in order (an error of any is raised)."""
        tasks = self.run([self.submit(method, q) for q in questions])
        for t in tasks:
            if t.error is not None:
                raise t.error
        return [t.result for t in tasks]

    def evaluate(self, programs: Iterable[Generator]) -> list[Any]:
        """Run bare programs (parts of a method, e.g. DTR's ``select``) together; their return values in order."""
        tasks = []
        with self._lock:
            for p in programs:
                tasks.append(Task(None, "", program=p))
                self._inbox.append(tasks[-1])
        self.run(tasks)
        for t in tasks:
            if t.error is not None:
                raise t.error
        return [t.result for t in tasks]

    def step(self) -> bool:
        """One tick: admit, advance every program until it waits on the model (running the cheap requests it makes
        on the way: searches, embeddings, gate ops, batch ops, each kind as one call per round), then run all pending
        generations and prefills as batched engine calls and deliver the results. Returns whether programs are still
        live.

        Running the cheap requests first keeps programs in step on the expensive ones: programs whose paths diverge
        (one retrieves before its next generation, another does not) still meet in the same engine call."""
        with self._lock:
            new, self._inbox = self._inbox, []
        for task in new:
            self._live.append(task)
            self._advance(task, None, start=True)
        for task in self._live:
            if task.cancelled and not task.done:
                self._finish(task, error=CancelledError("the request was cancelled"))
        self._live = [t for t in self._live if not t.done]
        self._drop_orphans()
        ran = False
        for _ in range(_CHEAP_ROUNDS):  # bounded: a program that only ever searches cannot hold the tick
            pending = self._pending()
            cheap = [item for item in pending if not isinstance(item[2], (Generate, PromptStates))]
            if not cheap:
                break
            ran = True
            self._execute(cheap)
            self._resume()
        pending = [item for item in self._pending() if isinstance(item[2], (Generate, PromptStates))]
        ran = self._run_engine_calls(pending) or ran
        if self._inflight:
            ran = True
            self._decode_step()
        self._resume()
        if ran:
            self.ticks += 1
        return bool(self._live) or bool(self._inbox)

    def _pending(self) -> list[tuple[Task, int, Any]]:
        return [(t, i, r) for t in self._live if not t.done for i, r in enumerate(t._waiting or ())
                if t._results[i] is NONE]

    def _resume(self) -> None:
        """Send their results to the programs whose requests are all answered."""
        for task in list(self._live):
            if not task.done and task._waiting is not None and all(r is not NONE and r is not RUNNING
                                                                    for r in task._results):
                results = task._results if task._fanout else task._results[0]
                self._advance(task, results)
        self._live = [t for t in self._live if not t.done]

    def _advance(self, task: Task, value: Any, start: bool = False) -> None:
        """Send ``value`` into the program; record what it yields next (or its end)."""
        try:
            if start:
                task._gen = task.program if task.program is not None else task.method.program(task.question)
                request = next(task._gen)
            else:
                request = task._gen.send(value)
        except StopIteration as stop:
            self._finish(task, answer=stop.value)
            return
        except Exception as exc:  # a program's own error ends that question only
            self._finish(task, error=exc)
            return
        task._fanout = isinstance(request, All)
        waiting = list(request.requests) if task._fanout else [request]
        try:
            for r in waiting:
                group_key(r)  # not a request: that program's error, found before it reaches a batch
        except InputError as exc:
            self._finish(task, error=exc)
            return
        task._waiting = waiting
        task._results = [NONE] * len(task._waiting)
        if task._fanout and not task._waiting:
            self._advance(task, [])

    def _finish(self, task: Task, answer: Any = None, error: BaseException | None = None) -> None:
        task.finished = time.perf_counter()
        task._waiting, task._results = None, []
        if task._gen is not None and error is not None:
            task._gen.close()
        if error is not None:
            task.error = error
        elif task.method is None:
            task.result = answer
        else:
            if isinstance(answer, str):
                answer = Answer(answer)
            if not isinstance(answer, Answer):
                task.error = InputError(f"program of {task.method.name} returned {type(answer).__name__}, not Answer")
            else:
                task.trace.use(answer.passages)
                task.result = task.method.result(task.question, answer.text, task.trace,
                                                 {**task.trace.timings, "total_s": task.finished - task.submitted})
                if answer.details:
                    task.result.details = dict(answer.details)
        if task.on_done is not None:
            task.on_done(task)

    # ------------------------------------------------------------------ results
    def _deliver(self, task: Task, i: int, req: Any, out: Any, elapsed: float) -> None:
        """Put ``out``, the result of ``task``'s ``i``-th pending request ``req``, in its slot; count it in the
        task's trace and timings and tell its listener (a gate decision, a search, the answer's text)."""
        if task.done:
            return
        trace = task.trace
        if isinstance(req, Generate):
            trace.lm_calls += 1
            trace.generated_tokens += sum(len(s.token_ids) for s in out.sequences)
            trace.prompt_tokens += out.sequences[0].prompt_tokens if out.sequences else 0
            trace.truncated = trace.truncated or any(s.truncated for s in out.sequences)
            if req.answer and out.sequences:
                seq = trace.answer = out.sequences[0]
                trace.finish_reason = "length" if seq.finish_reason == "length" else "stop"
                self._emit(task, {"event": "answer", "text": seq.text, "stop": list(req.config.stop), "done": True})
        elif isinstance(req, PromptStates):
            trace.lm_calls += 1
            trace.prompt_tokens += sum(self.engine.count_tokens(p) for p in req.prompts)
        elif isinstance(req, (Search, SearchVectors)):
            trace.retrieval_calls += 1
            if task.listener is not None:
                self._emit(task, {"event": "retrieval",
                                  "queries": list(req.queries) if isinstance(req, Search) else None,
                                  "hits": [[{"id": h.id, "title": h.title, "score": float(h.score)} for h in hits]
                                           for hits in out]})
        elif isinstance(req, Decide):
            trace.gate_steps.append(out)
            self._emit(task, {"event": "gate", "step": out.to_dict()})
        phase = req.phase if isinstance(req, Batched) else PHASES[type(req)]
        task._time(self._calls, phase, elapsed)
        task._results[i] = out

    @staticmethod
    def _emit(task: Task, event: dict) -> None:
        """Give ``event`` to the task's listener; one that fails is dropped (the program goes on)."""
        listener = task.listener
        if listener is None:
            return
        try:
            listener(event)
        except Exception:  # noqa: BLE001 - e.g. the client's event loop has closed
            task.listener = None
