"""Admission: generations join a running decode loop within the row and KV-cache budgets, and each tick runs one
decode step of every loop; models whose cache cannot take rows into a running loop (sliding-window layers) run each
tick's generations as closed engine calls instead.

Owns the decode loops and the choice of loop (packed or padded layout, continuous or closed, made once from the
model), the KV budget in cache cells (what a row costs is the engine's KV owner's word,
:class:`~fastgate.engine.kv_cache.KVCacheManager`), when generations join (every ``admit_every`` steps of a busy
loop, in arrival order, a large fan-out not overtaken), how their prompts are prefilled (whole, or ``prefill_budget``
tokens a step, oldest request first), the decode step and the streaming of answer text. Calls
:class:`~fastgate.engine.packed.PackedLoop` / :class:`~fastgate.engine.decode.DecodeLoop` (``admit``, ``add``,
``step``, ``cancel``, ``cells_after``) and the batching table (:mod:`fastgate.scheduler.batching`) for closed calls
and prefills; the driver (:mod:`fastgate.scheduler.driver`) calls :meth:`Admission.run_engine_calls` and
:meth:`Admission.decode_step` once a tick, and receives each finished generation through its
:class:`~fastgate.scheduler.task.Delivery`.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, cast

from fastgate.engine.local import Engine
from fastgate.engine.protocol import LLMEngine
from fastgate.errors import InputError
from fastgate.programs import Generate, PromptStates
from fastgate.scheduler.batching import BatchingTable, mid_layer
from fastgate.scheduler.config import WHOLE_PROMPTS, SchedulerConfig
from fastgate.scheduler.task import Counters, Delivery, Task

__all__ = ["LANE_NEW_TOKENS", "LANE_PROMPT_TOKENS", "Admission"]

LANE_NEW_TOKENS = 32  # a generation of more new tokens waits for the next tick (it would hold a paused pass long)
LANE_PROMPT_TOKENS = 64  # prompt tokens after the cached prefix a generation taken by the lane may have, without
# express_prefill (the service's express_prefill: a closed-book question after the cached few-shot block is ~10)


class Admission:
    """The :class:`~fastgate.scheduler.Scheduler`'s decode loops and their admission (see the module docstring).

    Chooses, once, how generations run on ``engine``: the loop's layout, continuous or closed calls, the KV budget in
    cells. A remote engine (:mod:`fastgate.engine.remote`) has no model here: each tick's generations go out as one
    call of concurrent requests (``submit_each``, each in flight across ticks until answered), whose failures end only
    their own questions; no decode loop, no KV.

    Args:
        engine: the engine the loops run on.
        config: the scheduler's settings (rows, KV budget, admission cadence, prefill budget and order, layout).
        batching: the batching table, for closed calls and whole prefills.
        counters: the scheduler's call counters (shared with the batching table).
        delivery: where finished generations and errors go (the driver).

    Raises:
        InputError: ``layout="packed"`` on a model that cannot run packed passes.
    """

    def __init__(self, engine: LLMEngine, config: SchedulerConfig, batching: BatchingTable, counters: Counters,
                 delivery: Delivery) -> None:
        self.engine = engine
        self.config = config
        self.batching = batching
        self.counters = counters
        self.delivery = delivery
        self.loops: dict[int, Any] = {}  # pre-answer / EOS layer -> DecodeLoop (rows asking for none join any)
        self._inflight: dict[int, tuple[Any, Any]] = {}  # id(ticket) -> (loop, ticket); ticket.owner: (task, i, req)
        self._streams: dict[int, list[Any]] = {}  # id(ticket) -> [ticket, text sent]: answers with a listener
        self._since_admit = 0  # decode steps since generations last joined a busy loop
        self.prefill_order = config.prefill_order
        # called between the layers of a loop's long pass (the driver's Scheduler._interject; None: never paused),
        # and the loop whose passes run the generations it takes there (join_lane)
        self.pause: Callable[[], None] | None = None
        self.lane: Any = None
        self.paused_s = 0.0  # seconds spent in pauses so far (not charged to the paused pass's rows)
        if engine.remote:
            self.continuous, self.layout = False, "remote"
            self._cell, self._max_cells = 0, None
            return
        from fastgate.engine.decode import DecodeLoop, mergeable
        from fastgate.engine.packed import PackedLoop, packable

        local = cast(Engine, engine)
        self.kv = local.kv  # the engine's KV owner: what a row costs, the prompt's truncation, bytes a cell
        self._cell = self.kv.cell_bytes
        self._max_cells = self.kv.budget_cells(config.kv_budget)
        # chosen once: generations join a running decode loop, unless the model's cache cannot merge rows
        self.continuous = mergeable(local) if config.continuous is None else config.continuous
        if config.layout == "packed" and not packable(local):
            raise InputError(f"model {local.lm.name} cannot run packed passes (sliding-window layers or an "
                             "attention that is not transformers' interface): use layout='padded'")
        # chosen once: a packed loop runs each step's decode rows and prompt chunks in one forward
        # (fastgate.engine.packed)
        self.layout = ("packed" if packable(local) else "padded") if config.layout == "auto" else config.layout
        if self.layout == "packed":  # short prompts first within half a step's budget (SchedulerConfig.express_prefill)
            self._loop_cls = functools.partial(PackedLoop, express_prefill=config.express_prefill)
        else:
            self._loop_cls = DecodeLoop
        self._empty_loop = self._loop_cls(local, local.n_layers // 2)  # never admits: asked what one row alone takes

    @property
    def busy(self) -> bool:
        """Whether generations are decoding (a decode step has work)."""
        return bool(self._inflight)

    @property
    def kv_bytes(self) -> int:
        """Bytes the decode loops' KV caches hold now (spare included). Read from other threads too: the dict is
        copied first (atomic under the GIL)."""
        lane = self.lane
        return sum(loop.kv_bytes for loop in list(self.loops.values())) + (lane.kv_bytes if lane is not None else 0)

    def run_engine_calls(self, pending: list[tuple[Task, int, Any]]) -> bool:
        """This tick's generations and prefills (``pending``): one closed call per group without a decode loop, else
        the prefills as batched calls and the generations joining the loop (every ``admit_every`` steps of a busy
        one). Returns whether anything ran."""
        if not pending:
            return False
        if self.config.kv_budget is not None and not self.engine.remote:  # a bounded scheduler: see _over_max_rows
            pending = [item for item in pending if not self._over_max_rows(item)]
        if not self.continuous:  # the closed-batch path: sliding-window models and remote engines
            if pending:
                self.batching.execute(pending)
            return True
        prefills = [item for item in pending if isinstance(item[2], PromptStates)]
        if prefills:
            self.batching.execute(prefills)
        gens = [item for item in pending if isinstance(item[2], Generate)]
        busy = any(loop.busy for loop in self.loops.values())
        if gens and (not busy or self._since_admit >= self.config.admit_every - 1):
            self._admit_generations(gens)
            self._since_admit = 0
        elif gens:
            self._since_admit += 1
        return True

    def _over_max_rows(self, item: tuple[Task, int, Any]) -> bool:
        """Whether ``item`` is a generation of more rows (samples) than ``max_rows``; if so its program ends with
        :class:`InputError`, as one that cannot fit the KV budget alone does. Asked only of a bounded scheduler (a
        KV budget: the service's), where clients choose the rows: joining an empty loop, such a generation was taken
        whole (``max_rows=4`` decoded 16 rows a step; a request's SeaKR ``samples`` may be 1024). An unbounded one
        (the library's batch runs, whose caller chose the samples) runs it alone, as before."""
        req = item[2]
        if not isinstance(req, Generate) or req.k <= self.config.max_rows:
            return False
        if not item[0].done:
            self.delivery.finish(item[0], error=InputError(
                f"this generation asks for {req.k} rows (samples) at once, more than max_rows={self.config.max_rows}, "
                "the most sequences decoded at once (--max-rows)"))
        return True

    def _admit_generations(self, items: list[tuple[Task, int, Generate]]) -> None:
        """Prefill pending generations into the decode loop, up to ``max_rows`` decoding rows; the rest wait."""
        lane = self.lane  # the rows and cells a paused pass's new cheap generations hold count too
        rows = sum(loop.size for loop in self.loops.values()) + (lane.size if lane is not None else 0)
        by_loop: dict[int, list[tuple[Task, int, Generate]]] = defaultdict(list)
        joining: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # mid -> (prompt, rows, new) admitted now
        for item in items:
            if item[0].done:
                continue  # ended by an earlier request of its fan-out
            req = item[2]
            k = req.k
            # alone in an empty loop any k runs (a bounded scheduler refused k > max_rows in run_engine_calls)
            if rows and rows + k > self.config.max_rows:
                break  # these wait for rows to finish (in order: a large fan-out is not overtaken for ever)
            mid = mid_layer(self.engine, req)
            if mid is None:
                mid = next(iter(self.loops), self.engine.n_layers // 2)
            if self._max_cells is not None:
                new = req.config.max_new_tokens
                prompt = self.kv.prompt_tokens(self.engine.count_tokens(req.prompt), new)
                ask = (prompt, k, new)
                alone = self._empty_loop.cells_after([ask])
                if alone > self._max_cells:
                    self.delivery.finish(item[0], error=InputError(
                        f"this generation needs {_readable_size(alone * self._cell)} of KV cache ({k} "
                        f"row{'s' if k != 1 else ''} of {self.kv.row_columns(prompt, new)} tokens, and its prompt's "
                        f"{prompt} tokens once more while it is prefilled), more than the budget of "
                        f"{_readable_size(self.config.kv_budget)}"))
                    continue
                if mid not in self.loops:  # an empty loop holds nothing: building one allocates nothing
                    self.loops[mid] = self._new_loop(mid)
                cells = sum(loop.cells_after([*joining[m], ask] if m == mid else joining[m])
                            for m, loop in self.loops.items()) + (lane.cells_after() if lane is not None else 0)
                if cells > self._max_cells:
                    break  # waits for rows to finish (in order)
                joining[mid].append(ask)
            rows += k
            by_loop[mid].append(item)
        for mid, group in by_loop.items():
            loop = self.loops.get(mid)
            if loop is None:
                loop = self.loops[mid] = self._new_loop(mid)
            self._join_loop(loop, group)

    def _new_loop(self, mid: int):
        """A decode loop for rows of pre-answer layer ``mid``; on a CPU its long passes pause for :attr:`pause`, and
        its store's spare leaves room for what the other loops hold."""
        loop = self._loop_cls(self.engine, mid, max_cells=self._max_cells)
        if self.layout == "packed":
            # a GPU pass takes milliseconds, and the lane would share the main loop's static step (one CUDA graph
            # pool, its outputs read a tick later): the pause is for CPUs, where a 512-token pass takes ~0.4 s
            if self.pause is not None and cast(Engine, self.engine).runner.device.type == "cpu":
                loop.pause = self._paused
            loop.held_elsewhere = lambda: self._cells_besides(loop)
        return loop

    def _paused(self) -> None:
        """What a long pass calls between its layers: :attr:`pause`, its time kept in :attr:`paused_s` (the lane's
        steps there are the interjected programs' time, not the paused pass's)."""
        t0 = time.perf_counter()
        try:
            cast(Callable[[], None], self.pause)()
        finally:
            self.paused_s += time.perf_counter() - t0

    def _cells_besides(self, loop) -> int:
        """The cells every loop but ``loop`` (the lane included) can reach (``cells_after``)."""
        lane = self.lane
        others = [lp for lp in [*self.loops.values(), lane] if lp is not None and lp is not loop]
        return sum(lp.cells_after() for lp in others)

    def _join_loop(self, loop, group: list[tuple[Task, int, Generate]]) -> None:
        """Generations ``group`` join ``loop``: each running there from now (a request that fails to join ends its
        question only)."""
        call = self.counters.next_call()
        t0 = time.perf_counter()
        try:
            tickets = self._join(loop, group)
        except Exception as exc:
            if len(group) == 1:
                self.delivery.finish(group[0][0], error=exc)
                return
            tickets = []  # find the request that failed; the others still join
            for item in group:
                try:
                    tickets += self._join(loop, [item])
                except Exception as one:  # noqa: BLE001 - that request's own error
                    self.delivery.finish(item[0], error=one)
        elapsed = time.perf_counter() - t0
        for ticket in tickets:
            task, i, req = ticket.owner
            task.mark_running(i)
            task.count_time(call, "generation_s", elapsed)
            self._inflight[id(ticket)] = (loop, ticket)
            if req.answer and task.listener is not None:
                self._streams[id(ticket)] = [ticket, ""]

    # -------------------------------------------------------------- the lane: a paused pass's new cheap generations
    @property
    def lane_busy(self) -> bool:
        """Whether the lane's loop has rows or prompts."""
        return self.lane is not None and self.lane.busy

    def join_lane(self, items: list[tuple[Task, int, Generate]]) -> None:
        """The generations of ``items`` that are short (at most :data:`LANE_NEW_TOKENS` new tokens, a prompt of at
        most ``express_prefill`` tokens (else 64) after its cached prefix, the running loop's pre-answer layer) join
        the lane's loop, within ``max_rows`` and the KV budget; the others stay pending for the next tick."""
        if not items or self.layout != "packed" or not self.continuous:
            return
        main = next(iter(self.loops), self.engine.n_layers // 2)
        if self.lane is None or self.lane.mid != main:
            if self.lane is not None and self.lane.busy:
                return
            self.lane = self._loop_cls(self.engine, main, max_cells=self._max_cells)  # never pauses itself
        eng = cast(Engine, self.engine)
        runner = eng.runner
        limit = self.config.express_prefill or LANE_PROMPT_TOKENS
        rows = sum(loop.size for loop in self.loops.values()) + self.lane.size
        besides = self._cells_besides(self.lane) if self._max_cells is not None else 0  # the main loops' cells
        group, joining = [], []
        for item in items:
            task, _, req = item
            new = req.config.max_new_tokens
            if (task.done or new > LANE_NEW_TOKENS or mid_layer(eng, req) not in (None, main)
                    or req.k > self.config.max_rows):  # the last is refused at the tick's admission (_over_max_rows)
                continue
            if rows + req.k > self.config.max_rows:
                break
            try:
                ids = runner.encode([req.prompt], [new])[0][0]
            except Exception:  # noqa: BLE001 - its own error, reported when the next tick admits it
                continue
            if len(ids) - runner.cached_prefix_len(ids) > limit:
                continue
            if self._max_cells is not None:
                ask = (self.kv.prompt_tokens(len(ids), new), req.k, new)
                if besides + self.lane.cells_after([*joining, ask]) > self._max_cells:
                    break
                joining.append(ask)
            rows += req.k
            group.append(item)
        if group:
            self._join_loop(self.lane, group)

    def lane_owners(self) -> set[int]:
        """The ids of the tasks with a generation running in the lane."""
        lane = self.lane
        return {id(ticket.owner[0]) for loop, ticket in self._inflight.values() if loop is lane and lane is not None}

    def step_lane(self) -> None:
        """One step of the lane's loop (from inside a paused pass, or a tick's decode step)."""
        if self.lane_busy:
            self._step_loop(self.lane)

    def _join(self, loop, group: list) -> list:
        """Generations ``group`` ((task, i, request) each) join ``loop``; one ticket each."""
        specs = [(r.prompt, r.config, r.taps, r.k, r.seed) for _, _, r in group]
        if self.layout == "packed":  # a packed loop prefills queued prompts in its next passes (whole without a budget)
            priority = [task.submitted for task, _, _ in group] if self.prefill_order == "program" else None
            return loop.admit(specs, owners=group, priority=priority)
        join = loop.add if self.config.prefill_budget == WHOLE_PROMPTS else loop.admit
        return join(specs, owners=group)

    def step_budget(self, loop) -> int:
        """The prompt tokens ``loop``'s next step may prefill: ``prefill_budget``, or the smaller
        ``decoding_prefill_budget`` while rows decode (0: whole prompts)."""
        budget, decoding = self.config.prefill_budget, self.config.decoding_prefill_budget
        if budget and decoding and any(not row.final for row in loop.rows):
            return min(budget, decoding)
        return budget

    def decode_step(self) -> None:
        """One decode step of every loop (the lane's last); generations that finished go back to their programs."""
        for loop in list(self.loops.values()):
            if loop.busy:
                self._step_loop(loop)
        self.step_lane()

    def _step_loop(self, loop) -> None:
        """One step of ``loop``; its finished generations go back to their programs, and a failure ends the
        programs of every generation in it (the loop is dropped)."""
        call = self.counters.next_call()
        members = [(ticket.owner[0], ticket) for lp, ticket in self._inflight.values() if lp is loop]
        rows = loop.size
        t0, paused = time.perf_counter(), self.paused_s
        try:
            # the loops take no bound (WHOLE_PROMPTS) as None: every queued prompt whole
            done = loop.step(self.step_budget(loop) or None)
        except Exception as exc:  # the whole loop is lost: its programs end with the error
            if loop is self.lane:
                self.lane = None
            else:
                self.loops = {mid: lp for mid, lp in self.loops.items() if lp is not loop}
            loop.drop()  # its memory back now (an allocation failure's next loop allocates beside it)
            for task, ticket in members:
                self._inflight.pop(id(ticket), None)
                self._streams.pop(id(ticket), None)
                if not task.done:
                    self.delivery.finish(task, error=exc)
            return
        elapsed = time.perf_counter() - t0 - (self.paused_s - paused)  # the pauses' time is the lane's programs'
        self.counters.generated(rows, frozenset(t.method.name for t, _ in members if t.method is not None))
        for task, _ in members:
            task.count_time(call, "generation_s", elapsed)
        if self._streams:
            self._stream_text(loop)
        for ticket in done:
            self._inflight.pop(id(ticket))
            # its complete text goes with the delivery: kept, the entry held the ticket, its task and the client's
            # listener until the next step of some loop (never, on an idle server)
            self._streams.pop(id(ticket), None)
            task, i, req = ticket.owner
            self.delivery.deliver(task, i, req, ticket.result, 0.0)

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
                self.delivery.emit(ticket.owner[0], {"event": "answer", "text": text, "stop": list(req.config.stop),
                                             "done": False})

    def drop_orphans(self, lane_only: bool = False) -> None:
        """Stop the rows of generations whose program has ended (cancelled, timed out or failed elsewhere).
        ``lane_only``: those of the lane only (at a pause: the main loops are inside the paused pass)."""
        stopped = False
        for key, (loop, ticket) in list(self._inflight.items()):
            if ticket.owner[0].done and (not lane_only or loop is self.lane):
                loop.cancel(ticket)
                del self._inflight[key]
                self._streams.pop(key, None)
                stopped = True
        if stopped:  # a loop left with cancelled rows only frees their cache now: no step may come (an idle server)
            for loop in [self.lane] if lane_only else [*self.loops.values(), self.lane]:
                if loop is not None:
                    loop.drop_ended()


def _readable_size(nbytes: float) -> str:
    """A size as a person reads it, in MiB or KiB below one: "0 MiB ... budget of 0 MiB" said nothing below a MiB."""
    mib = nbytes / 2**20
    if mib >= 10:
        return f"{mib:.0f} MiB"
    # below 10 MiB three figures, KiB below one: "needs 0.25 MiB ... more than the budget of 0.25 MiB" hid 258 > 256 KiB
    return f"{mib:.3g} MiB" if mib >= 1 else f"{nbytes / 2**10:.3g} KiB"
