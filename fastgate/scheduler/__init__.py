"""One scheduler for every question: runs many per-question programs (:mod:`fastgate.programs`) together.

Each :meth:`Scheduler.step` (a tick) admits the programs submitted since the last one, advances every program until
it waits on a request, groups the pending requests by kind and runs each group as one batched call: one
``search_batch`` per (retriever, k), one embedding call per encoder, one score launch per gate kind, one call per
batch op. Generations join one running :class:`~fastgate.engine.decode.DecodeLoop` (rows may differ in decoding
settings, taps, sample counts and seeds) and each tick runs one decode step of it: a generation that finishes goes back
to its program at that step, and a new one joins at the next (its prompt prefilled in chunks between decode steps, at
most ``prefill_budget`` tokens a step, within the ``kv_budget``), so no question waits for another's generation to end.
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


The package in its parts, each saying in its docstring what it owns and whom it calls:

- :mod:`~fastgate.scheduler.driver`: :class:`Scheduler`, the program driver (submit, tick, advance, deliver, end);
- :mod:`~fastgate.scheduler.batching`: the batching table (grouping keys and the nine batched runners);
- :mod:`~fastgate.scheduler.admission`: the decode loops, their admission within the KV budget, and the closed calls of
  sliding-window models;
- :mod:`~fastgate.scheduler.config`: :class:`SchedulerConfig`, the settings with their defaults and validation;
- :mod:`~fastgate.scheduler.task`: :class:`Task` and :class:`Trace`, a running program's state.
"""

from __future__ import annotations

from fastgate.scheduler.config import WHOLE_PROMPTS, SchedulerConfig
from fastgate.scheduler.driver import Scheduler
from fastgate.scheduler.task import CancelledError, Task, Trace

__all__ = ["WHOLE_PROMPTS", "CancelledError", "Scheduler", "SchedulerConfig", "Task", "Trace"]
