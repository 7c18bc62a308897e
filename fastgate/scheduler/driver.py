"""The program driver: :class:`Scheduler` runs per-question programs (:mod:`fastgate.programs`) a tick at a time.

Owns the programs' lives: :meth:`Scheduler.submit` / :meth:`Scheduler.cancel` (thread-safe), admission of the
programs submitted since the last tick, advancing each program until it waits on a request (a fan-out, ``All``,
waits on several), the order of a tick (the cheap requests first, in rounds, then the engine calls, then a decode
step), delivering each result into the program's trace and its listener's events, and ending a program with its
result or error. Holds its two parts as objects and talks to them through their public methods: the batching table
(:mod:`fastgate.scheduler.batching`, ``scheduler.batching``) for every batched call, admission
(:mod:`fastgate.scheduler.admission`, ``scheduler.admission``) for the engine calls and the decode loops; both hand
results back through the driver's :class:`~fastgate.scheduler.task.Delivery` methods (:meth:`Scheduler.deliver`,
:meth:`Scheduler.finish`, :meth:`Scheduler.emit`). Calls the method (``program``, ``result``) of each task;
:class:`~fastgate.methods.base.Method` and :class:`~fastgate.serving.service.AnswerService` call it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

from fastgate.config import check_tap_layers
from fastgate.engine.protocol import LLMEngine
from fastgate.errors import FastgateError, InputError, OutOfMemory, out_of_memory
from fastgate.programs import All, Answer, Batched, Decide, Generate, PromptStates, Search, SearchVectors
from fastgate.scheduler.admission import Admission
from fastgate.scheduler.batching import PHASES, BatchingTable, group_key
from fastgate.scheduler.config import WHOLE_PROMPTS, SchedulerConfig
from fastgate.scheduler.task import CancelledError, Counters, Task

RESULT_PHASES = ("generation_s", "retrieval_s", "gate_s")  # the timings every result has (0.0: did not run)

__all__ = ["Scheduler"]

_log = logging.getLogger(__name__)

_CHEAP_ROUNDS = 16  # rounds of searches / gate ops / embeddings per tick before the engine calls run
# the longest a paused pass waits for the lane at one pause (its layers pause ~every 13 ms on two cores): a cheap
# answer's ~6 steps of ~10 ms fit; a longer one goes on at the next pause
_INTERJECT_S = 0.1


class Scheduler:
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

    def __init__(self, engine: LLMEngine, config: SchedulerConfig | None = None, **settings: Any) -> None:
        if settings.get("prefill_budget", WHOLE_PROMPTS) is None:
            settings["prefill_budget"] = WHOLE_PROMPTS
        config = config or SchedulerConfig()
        self.config = dataclasses.replace(config, **settings) if settings else config
        self.engine = engine
        self._inbox: list[Task] = []
        self._lock = threading.Lock()
        self._live: list[Task] = []
        self.ticks = 0
        self.counters = Counters()
        self.batching = BatchingTable(engine, self.config, self.counters, self)
        self.admission = Admission(engine, self.config, self.batching, self.counters, self)
        # moves requests waiting outside into the inbox (a server's queue; None: submit does): called where a pass
        # pauses, so a request that arrived during it can be interjected
        self.feed: Callable[[], None] | None = None
        self._interjected: list[Task] = []  # programs whose generations the lane runs (see _interject)
        self._interjecting = False
        if self.config.interject:
            self.admission.pause = self._interject

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

    @property
    def layout(self) -> str:
        """The decode loops' layout, chosen once: ``packed``, ``padded`` or ``remote``."""
        return self.admission.layout

    @property
    def continuous(self) -> bool:
        """Whether generations join a running decode loop (else each tick's run as closed calls)."""
        return self.admission.continuous

    @property
    def generation_calls(self) -> int:
        """Engine generate calls and decode steps so far."""
        return self.counters.generation_calls

    @property
    def generation_rows(self) -> list[int]:
        """Sequences per engine generate call or decode step (bounded history)."""
        return self.counters.generation_rows

    @property
    def generation_methods(self) -> list[frozenset[str]]:
        """The methods whose rows shared each generate call or decode step (bounded history)."""
        return self.counters.generation_methods

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
        """Bytes the decode loops' KV caches hold now (spare included); read from other threads too."""
        return self.admission.kv_bytes

    # ------------------------------------------------------------------ running
    def run(self, tasks: list[Task]) -> list[Task]:
        """Tick until every task in ``tasks`` has ended (other programs advance alongside)."""
        while not all(t.done for t in tasks):
            self.step()
        return tasks

    def answer(self, method, questions: list[str]) -> list:
        """Run ``method``'s program for each question; the results in order (an error of any is raised). The
        questions are checked first as ``method.answer_batch`` checks them (a list of non-empty strings that fit the
        context, stripped; :class:`~fastgate.errors.InputError` before anything runs)."""
        questions = method.validate(questions)
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
        self._start_inbox()
        self._end_cancelled(self._live)
        self._live = [t for t in self._live if not t.done]
        self.admission.drop_orphans()
        ran = self._run_cheap()
        pending = [item for item in self._pending() if isinstance(item[2], (Generate, PromptStates))]
        ran = self.admission.run_engine_calls(pending) or ran
        if self.admission.busy:
            ran = True
            self.admission.decode_step()
        self._resume()
        if ran:
            self.ticks += 1
        return bool(self._live) or bool(self._inbox)

    def _start_inbox(self) -> list[Task]:
        """Start the programs submitted since the last look at the inbox; returns them."""
        with self._lock:
            new, self._inbox = self._inbox, []
        for task in new:
            self._live.append(task)
            self._advance(task, None, start=True)
        return new

    def _end_cancelled(self, tasks: list[Task]) -> None:
        """End the cancelled programs of ``tasks``."""
        for task in tasks:
            if task.cancelled and not task.done:
                self.finish(task, error=CancelledError("the request was cancelled"))

    def _run_cheap(self, tasks: list[Task] | None = None) -> bool:
        """Run the cheap requests (searches, embeddings, gate ops, batch ops) of ``tasks`` (else every live
        program), each kind as one call a round, resuming the programs they answer, until none asks for one; returns
        whether any ran. Bounded: a program that only ever searches cannot hold the tick."""
        ran = False
        for _ in range(_CHEAP_ROUNDS):
            cheap = [item for item in self._pending(tasks) if not isinstance(item[2], (Generate, PromptStates))]
            if not cheap:
                break
            ran = True
            self.batching.execute(cheap)
            self._resume(tasks)
        return ran

    def _pending(self, tasks: list[Task] | None = None) -> list[tuple[Task, int, Any]]:
        return [(t, i, r) for t in (self._live if tasks is None else tasks) if not t.done for i, r in t.pending()]

    def _resume(self, tasks: list[Task] | None = None) -> None:
        """Send their results to the programs (of ``tasks``, else every live one) whose requests are all answered."""
        for task in list(self._live if tasks is None else tasks):
            if task.ready:
                self._advance(task, task.results)
        if tasks is None:
            self._live = [t for t in self._live if not t.done]

    def _interject(self) -> None:
        """Between two layers of a long pass (``SchedulerConfig.interject``): while few programs are live, start the
        programs submitted since the tick began, run their cheap requests, and run their short generations in the
        admission's lane (a loop of its own) for up to :data:`_INTERJECT_S`, those of earlier pauses too; the pass then
        goes on. A cheap question that arrives while reading prompts prefill is answered before the pass ends; its
        longer generations, and everything of a busy server, wait for the next tick as before."""
        if self._interjecting:
            return  # the lane's own passes never pause, but a program's hook might step the engine
        self._interjecting = True
        try:
            if self.feed is not None:
                self.feed()
            self._end_cancelled(self._interjected)
            self._interjected = [t for t in self._interjected if not t.done]
            self.admission.drop_orphans(lane_only=True)  # their lane rows stop now, not at the next tick
            # a busy server leaves new programs to the next tick: it packs their rows into its passes, for less than
            # passes of their own
            take = bool(self._inbox) and len(self._live) + len(self._inbox) <= self.config.interject
            if not take and not self._interjected:
                return
            new = self._start_inbox() if take else []
            tasks = self._interjected = [t for t in self._interjected + new if not t.done]
            deadline = time.perf_counter() + _INTERJECT_S
            while tasks:
                self._run_cheap(tasks)
                self.admission.join_lane([item for item in self._pending(tasks) if isinstance(item[2], Generate)])
                if not self.admission.lane_busy or time.perf_counter() >= deadline:
                    break
                self.admission.step_lane()
                self._resume(tasks)
                tasks = [t for t in tasks if not t.done]
            # the next pauses go on with those the lane still runs; the others' next requests wait for the next tick
            lane = self.admission.lane_owners()
            self._interjected = [t for t in tasks if not t.done and id(t) in lane]
        except Exception as exc:  # noqa: BLE001 - the paused pass goes on; only the interjected programs end
            for task in self._interjected:
                if not task.done:
                    self.finish(task, error=exc)
            self._interjected = []
        finally:
            self._interjecting = False

    def _advance(self, task: Task, value: Any, start: bool = False) -> None:
        """Send ``value`` into the program; record what it yields next (or its end)."""
        try:
            request = task.start() if start else task.send(value)
        except StopIteration as stop:
            self.finish(task, answer=stop.value)
            return
        except Exception as exc:  # a program's own error ends that question only
            self.finish(task, error=exc)
            return
        parts = list(request.requests) if isinstance(request, All) else [request]
        try:
            for r in parts:
                group_key(r)  # not a request: that program's error, found before it reaches a batch
                if isinstance(r, Generate):
                    self._check_taps(r.taps)
        except InputError as exc:
            self.finish(task, error=exc)
            return
        task.wait_on(request)
        if task.fanout and not task.waiting:
            self._advance(task, [])

    def _check_taps(self, taps) -> None:
        """A generation's tap layers exist in the model (``Engine.generate``'s check): found in a decode loop instead,
        a bad layer failed every program sharing that loop with a KeyError / IndexError."""
        n_layers = getattr(self.engine, "n_layers", None)
        if not n_layers:  # a remote engine (0): no taps reach it, it refuses them itself
            return
        check_tap_layers((*taps.layers, *([taps.mid_layer] if taps.mid_layer is not None else [])), n_layers)

    # ------------------------------------------------------------------ Delivery: the parts hand results back here
    def finish(self, task: Task, answer: Any = None, error: BaseException | None = None) -> None:
        """End ``task`` with the program's ``answer`` (its result is built by the method) or ``error``; tell its
        ``on_done``."""
        if error is not None and not isinstance(error, FastgateError) and out_of_memory(error):
            # a failed allocation is the batch's size, not the request: a server says 503 with a reason, not 500
            cause = error
            error = OutOfMemory(f"ran out of memory answering this request ({type(cause).__name__}: {cause}); retry, "
                                "or run fewer at once (a server's --max-live, --max-rows, --kv-budget-mb; an "
                                "evaluation's --batch-size)")
            error.__cause__ = cause
        task.end(error)
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
                try:
                    task.trace.use(answer.passages)
                    if answer.generation is not None and task.trace.answer is None:  # a kept closed-book answer
                        task.trace.set_answer(answer.generation)
                    # every phase's key, 0.0 where it did not run (a skipped question has no retrieval_s: a reader's
                    # timings["retrieval_s"] was a KeyError)
                    timings = {**dict.fromkeys(RESULT_PHASES, 0.0), **task.trace.timings,
                               "total_s": task.finished - task.submitted}
                    task.result = task.method.result(task.question, answer.text, task.trace, timings)
                    if answer.details:
                        task.result.details = dict(answer.details)
                except Exception as exc:  # noqa: BLE001 - a result that cannot be built fails that question only
                    task.result, task.error = None, exc
        if task.on_done is not None:
            try:
                task.on_done(task)
            except Exception:  # noqa: BLE001 - the caller's callback: raised here it would end the other programs
                _log.exception("on_done of a %s program raised; the scheduler goes on",
                               task.method.name if task.method is not None else "bare")

    def deliver(self, task: Task, i: int, req: Any, out: Any, elapsed: float) -> None:
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
                seq = trace.set_answer(out.sequences[0])
                self.emit(task, {"event": "answer", "text": seq.text, "stop": list(req.config.stop), "done": True})
        elif isinstance(req, PromptStates):
            trace.lm_calls += 1
            trace.prompt_tokens += sum(self.engine.count_tokens(p) for p in req.prompts)
        elif isinstance(req, (Search, SearchVectors)):
            trace.retrieval_calls += 1
            if task.listener is not None:
                self.emit(task, {"event": "retrieval",
                                  "queries": list(req.queries) if isinstance(req, Search) else None,
                                  "hits": [[{"id": h.id, "title": h.title, "score": float(h.score)} for h in hits]
                                           for hits in out]})
        elif isinstance(req, Decide):
            trace.gate_steps.append(out)
            self.emit(task, {"event": "gate", "step": out.to_dict()})
        phase = req.phase if isinstance(req, Batched) else PHASES[type(req)]
        task.count_time(self.counters.call, phase, elapsed)
        task.fill(i, out)

    @staticmethod
    def emit(task: Task, event: dict) -> None:
        """Give ``event`` to the task's listener; one that fails is dropped (the program goes on)."""
        listener = task.listener
        if listener is None:
            return
        try:
            listener(event)
        except Exception:  # noqa: BLE001 - e.g. the client's event loop has closed
            task.listener = None
