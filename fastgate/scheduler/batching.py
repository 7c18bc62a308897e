"""The batching table: the pending requests of every program grouped by kind into one batched call each.

Owns the grouping keys (:func:`group_key`: one ``search_batch`` per (retriever, k), one embedding call per encoder,
one score launch per gate kind, one call per batch op, one engine call for generations), the nine runners that make
each group's call and split its result back per request (:func:`split` for a generation batch, :func:`slices` for
the others), and the search for the one request that failed a batched call (the others still run). Calls the engine
(``generate``; ``submit_each`` for a remote engine, whose requests stay in flight across ticks; ``prompt_states``),
the retrievers, the encoders and the gates; the driver (:mod:`fastgate.scheduler.driver`) and admission call
:meth:`BatchingTable.execute`, and each result goes back through the :class:`~fastgate.scheduler.task.Delivery` the
table was given (the driver).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from fastgate.engine.generation import GenerationBatch
from fastgate.engine.protocol import ConcurrentEngine, LLMEngine
from fastgate.errors import InputError
from fastgate.gates.base import GateStep
from fastgate.programs import (
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

if TYPE_CHECKING:
    from fastgate.scheduler.config import SchedulerConfig
    from fastgate.scheduler.task import Counters, Delivery, Task

__all__ = ["IN_FLIGHT", "PHASES", "REMOTE_POLL_S", "RUNNERS", "BatchingTable", "Failed", "group_key", "mid_layer",
           "slices", "split"]

IN_FLIGHT = object()  # a remote engine's request not answered yet (BatchingTable._run_remote): its task waits
REMOTE_POLL_S = 0.01  # a tick with every remote request still in flight waits this long for the first answer

PHASES = {Generate: "generation_s", PromptStates: "generation_s", Search: "retrieval_s",
          SearchVectors: "retrieval_s", PassageVectors: "retrieval_s", Embed: "retrieval_s", Score: "gate_s",
          Decide: "gate_s"}  # the timing each request kind counts under (a Batched request names its own)


class BatchingTable:
    """The :class:`~fastgate.scheduler.Scheduler`'s batched calls: one call per group of requests with equal keys.

    Args:
        engine: the engine generations and prefills run on (a ``remote`` one gets every request at once).
        config: the scheduler's settings (``max_rows`` splits a closed generate call).
        counters: the scheduler's call counters (shared with admission).
        delivery: where results and errors go (the driver).
    """

    def __init__(self, engine: LLMEngine, config: SchedulerConfig, counters: Counters, delivery: Delivery) -> None:
        self.engine = engine
        self.config = config
        self.counters = counters
        self.delivery = delivery
        self._methods: frozenset[str] = frozenset()  # the methods of the call running now (for the counters)
        # a remote engine's generations in flight across ticks, by request (the request kept: its id stays its own)
        self._inflight: dict[int, tuple[Generate, Any]] = {}
        self._whole_group = False  # the call running now has every pending generation (not one retried alone)

    def execute(self, pending: list[tuple[Task, int, Any]]) -> None:
        """Run ``pending`` ((task, slot, request) each) as one call per group; deliver each result to its task."""
        groups: dict[tuple, list[tuple[Task, int, Any]]] = defaultdict(list)
        for item in pending:
            groups[group_key(item[2])].append(item)
        for key, items in groups.items():
            run = RUNNERS[key[0]]
            self.counters.next_call()
            self._methods = frozenset(t.method.name for t, _, _ in items if t.method is not None)
            t0 = time.perf_counter()
            self._whole_group = True
            try:
                outs = run(self, [r for _, _, r in items])
            except Exception as exc:
                if len(items) == 1:
                    self.delivery.finish(items[0][0], error=exc)
                    continue
                for item in items:  # find the request that failed; the others still run
                    self._execute_one(item)
                continue
            finally:
                self._whole_group = False
            elapsed = time.perf_counter() - t0
            for (task, i, req), out in zip(items, outs):
                if out is IN_FLIGHT:  # a remote engine's request not answered yet: its task waits for a later tick
                    continue
                if isinstance(out, Failed):  # that request's own error (a remote engine's request)
                    self.delivery.finish(task, error=out.error)
                    continue
                own = out.timings.get("total_s") if isinstance(out, GenerationBatch) and self.engine.remote else None
                self.delivery.deliver(task, i, req, out, elapsed if own is None else own)  # its own time in flight

    def _execute_one(self, item: tuple[Task, int, Any]) -> None:
        """Run one request alone (after its group's call failed): its error ends its own task only."""
        task, i, req = item
        if task.done:
            return
        self.counters.next_call()
        self._methods = frozenset([task.method.name] if task.method is not None else [])
        t0 = time.perf_counter()
        try:
            (out,) = RUNNERS[group_key(req)[0]](self, [req])
        except Exception as exc:
            self.delivery.finish(task, error=exc)
            return
        if out is IN_FLIGHT:
            return
        if isinstance(out, Failed):
            self.delivery.finish(task, error=out.error)
            return
        self.delivery.deliver(task, i, req, out, time.perf_counter() - t0)


    # ------------------------------------------------------------------ runners: one batched call per group
    def _run_remote(self, reqs: list[Generate]) -> list[GenerationBatch | Failed | object]:
        """A remote engine's generations: the new ones put in flight, each answered one handed back (or its own
        error, ending its question only), the others :data:`IN_FLIGHT` for a later tick, so that a request the
        server is slow to answer holds no other question (it held every question of its tick and of the next ones,
        up to ``--api-timeout``). With nothing answered yet, waits up to :data:`REMOTE_POLL_S` for the first answer
        (a tick that returned at once would spin)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        engine = cast(ConcurrentEngine, self.engine)
        if self._whole_group:  # requests no longer pending (their questions ended or were cancelled): dropped
            asked = {id(r) for r in reqs}
            for key in [k for k in self._inflight if k not in asked]:
                handle = self._inflight.pop(key)[1]
                if not isinstance(handle, BaseException):
                    handle.cancel()
        new = [r for r in reqs if id(r) not in self._inflight]
        if new:
            handles = engine.submit_each([r.prompt for r in new], [r.config for r in new], [r.taps for r in new],
                                         [r.k for r in new], [r.seed for r in new])
            for r, h in zip(new, handles):
                self._inflight[id(r)] = (r, h)
            self.counters.generated(sum(r.k for r in new), self._methods)
        handles = [self._inflight[id(r)][1] for r in reqs]
        if not any(isinstance(h, BaseException) or h.done() for h in handles):
            wait([f for h in handles for f in h.futures], timeout=REMOTE_POLL_S, return_when=FIRST_COMPLETED)
        out: list[GenerationBatch | Failed | object] = []
        for r, h in zip(reqs, handles):
            if isinstance(h, BaseException) or h.done():
                del self._inflight[id(r)]
                result = h if isinstance(h, BaseException) else h.result()
                out.append(Failed(result) if isinstance(result, BaseException) else result)
            else:
                out.append(IN_FLIGHT)
        return out

    def _run_generate(self, reqs: list[Generate]) -> list[GenerationBatch]:
        if self.engine.remote:
            return self._run_remote(reqs)  # type: ignore[return-value]
        out: list[GenerationBatch | None] = [None] * len(reqs)
        # rows asking for pre-answer / EOS states must share their layer; others join any call
        mid_of = [mid_layer(self.engine, r) for r in reqs]
        mids = list(dict.fromkeys(m for m in mid_of if m is not None)) or [None]
        for mid in mids:
            idx = [i for i, m in enumerate(mid_of) if m == mid or (m is None and mid == mids[0])]
            calls, rows = [[]], 0
            for i in idx:
                if calls[-1] and rows + reqs[i].k > self.config.max_rows:
                    calls.append([])
                    rows = 0
                calls[-1].append(i)
                rows += reqs[i].k
            for call in calls:
                sub = [reqs[i] for i in call]
                batch = self.engine.generate([r.prompt for r in sub], [r.config for r in sub], [r.taps for r in sub],
                                             [r.k for r in sub], [r.seed for r in sub])
                self.counters.generated(len(batch.sequences), self._methods)
                for i, part in zip(call, split(batch, sub)):
                    out[i] = part
        return out  # type: ignore[return-value]

    def _run_prompt_states(self, reqs: list[PromptStates]) -> list[torch.Tensor]:
        prompts = [p for r in reqs for p in r.prompts]
        states = self.engine.prompt_states(prompts, reqs[0].layer)  # [Σ n_i, d]
        return slices(states, [len(r.prompts) for r in reqs])

    def _run_search(self, reqs: list[Search]) -> list[list[list[Hit]]]:
        hits = reqs[0].retriever.search_batch([q for r in reqs for q in r.queries], reqs[0].k)
        return slices(hits, [len(r.queries) for r in reqs])

    def _run_search_vectors(self, reqs: list[SearchVectors]) -> list[list[list[Hit]]]:
        vecs = np.concatenate([np.asarray(r.vectors, dtype=np.float32).reshape(-1, np.shape(r.vectors)[-1])
                               for r in reqs])
        hits = reqs[0].retriever.search_vectors(vecs, reqs[0].k)
        return slices(hits, [len(r.vectors) for r in reqs])

    def _run_passage_vectors(self, reqs: list[PassageVectors]) -> list[np.ndarray]:
        hits = [h for r in reqs for h in r.hits]
        vecs = reqs[0].retriever.passage_vectors(hits) if hits else np.zeros((0, 1), dtype=np.float32)
        return slices(vecs, [len(r.hits) for r in reqs])

    def _run_embed(self, reqs: list[Embed]) -> list[np.ndarray]:
        texts = [t for r in reqs for t in r.texts]
        return slices(reqs[0].encode(texts), [len(r.texts) for r in reqs])

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
class Failed:
    """A runner's result for one request that failed alone (the others of its call are delivered)."""

    error: BaseException


RUNNERS: dict[str, Callable[[BatchingTable, list], list]] = {
    "generate": BatchingTable._run_generate,
    "prompt_states": BatchingTable._run_prompt_states,
    "search": BatchingTable._run_search,
    "search_vectors": BatchingTable._run_search_vectors,
    "passage_vectors": BatchingTable._run_passage_vectors,
    "embed": BatchingTable._run_embed,
    "score": BatchingTable._run_score,
    "decide": BatchingTable._run_decide,
    "batched": BatchingTable._run_batched,
}


def group_key(req: Any) -> tuple:
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


def mid_layer(engine: LLMEngine, req: Generate) -> int | None:
    """The layer of the pre-answer / EOS states ``req`` asks for (rows asking for them share one); None: none."""
    t = req.taps
    if not (t.pre_answer or t.eos_state):
        return None
    return t.mid_layer if t.mid_layer is not None else engine.n_layers // 2


def slices(values, sizes: list[int]) -> list:
    """``values`` cut into consecutive parts of ``sizes`` (one per request of a batched call)."""
    out, pos = [], 0
    for n in sizes:
        out.append(values[pos:pos + n])
        pos += n
    return out


def split(batch: GenerationBatch, reqs: list[Generate]) -> list[GenerationBatch]:
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
