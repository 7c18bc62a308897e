"""One scheduler for every question: runs many per-question programs (:mod:`fastgate.programs`) together.

Each :meth:`Scheduler.step` (a tick) admits the programs submitted since the last one, advances every program until
it waits on a request, groups the pending requests by kind and runs each group as one batched call: one
``search_batch`` per (retriever, k), one embedding call per encoder, one score launch per gate kind, one call per
batch op. Generations join one running :class:`~fastgate.decode.DecodeLoop` (rows may differ in decoding settings,
taps, sample counts and seeds) and each tick runs one decode step of it: a generation that finishes goes back to its
program at that step, and a new one joins at the next (its prompt prefilled in chunks between decode steps, at most
``prefill_budget`` tokens a step, within the ``kv_budget``), so no question waits for another's generation to end.
Programs of different methods and parameters share these calls. A program's result is delivered as soon as its own
program ends (the batch-synchronous ``answer_batch`` of earlier versions returned when its slowest question ended).
Models whose cache cannot be merged (sliding-window layers) run each tick's generations as one closed engine call.

Why our own scheduler: the methods need taps, seeded k-sample fan-outs, gate ops and retrieval between decode calls,
which inference servers' schedulers (vLLM, SGLang) do not offer as one batchable program; SGLang's frontend programs
are the model for the per-question style.

Progress: a task submitted with a ``listener`` gets events as its program runs (a server streams them): each gate
decision (``{"event": "gate", "step": ...}``) and search (``{"event": "retrieval", ...}``) when it is delivered, and the
text of its answer generation (a :class:`~fastgate.programs.Generate` with ``answer=True``) after every decode step that
changed it (``{"event": "answer", "text": ..., "stop": [...], "done": False}``) and once complete (``"done": True``).
The listener runs on the scheduler's thread: it must be quick and thread-safe (e.g. put the event on a queue).

The scheduler is not thread-safe except for :meth:`submit` and :meth:`cancel`: one thread calls :meth:`step`.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fastgate.engine import Engine, GenerationBatch
from fastgate.errors import FastgateError, InputError
from fastgate.gates.base import GateStep
from fastgate.kv_cache import cell_bytes
from fastgate.programs import (
    All,
    Answer,
    Batched,
    Decide,
    Embed,
    Generate,
    PassageVectors,
    PromptStates,
    Score,
    Search,
    SearchVectors,
)
from fastgate.retrieval.base import Hit

__all__ = ["CancelledError", "Scheduler", "Task", "Trace"]


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


_PHASES = {Generate: "generation_s", PromptStates: "generation_s", Search: "retrieval_s",
           SearchVectors: "retrieval_s", PassageVectors: "retrieval_s", Embed: "retrieval_s", Score: "gate_s",
           Decide: "gate_s"}


class Scheduler:
    """Runs per-question programs together on one engine (see the module docstring).

    Args:
        engine: the engine every generation and prefill runs on.
        max_rows: the most sequences (prompts × samples) decoding at once; more wait for rows to finish (closed
            calls: are split into several calls). Bounds the KV cache (SeaKR's k samples × candidates × questions).
        continuous: generations join a running decode loop (default: when the model's cache allows it).
        admit_every: generations join a loop that is decoding every this many steps (at once when it is idle): with
            whole prefills, a larger value batches them (fewer, larger forwards) and keeps the decode moving between
            them; a new generation waits at most this many steps. With a chunked prefill, 1.
        prefill_budget: with the decode loop, the most prompt tokens (rows × columns, padding included) prefilled
            per step, in chunks between decode steps (see :meth:`DecodeLoop.admit`); None or 0: a generation's prompt
            is prefilled whole when it joins.

    The defaults favour throughput (batch evaluation: ``answer_batch``): every forward pass costs a fixed ~140 ms on
    a 2-core CPU (the weights streamed once) besides ~2 ms a prompt token, so fewer, larger prefills win. A server
    that must keep cheap requests cheap under load uses ``prefill_budget=512, admit_every=1`` (the service's
    default): a prefill then stalls the running rows for at most 512 tokens a step; in the packed layout the chunk
    runs in the decode rows' own forward, so this costs no extra pass (docs/RESULTS.md has both layouts measured).
        kv_budget: with the decode loop, the most bytes the running rows' KV cache may take (None: no bound). A
            generation joins only if the cache's worst case with it (every row right-aligned to the widest prompt,
            grown until the longest row ends) fits; otherwise it waits for rows to finish, in arrival order, and a
            generation that cannot fit even alone fails with :class:`~fastgate.errors.InputError`. Buffers never
            take more than the budget as spare. (Closed calls, for sliding-window models, are bounded by
            ``max_rows`` only.)
        layout: ``packed`` (the default where the model allows it, see :func:`fastgate.packed.packable`): each step
            is one forward of the decode rows' tokens and the step's prompt chunks, the rows' keys / values in
            fixed store rows written in place; ``padded``: the rows left-padded into one batch, prompts prefilled in
            forwards of their own (:class:`~fastgate.decode.DecodeLoop`, the only layout for sliding-window models).
        prefill_order: packed layout only: ``program`` (default) prefills the prompts of the oldest request first,
            so a request's later generations (a RAG prompt after its gate) do not queue behind newer requests' first
            ones; ``arrival``: each prompt in the order its generation was asked for.
    """

    def __init__(self, engine: Engine, max_rows: int = 80, continuous: bool | None = None,
                 admit_every: int = 8, prefill_budget: int | None = None, kv_budget: int | None = None,
                 layout: str = "auto", prefill_order: str = "program") -> None:
        if max_rows < 1:
            raise InputError(f"max_rows must be >= 1, got {max_rows}")
        if admit_every < 1:
            raise InputError(f"admit_every must be >= 1, got {admit_every}")
        if prefill_budget is not None and prefill_budget < 0:
            raise InputError(f"prefill_budget must be >= 0, got {prefill_budget}")
        self.engine = engine
        self.admit_every = admit_every
        self.prefill_budget = prefill_budget or None
        if kv_budget is not None and kv_budget < 1:
            raise InputError(f"kv_budget must be >= 1 byte, got {kv_budget}")
        self.kv_budget = kv_budget
        self.max_rows = max_rows
        self._init_state()
        # a remote engine (fastgate.remote) has no model here: each tick's generations go out as one call of
        # concurrent requests (generate_each), whose failures end only their own questions; no decode loop, no KV
        self.remote = bool(getattr(engine, "remote", False))
        if self.remote:
            self.continuous, self.layout, self.prefill_order = False, "remote", prefill_order
            self._cell, self._max_cells, self._since_admit = 0, None, 0
            return
        from fastgate.decode import DecodeLoop, mergeable
        from fastgate.packed import PackedLoop, packable

        self._cell = cell_bytes(engine.model.config, next(engine.model.parameters()).dtype)
        self._max_cells = None if kv_budget is None else max(1, kv_budget // self._cell)
        self._since_admit = 0  # decode steps since generations last joined a busy loop
        # chosen once: generations join a running decode loop, unless the model's cache cannot merge rows
        self.continuous = mergeable(engine) if continuous is None else continuous
        if layout not in ("auto", "packed", "padded"):
            raise InputError(f"layout must be auto, packed or padded, got {layout!r}")
        if layout == "packed" and not packable(engine):
            raise InputError(f"model {engine.lm.name} cannot run packed passes (sliding-window layers or an "
                             "attention that is not transformers' interface): use layout='padded'")
        # chosen once: a packed loop runs each step's decode rows and prompt chunks in one forward (fastgate.packed)
        self.layout = ("packed" if packable(engine) else "padded") if layout == "auto" else layout
        self._loop_cls = PackedLoop if self.layout == "packed" else DecodeLoop
        if prefill_order not in ("program", "arrival"):
            raise InputError(f"prefill_order must be program or arrival, got {prefill_order!r}")
        self.prefill_order = prefill_order
        self._empty_loop = self._loop_cls(engine, engine.n_layers // 2)  # never admits: asked what one row alone takes

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

    # ------------------------------------------------------------------ admission
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
        if pending and not self.continuous:
            ran = True
            self._execute(pending)
        elif pending:
            ran = True
            prefills = [item for item in pending if isinstance(item[2], PromptStates)]
            if prefills:
                self._execute(prefills)
            gens = [item for item in pending if isinstance(item[2], Generate)]
            busy = any(loop.busy for loop in self._loops.values())
            if gens and (not busy or self._since_admit >= self.admit_every - 1):
                self._admit_generations(gens)
                self._since_admit = 0
            elif gens:
                self._since_admit += 1
        if self._inflight:
            ran = True
            self._decode_step()
        self._resume()
        if ran:
            self.ticks += 1
        return bool(self._live) or bool(self._inbox)

    def _pending(self) -> list[tuple[Task, int, Any]]:
        return [(t, i, r) for t in self._live if not t.done for i, r in enumerate(t._waiting or ())
                if t._results[i] is _NONE]

    def _resume(self) -> None:
        """Send their results to the programs whose requests are all answered."""
        for task in list(self._live):
            if not task.done and task._waiting is not None and all(r is not _NONE and r is not _RUNNING
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
                _group_key(r)  # not a request: that program's error, found before it reaches a batch
        except InputError as exc:
            self._finish(task, error=exc)
            return
        task._waiting = waiting
        task._results = [_NONE] * len(task._waiting)
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

    # ------------------------------------------------------------------ the decode loop
    def _admit_generations(self, items: list[tuple[Task, int, Generate]]) -> None:
        """Prefill pending generations into the decode loop, up to ``max_rows`` decoding rows; the rest wait."""
        rows = sum(loop.size for loop in self._loops.values())
        by_loop: dict[int, list[tuple[Task, int, Generate]]] = defaultdict(list)
        joining: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # mid -> (prompt, rows, new) admitted now
        for item in items:
            if item[0].done:
                continue  # ended by an earlier request of its fan-out
            req = item[2]
            k = req.k
            if rows and rows + k > self.max_rows:
                break  # these wait for rows to finish (in order: a large fan-out is not overtaken for ever)
            mid = _mid(self.engine, req)
            if mid is None:
                mid = next(iter(self._loops), self.engine.n_layers // 2)
            if self._max_cells is not None:
                new = req.config.max_new_tokens
                prompt = min(self.engine.count_tokens(req.prompt), self.engine.lm.max_context - new - 1)
                ask = (prompt, k, new)
                alone = self._empty_loop.cells_after([ask])
                if alone > self._max_cells:
                    self._finish(item[0], error=InputError(
                        f"this generation needs {alone * self._cell / 2**20:.0f} MiB of KV cache ({k} rows of "
                        f"{prompt + new + 2} tokens), more than the budget of {self.kv_budget / 2**20:.0f} MiB"))
                    continue
                if mid not in self._loops:  # an empty loop holds nothing: building one allocates nothing
                    self._loops[mid] = self._loop_cls(self.engine, mid, max_cells=self._max_cells)
                cells = sum(loop.cells_after([*joining[m], ask] if m == mid else joining[m])
                            for m, loop in self._loops.items())
                if cells > self._max_cells:
                    break  # waits for rows to finish (in order)
                joining[mid].append(ask)
            rows += k
            by_loop[mid].append(item)
        for mid, group in by_loop.items():
            loop = self._loops.get(mid)
            if loop is None:
                loop = self._loops[mid] = self._loop_cls(self.engine, mid, max_cells=self._max_cells)
            self._calls += 1
            t0 = time.perf_counter()
            try:
                tickets = self._join(loop, group)
            except Exception as exc:
                if len(group) == 1:
                    self._finish(group[0][0], error=exc)
                    continue
                tickets = []  # find the request that failed; the others still join
                for item in group:
                    try:
                        tickets += self._join(loop, [item])
                    except Exception as one:  # noqa: BLE001 - that request's own error
                        self._finish(item[0], error=one)
            elapsed = time.perf_counter() - t0
            for ticket in tickets:
                task, i, req = ticket.owner
                task._results[i] = _RUNNING
                task._time(self._calls, "generation_s", elapsed)
                self._inflight[id(ticket)] = (loop, ticket)
                if req.answer and task.listener is not None:
                    self._streams[id(ticket)] = [ticket, ""]

    def _join(self, loop, group: list) -> list:
        """Generations ``group`` ((task, i, request) each) join ``loop``; one ticket each."""
        specs = [(r.prompt, r.config, r.taps, r.k, r.seed) for _, _, r in group]
        if self.layout == "packed":  # a packed loop prefills queued prompts in its next passes (whole without a budget)
            priority = [task.submitted for task, _, _ in group] if self.prefill_order == "program" else None
            return loop.admit(specs, owners=group, priority=priority)
        join = loop.admit if self.prefill_budget else loop.add
        return join(specs, owners=group)

    def _decode_step(self) -> None:
        """One decode step of every loop; generations that finished go back to their programs."""
        for mid, loop in list(self._loops.items()):
            if not loop.busy:
                continue
            self._calls += 1
            members = [(ticket.owner[0], ticket) for lp, ticket in self._inflight.values() if lp is loop]
            rows = loop.size
            t0 = time.perf_counter()
            try:
                done = loop.step(self.prefill_budget)
            except Exception as exc:  # the whole loop is lost: its programs end with the error
                del self._loops[mid]
                for task, ticket in members:
                    self._inflight.pop(id(ticket), None)
                    if not task.done:
                        self._finish(task, error=exc)
                continue
            elapsed = time.perf_counter() - t0
            self.generation_calls += 1
            self.generation_rows = (self.generation_rows + [rows])[-1000:]
            methods = frozenset(t.method.name for t, _ in members if t.method is not None)
            self.generation_methods = (self.generation_methods + [methods])[-1000:]
            for task, _ in members:
                task._time(self._calls, "generation_s", elapsed)
            if self._streams:
                self._stream_text(loop)
            for ticket in done:
                self._inflight.pop(id(ticket))
                task, i, req = ticket.owner
                self._deliver(task, i, req, ticket.result, 0.0)

    def _stream_text(self, loop) -> None:
        """Send the text of the answer generations decoding in ``loop`` to their listeners, where a step changed it
        (a finished one is sent complete when it is delivered)."""
        for key, entry in list(self._streams.items()):
            ticket, sent = entry
            if key not in self._inflight or ticket.owner[0].done:
                del self._streams[key]
                continue
            if self._inflight[key][0] is not loop or not ticket.rows or ticket.result is not None:
                continue
            text = ticket.rows[0].text
            if text != sent:
                entry[1] = text
                req = ticket.owner[2]
                self._emit(ticket.owner[0], {"event": "answer", "text": text, "stop": list(req.config.stop),
                                             "done": False})

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

    def _drop_orphans(self) -> None:
        """Stop the rows of generations whose program has ended (cancelled, timed out or failed elsewhere)."""
        for key, (loop, ticket) in list(self._inflight.items()):
            if ticket.owner[0].done:
                loop.cancel(ticket)
                del self._inflight[key]

    # ------------------------------------------------------------------ batched execution
    def _execute(self, pending: list[tuple[Task, int, Any]]) -> None:
        groups: dict[tuple, list[tuple[Task, int, Any]]] = defaultdict(list)
        for item in pending:
            groups[_group_key(item[2])].append(item)
        for key, items in groups.items():
            run = _RUNNERS[key[0]]
            self._calls += 1
            self._methods = frozenset(t.method.name for t, _, _ in items if t.method is not None)
            t0 = time.perf_counter()
            try:
                outs = run(self, [r for _, _, r in items])
            except Exception as exc:
                if len(items) == 1:
                    items[0][0].error = exc
                    self._finish(items[0][0], error=exc)
                    continue
                for item in items:  # find the request that failed; the others still run
                    self._execute_one(item)
                continue
            elapsed = time.perf_counter() - t0
            for (task, i, req), out in zip(items, outs):
                if isinstance(out, _Failed):  # that request's own error (a remote engine's request)
                    self._finish(task, error=out.error)
                    continue
                self._deliver(task, i, req, out, elapsed)

    def _execute_one(self, item: tuple[Task, int, Any]) -> None:
        task, i, req = item
        if task.done:
            return
        self._calls += 1
        self._methods = frozenset([task.method.name] if task.method is not None else [])
        t0 = time.perf_counter()
        try:
            (out,) = _RUNNERS[_group_key(req)[0]](self, [req])
        except Exception as exc:
            self._finish(task, error=exc)
            return
        if isinstance(out, _Failed):
            self._finish(task, error=out.error)
            return
        self._deliver(task, i, req, out, time.perf_counter() - t0)

    def _deliver(self, task: Task, i: int, req: Any, out: Any, elapsed: float) -> None:
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
        phase = req.phase if isinstance(req, Batched) else _PHASES[type(req)]
        task._time(self._calls, phase, elapsed)
        task._results[i] = out

    # ------------------------------------------------------------------ runners: one batched call per group
    def _run_generate(self, reqs: list[Generate]) -> list[GenerationBatch]:
        if self.remote:  # every request in flight at once; one that fails ends its own question only
            parts = self.engine.generate_each([r.prompt for r in reqs], [r.config for r in reqs],
                                              [r.taps for r in reqs], [r.k for r in reqs], [r.seed for r in reqs])
            self.generation_calls += 1
            self.generation_rows = (self.generation_rows + [sum(r.k for r in reqs)])[-1000:]
            self.generation_methods = (self.generation_methods + [self._methods])[-1000:]
            return [_Failed(p) if isinstance(p, BaseException) else p for p in parts]  # type: ignore[misc]
        out: list[GenerationBatch | None] = [None] * len(reqs)
        # rows asking for pre-answer / EOS states must share their layer; others join any call
        mid_of = [_mid(self.engine, r) for r in reqs]
        mids = list(dict.fromkeys(m for m in mid_of if m is not None)) or [None]
        for mid in mids:
            idx = [i for i, m in enumerate(mid_of) if m == mid or (m is None and mid == mids[0])]
            calls, rows = [[]], 0
            for i in idx:
                if calls[-1] and rows + reqs[i].k > self.max_rows:
                    calls.append([])
                    rows = 0
                calls[-1].append(i)
                rows += reqs[i].k
            for call in calls:
                sub = [reqs[i] for i in call]
                batch = self.engine.generate([r.prompt for r in sub], [r.config for r in sub], [r.taps for r in sub],
                                             [r.k for r in sub], [r.seed for r in sub])
                self.generation_calls += 1
                self.generation_rows = (self.generation_rows + [len(batch.sequences)])[-1000:]
                self.generation_methods = (self.generation_methods + [self._methods])[-1000:]
                for i, part in zip(call, _split(batch, sub)):
                    out[i] = part
        return out  # type: ignore[return-value]

    def _run_prompt_states(self, reqs: list[PromptStates]) -> list[torch.Tensor]:
        prompts = [p for r in reqs for p in r.prompts]
        states = self.engine.prompt_states(prompts, reqs[0].layer)  # [Σ n_i, d]
        return _slices(states, [len(r.prompts) for r in reqs])

    def _run_search(self, reqs: list[Search]) -> list[list[list[Hit]]]:
        hits = reqs[0].retriever.search_batch([q for r in reqs for q in r.queries], reqs[0].k)
        return _slices(hits, [len(r.queries) for r in reqs])

    def _run_search_vectors(self, reqs: list[SearchVectors]) -> list[list[list[Hit]]]:
        vecs = np.concatenate([np.asarray(r.vectors, dtype=np.float32).reshape(-1, np.shape(r.vectors)[-1])
                               for r in reqs])
        hits = reqs[0].retriever.search_vectors(vecs, reqs[0].k)
        return _slices(hits, [len(r.vectors) for r in reqs])

    def _run_passage_vectors(self, reqs: list[PassageVectors]) -> list[np.ndarray]:
        hits = [h for r in reqs for h in r.hits]
        vecs = reqs[0].retriever.passage_vectors(hits) if hits else np.zeros((0, 1), dtype=np.float32)
        return _slices(vecs, [len(r.hits) for r in reqs])

    def _run_embed(self, reqs: list[Embed]) -> list[np.ndarray]:
        texts = [t for r in reqs for t in r.texts]
        return _slices(reqs[0].encode(texts), [len(r.texts) for r in reqs])

    def _run_score(self, reqs: list[Score]) -> list[Any]:
        scores = reqs[0].gate.scores([r.signal for r in reqs])
        return [s.item() if s.ndim == 0 else s for s in scores]

    def _run_decide(self, reqs: list[Decide]) -> list[GateStep]:
        gates = {id(r.gate) for r in reqs}
        if len(gates) == 1:  # one gate: its own batched rule (word gates also build their queries here)
            return reqs[0].gate.decide([r.signal for r in reqs])
        scores = reqs[0].gate.scores([r.signal for r in reqs])  # gates of one kind share the op launch
        return [r.gate.step(s.item() if s.ndim == 0 else s, r.signal) for r, s in zip(reqs, scores)]

    def _run_batched(self, reqs: list[Batched]) -> list[Any]:
        return reqs[0].fn([r.arg for r in reqs])


@dataclass(frozen=True)
class _Failed:
    """A runner's result for one request that failed alone (the others of its call are delivered)."""

    error: BaseException


_NONE = object()  # a result slot not filled yet
_RUNNING = object()  # a result slot whose generation is in the decode loop
_CHEAP_ROUNDS = 16  # rounds of searches / gate ops / embeddings per tick before the engine calls run

_RUNNERS: dict[str, Callable[[Scheduler, list], list]] = {
    "generate": Scheduler._run_generate,
    "prompt_states": Scheduler._run_prompt_states,
    "search": Scheduler._run_search,
    "search_vectors": Scheduler._run_search_vectors,
    "passage_vectors": Scheduler._run_passage_vectors,
    "embed": Scheduler._run_embed,
    "score": Scheduler._run_score,
    "decide": Scheduler._run_decide,
    "batched": Scheduler._run_batched,
}


def _group_key(req: Any) -> tuple:
    """Requests with equal keys run as one batched call."""
    if isinstance(req, Generate):
        return ("generate",)
    if isinstance(req, PromptStates):
        return ("prompt_states", req.layer)
    if isinstance(req, Search):
        return ("search", id(req.retriever), req.k)
    if isinstance(req, SearchVectors):
        return ("search_vectors", id(req.retriever), req.k)
    if isinstance(req, PassageVectors):
        return ("passage_vectors", id(req.retriever))
    if isinstance(req, Embed):
        return ("embed", _fn_key(req.encode))
    if isinstance(req, Score):
        return ("score", req.gate.batch_key)
    if isinstance(req, Decide):
        return ("decide", req.gate.batch_key)
    if isinstance(req, Batched):
        return ("batched", _fn_key(req.fn))
    raise InputError(f"a program yielded {type(req).__name__}, which is not a request (see fastgate.programs)")


def _fn_key(fn: Callable) -> tuple:
    """Bound methods are new objects at every attribute access: key them by (instance, function)."""
    owner = getattr(fn, "__self__", None)
    return (id(owner), getattr(fn, "__func__", fn)) if owner is not None else (id(fn),)


def _mid(engine: Engine, req: Generate) -> int | None:
    t = req.taps
    if not (t.pre_answer or t.eos_state):
        return None
    return t.mid_layer if t.mid_layer is not None else engine.n_layers // 2


def _slices(values, sizes: list[int]) -> list:
    out, pos = [], 0
    for n in sizes:
        out.append(values[pos:pos + n])
        pos += n
    return out


def _split(batch: GenerationBatch, reqs: list[Generate]) -> list[GenerationBatch]:
    """One :class:`GenerationBatch` per request: its k sequences and the taps it asked for."""
    out, pos = [], 0
    where = {layer: j for j, layer in enumerate(batch.layers)}
    for r in reqs:
        rows = slice(pos, pos + r.k)
        pos += r.k
        running = count = None
        if r.taps.layers:
            cols = torch.tensor([where[x] for x in r.taps.layers], device=batch.running_sum.device)
            running = batch.running_sum[rows].index_select(1, cols)  # [k, L_r, d]
            count = batch.count[rows]
        out.append(GenerationBatch(
            sequences=batch.sequences[rows],
            running_sum=running,
            count=count,
            pre_answer=batch.pre_answer[rows] if r.taps.pre_answer and batch.pre_answer is not None else None,
            eos_state=batch.eos_state[rows] if r.taps.eos_state and batch.eos_state is not None else None,
            layers=tuple(r.taps.layers),
            steps=batch.steps,
            forwards=batch.forwards,
            timings=batch.timings,
        ))
    return out
