"""The scheduler's settings: :class:`SchedulerConfig` owns their defaults and their validation.

The defaults are those of the library's scheduler (``Method.answer_batch``, ``fastgate ask`` and ``fastgate eval``:
batch throughput). ``fastgate serve`` runs its scheduler with :class:`fastgate.serving.service.ServiceConfig`'s, which
keep cheap requests cheap under load; that class takes these fields' help lines and validation from here. Calls nothing
but :mod:`fastgate.settings` (the fields' metadata) and :mod:`fastgate.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastgate.errors import InputError
from fastgate.settings import setting

__all__ = ["LAYOUTS", "PREFILL_ORDERS", "WHOLE_PROMPTS", "SchedulerConfig"]

LAYOUTS = ("auto", "packed", "padded")
PREFILL_ORDERS = ("program", "arrival")
WHOLE_PROMPTS = 0  # prefill_budget: no per-step bound, each prompt prefilled whole when its generation joins


@dataclass(frozen=True)
class SchedulerConfig:
    """How a :class:`~fastgate.scheduler.Scheduler` batches, admits and bounds generations.

    Attributes:
        max_rows: the most sequences (prompts × samples) decoding at once; more wait for rows to finish (closed
            calls: are split into several calls). Bounds the KV cache (SeaKR's k samples × candidates × questions).
            With a ``kv_budget`` (the service's), one generation of more rows (a request's SeaKR ``samples``) fails
            with :class:`~fastgate.errors.InputError`; without one (the library's batch runs) it runs alone.
        continuous: generations join a running decode loop (None: when the model's cache allows it).
        admit_every: generations join a loop that is decoding every this many steps (at once when it is idle): with
            whole prefills, a larger value batches them (fewer, larger forwards) and keeps the decode moving between
            them; a new generation waits at most this many steps. With a chunked prefill, 1.
        prefill_budget: with the decode loop, the most prompt tokens (rows × columns, padding included) prefilled
            per step, in chunks between decode steps (see :meth:`DecodeLoop.admit`); :data:`WHOLE_PROMPTS` (0): a
            generation's prompt is prefilled whole when it joins.
        decoding_prefill_budget: with a ``prefill_budget``, the most prompt tokens a step while rows are decoding (0:
            ``prefill_budget``): on a CPU a 512-token chunk makes the rows' step ~10x longer, so a short answer
            caught behind a burst of long prompts waits ~10x longer per token; a smaller chunk while rows decode and
            the whole budget when none does (Sarathi-Serve sizes its chunk by the decode step's latency target).
        kv_budget: with the decode loop, the most bytes the running rows' KV cache may take (None: no bound). A
            generation joins only if the cache's worst case with it (every row right-aligned to the widest prompt,
            grown until the longest row ends) fits; otherwise it waits for rows to finish, in arrival order, and a
            generation that cannot fit even alone fails with :class:`~fastgate.errors.InputError`. Buffers never
            take more than the budget as spare. (Closed calls, for sliding-window models, are bounded by
            ``max_rows`` only.)
        layout: ``packed`` (the default where the model allows it, see :func:`fastgate.engine.packed.packable`): each
        step
            is one forward of the decode rows' tokens and the step's prompt chunks, the rows' keys / values in
            fixed store rows written in place; ``padded``: the rows left-padded into one batch, prompts prefilled in
            forwards of their own (:class:`~fastgate.engine.decode.DecodeLoop`, the only layout for sliding-window
            models).
        express_prefill: packed layout only: prompts with at most this many tokens left to prefill go before the
            queue's order, within half a step's budget (0: off). A cheap request's prompt (a closed-book question
            after a cached few-shot prefix: ~10 tokens) then waits for no older request's long prompt; the long
            prompts keep at least half of every step.
        interject: packed layout, fused forward, on a CPU: while at most this many programs are live (those
            submitted since the tick began included), a pass that prefills at least
            :data:`~fastgate.engine.packed.PAUSE_TOKENS` prompt tokens pauses between its layers; there the programs
            submitted since the tick began start, and their generations whose prompts are express
            (``express_prefill``, else 64 tokens left after the cached prefix) and short (at most 32 new tokens) run
            in a loop of their own, up to 0.1 s a pause (what is left goes on at the next pauses and ticks); then the
            pass goes on (0: off). A cheap question arriving while reading prompts prefill then waits for no
            512-token pass (~0.4 s on two cores); a busy server keeps its passes whole, where packing the cheap rows
            into them costs less than passes of their own.
        prefill_order: packed layout only: ``program`` (default) prefills the prompts of the oldest request first,
            so a request's later generations (a RAG prompt after its gate) do not queue behind newer requests' first
            ones; ``arrival``: each prompt in the order its generation was asked for.

    The defaults favour throughput (batch evaluation: ``answer_batch``): every forward pass costs a fixed ~140 ms on
    a 2-core CPU (the weights streamed once) besides ~2 ms a prompt token, so fewer, larger prefills win. A server
    that must keep cheap requests cheap under load uses ``prefill_budget=512, admit_every=1`` (the service's
    default): a prefill then stalls the running rows for at most 512 tokens a step; in the packed layout the chunk
    runs in the decode rows' own forward, so this costs no extra pass (docs/RESULTS.md has both layouts measured).
    """

    # bounds the KV cache of a batch: SeaKR's k samples x candidates x questions fit on a CPU
    max_rows: int = setting(80, "sequences (prompts x samples) per engine call (default: %(default)s)")
    # None: decided by the model (a sliding-window cache cannot take rows into a running loop)
    continuous: bool | None = None
    # batch throughput: whole prefills gathered over 8 steps run as fewer, larger forwards
    admit_every: int = setting(8, "generations join a decoding loop every N steps (at once when idle) (default: "
                                  "%(default)s)")
    # batch throughput: a forward costs a fixed ~140 ms on a CPU, so whole prompts in few passes win
    prefill_budget: int = setting(WHOLE_PROMPTS, "prompt tokens prefilled per decode step, in chunks between steps; "
                                                 "0: whole prompts when they join (default: %(default)s)")
    # batch throughput: the library's loop prefills at its one budget
    decoding_prefill_budget: int = setting(0, "prompt tokens per step while rows decode, below --prefill-budget; "
                                              "0: --prefill-budget (default: %(default)s)")
    # None: a batch call's cache is bounded by max_rows alone
    kv_budget: int | None = None
    # packed where the model allows it: no extra pass for prompt chunks (docs/RESULTS.md)
    layout: str = setting("auto", "packed: each decode step and its prompt chunks run as one forward (Llama / Qwen2 / "
                                  "Mistral); padded: rows left-padded, prompts prefilled in forwards of their own; "
                                  "auto: packed where the model allows it (default: %(default)s)", choices=LAYOUTS)
    # off for batch throughput: every prompt in the queue's order
    express_prefill: int = setting(0, "packed layout: prompts with at most N tokens left prefill first, within half "
                                      "a step's budget; 0: off (default: %(default)s)")
    # off for batch throughput: a pass never pauses (a cheap row packed into the next pass costs less)
    interject: int = setting(0, "packed layout: while at most N programs are live, a long prefill pass pauses between "
                                "layers for new short generations; 0: off (default: %(default)s)")
    # the oldest request first: a RAG prompt after its gate does not queue behind newer requests (closed-loop p95)
    prefill_order: str = setting("program", "packed layout: prefill the oldest request's prompts first (program) or "
                                            "each prompt in the order it was asked for (arrival) (default: "
                                            "%(default)s)", choices=PREFILL_ORDERS)

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise InputError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.admit_every < 1:
            raise InputError(f"admit_every must be >= 1, got {self.admit_every}")
        if self.prefill_budget is None or self.prefill_budget < 0:
            raise InputError(f"prefill_budget must be >= 0 (0: whole prompts), got {self.prefill_budget}")
        if self.decoding_prefill_budget is None or self.decoding_prefill_budget < 0:
            raise InputError(f"decoding_prefill_budget must be >= 0 (0: prefill_budget), got "
                             f"{self.decoding_prefill_budget}")
        if self.decoding_prefill_budget and self.prefill_budget == WHOLE_PROMPTS:
            raise InputError("decoding_prefill_budget needs a prefill_budget (whole prompts have no per-step budget)")
        if self.express_prefill is None or self.express_prefill < 0:
            raise InputError(f"express_prefill must be >= 0 (0: off), got {self.express_prefill}")
        if self.interject is None or self.interject < 0:
            raise InputError(f"interject must be >= 0 (0: off), got {self.interject}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise InputError(f"kv_budget must be >= 1 byte, got {self.kv_budget}")
        if self.layout not in LAYOUTS:
            raise InputError(f"layout must be auto, packed or padded, got {self.layout!r}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise InputError(f"prefill_order must be program or arrival, got {self.prefill_order!r}")
