"""The decode loop: sequences join it at any step and leave it at the step they finish.

:meth:`Engine.generate <fastgate.engine.local.Engine.generate>` runs one loop from a single admission to its end (a
closed batch). The scheduler keeps one loop running and admits the generations its programs ask for between steps, so a
question never waits for another question's generation to end. A loop owns its rows (tokens, states, running sums)
and the choice of their tokens; it runs the model through the public API of a
:class:`~fastgate.engine.model_runner.ModelRunner`
and never imports the engine.

Why our own loop rather than ``transformers.generation.continuous_batching``: the gates need, per row, running sums of
chosen layers' hidden states, the pre-answer state, a forced EOS step after a sample stops, k samples forked from one
prefill and a generator per sampled row (so that draws never depend on the batch); HF's loop exposes none of them.

Rows that join are prefilled on their own, either whole at admission (:meth:`DecodeLoop.add`) or in chunks of columns
between decode steps under a per-step token budget (:meth:`DecodeLoop.admit`, the service's way, as Sarathi and vLLM
do: one 500-token prompt then never stalls the running rows for its whole prefill, and the prefill with the fewest
tokens left goes first, so a short prompt is not held behind long ones). In this padded layout a chunk runs as its
own forward pass; :class:`fastgate.engine.packed.PackedLoop` (the scheduler's default where the model allows it) runs
the chunks in the decode rows' pass, as Sarathi does, with attention over ragged rows. Prefilled rows are written after
the loop's rows, left-padded to its width (positions come from the attention mask, so padding changes nothing), in place
when the cache's buffers have room (:class:`~fastgate.engine.kv_cache.GrowingLayer`). Finished rows leave when half the
loop has finished, or when rows join and a copy is due anyway; columns that are padding for every row are trimmed
then (one copy of the cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.generation import FinishReason, Generation, GenerationBatch, RowState
from fastgate.engine.kv_cache import GrowingLayer, cache_bytes, new_cache, plain_layers
from fastgate.engine.model_runner import ModelRunner, runner_of
from fastgate.ops.threads import serial_torch

__all__ = ["DecodeLoop", "Ticket", "mergeable", "process_logits"]


def mergeable(engine) -> bool:
    """Whether rows of ``engine``'s model (an engine's or a runner's) can join a running loop: every cache layer is a
    plain growing layer (a sliding-window layer keeps only its window, so caches of different lengths cannot be
    aligned by padding)."""
    return plain_layers(new_cache(engine.model.config))


def process_logits(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as HF's sampling processors do. ``logits [N, V]`` float32.

    With top-k set, top-p only needs the k survivors: every other token already has probability 0, so it sorts k
    values per row instead of the whole vocabulary (a sort of 96 × 49k logits costs ~0.3 s a step on a 2-core CPU).
    Rows whose k-th value is tied fall back to the full sort, which keeps HF's ties exactly.
    """
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    if cfg.top_k > 0:
        k = min(cfg.top_k, logits.shape[-1])
        top_vals, top_idx = torch.topk(logits, k, dim=-1)  # [N, k], descending
        kth = top_vals[:, -1:]
        keep = logits >= kth  # [N, V]; HF removes what is below the k-th value, so ties at it survive
        if cfg.top_p < 1.0 and bool((keep.sum(-1) == k).all()):
            asc = top_vals.flip(-1)  # [N, k] ascending, as HF sorts
            remove_asc = asc.softmax(-1).cumsum(-1) <= (1 - cfg.top_p)
            remove_asc[:, -1] = False  # keep at least the most likely token
            kept = top_vals.masked_fill(remove_asc.flip(-1), float("-inf"))  # [N, k], back in descending order
            return torch.full_like(logits, float("-inf")).scatter_(1, top_idx, kept)
        logits = logits.masked_fill(~keep, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)  # [N, V]
        remove_sorted = cum <= (1 - cfg.top_p)
        remove_sorted[:, -1] = False  # keep at least the most likely token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits



@dataclass(eq=False)
class _Row:
    """One sequence of the loop."""

    ticket: Ticket
    cfg: GenerationConfig
    taps: TapSpec
    gen: torch.Generator | None  # its own sampling generator (None: the loop's shared one)
    prompt_len: int
    truncated: bool
    state: RowState = RowState.ACTIVE
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    text: str = ""
    answer_len: int = 0
    reason: FinishReason = "length"
    stop: str | None = None
    pre_answer: torch.Tensor | None = None  # [d] float32
    eos_state: torch.Tensor | None = None  # [d] float32
    top: list[list[tuple[int, float]]] | None = None  # each step's most likely tokens (cfg.top_logprobs > 0)
    sums: torch.Tensor | None = None  # [L_ticket, d] float32, set when the row finishes
    count: float = 0.0
    final: bool = False  # finished and its results taken: it may leave the loop


class Ticket:
    """One admitted generation (its rows: the k samples of one prompt, or a whole closed batch); ``result`` is set at
    the step its last row finishes."""

    def __init__(self, owner: Any, layers: tuple[int, ...], pre_answer: bool, eos_state: bool) -> None:
        self.owner = owner
        self.layers = layers
        self.want_pre = pre_answer
        self.want_eos = eos_state
        self.rows: list[_Row] = []
        self.result: GenerationBatch | None = None
        self.cancelled = False
        self.forwards = 0
        self.prefill_s = 0.0
        self.taps_s = 0.0
        self.t_start = time.perf_counter()
        self.t_prefilled = self.t_start


@dataclass(frozen=True)
class _Spec:
    prompt: str
    config: GenerationConfig
    taps: TapSpec
    k: int
    seed: int | None


@dataclass(eq=False)
class _Prefill:
    """Prompts being prefilled a chunk of columns at a time (rows of similar length, left-padded together)."""

    specs: list[_Spec]
    tickets: list[Ticket]
    rows: list[list[int]]
    truncated: list[bool]
    cache: Any = None
    ids: torch.Tensor | None = None  # [N, S] the rows' own tokens after the shared prefix, left-padded
    mask: torch.Tensor | None = None  # [N, P + S]
    prefix: int = 0  # P: columns copied from the prefix cache
    done: int = 0  # columns of ``ids`` prefilled so far

    @property
    def left(self) -> int:
        """Tokens (rows × columns) still to prefill."""
        width = self.ids.shape[1] if self.ids is not None else max(len(r) for r in self.rows)
        return len(self.rows) * (width - self.done)

    def start(self, runner: ModelRunner) -> None:
        """The cache, with the shared prefix's keys / values copied in, and the padded ids and mask."""
        prefix = runner.shared_prefix(self.rows)
        n = len(self.rows)
        self.cache = runner.new_cache(max_cells=n * max(len(r) for r in self.rows))  # no spare
        self.prefix = 0 if prefix is None else len(prefix)
        if prefix is not None:
            runner.prefix_hits += n
        self.ids, self.mask = runner.prefix_inputs(self.rows, prefix, self.cache)


class DecodeLoop:
    """Rows of many generations decoding together, one step at a time.

    Args:
        runner: the :class:`~fastgate.engine.model_runner.ModelRunner` whose passes it runs (or an
            :class:`~fastgate.engine.local.Engine`: its runner).
        mid: the layer of the pre-answer / EOS states (rows asking for them at another layer need another loop).
        shared_rng: sampled rows without a seed draw from one generator for the whole batch (``generate`` with one
            config and no seeds: the draws then depend on the batch, as before); such a loop never drops rows, so
            the random stream stays the one a closed batch consumes.
        generator: that shared generator (None: torch's global one).
        max_cells: the most rows × columns the loop's cache buffers take, spare included (None: no bound); keeping
            the rows' needs within it is the caller's admission control (:meth:`cells_after`).
    """

    def __init__(self, runner, mid: int, shared_rng: bool = False, generator: torch.Generator | None = None,
                 max_cells: int | None = None) -> None:
        self.runner = runner_of(runner)
        self.max_cells = max_cells
        self.mid = mid
        self.shared_rng = shared_rng
        self.generator = generator
        self.rows: list[_Row] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # [M, T] 1 where a row attends
        self.logits: torch.Tensor | None = None  # [M, V] float32, each row's next-token logits
        self.layers: tuple[int, ...] = ()  # the tapped layers summed for every row (the union of the rows' asks)
        self.running: torch.Tensor | None = None  # [M, L, d] float32
        self.count: torch.Tensor | None = None  # [M] float32
        self.prefilling: list[_Prefill] = []  # admitted prompts whose prefill has not ended (see admit)

    def drop(self) -> None:
        """Let go of every row and buffer (a loop a failure ended: its generations are lost). Its memory goes back
        now, not when the garbage collector breaks the cycles a scheduler's loop is part of: after an allocation
        failure the next loop allocates beside it."""
        self.rows, self.prefilling = [], []
        self.cache = self.mask = self.logits = self.running = self.count = None

    # ------------------------------------------------------------------ state
    @property
    def size(self) -> int:
        """Rows not finished yet, those still prefilling included (the rows a new admission competes with)."""
        return sum(not r.final for r in self.rows) + sum(s.k for job in self.prefilling for s in job.specs)

    @property
    def busy(self) -> bool:
        return bool(self.prefilling) or any(not r.final for r in self.rows)

    @property
    def kv_bytes(self) -> int:
        """Bytes the loop's KV caches hold now (the running rows' buffers and the prefills'), spare included."""
        return cache_bytes(self.cache) + sum(cache_bytes(job.cache) for job in list(self.prefilling))

    def cells_after(self, joining: list[tuple[int, int, int]] = ()) -> int:
        """The most rows × columns the cache can reach if generations ``joining`` ((prompt tokens, rows, new tokens)
        each) join now and nothing else does: every row right-aligned to the widest prompt, the width growing until
        the row with the most steps left ends (a forced EOS and a flush step included), and never less than the
        running rows' buffers hold now; plus the prefills' own caches (the queued and the joining prompts)."""
        kv = self.runner.kv
        live = [r for r in self.rows if not r.final]
        width = self.mask.shape[1] if live else 0
        steps = [kv.steps_left(r.cfg.max_new_tokens, len(r.tokens)) for r in live]
        prompts = self._prefilling_cells()  # the prefills' own caches, beside the running rows' until they join
        for job in self.prefilling:
            width = max(width, max(len(r) for r in job.rows))
            steps += [kv.steps_left(s.config.max_new_tokens) for s in job.specs]
        for prompt, _, new in joining:
            width = max(width, prompt)
            steps.append(kv.steps_left(new))
            prompts += prompt
        # finished rows keep their place in the buffers until a step selects them out, which a join may precede
        rows = len(self.rows) + sum(s.k for job in self.prefilling for s in job.specs)
        need = (rows + sum(k for _, k, _ in joining)) * (width + max(steps, default=0))
        # the running rows' buffers keep the spare they grew to until the rows join or end: a join charged its need
        # alone while a prefill ran beside them went past the budget (1,435 of 1,245 cells)
        held = cache_bytes(self.cache) // kv.cell_bytes if self.cache is not None else 0
        return max(held, need) + prompts

    # ------------------------------------------------------------------ admission
    @torch.inference_mode()
    def add(self, specs: list[_Spec] | list[tuple], owners: list[Any] | None = None, one_ticket: Any = None,
            per_row: bool = True) -> list[Ticket]:
        """Prefill ``specs`` (prompt, config, taps, k, seed) now, whole, and add their rows; one :class:`Ticket` per
        spec, or one for all of them when ``one_ticket`` is a (layers, pre_answer, eos_state) triple (``generate``)."""
        eng = self.runner
        specs = [s if isinstance(s, _Spec) else _Spec(*s) for s in specs]
        t0 = time.perf_counter()
        rows, truncated = eng.encode([s.prompt for s in specs], [s.config.max_new_tokens for s in specs])
        want_pre = any(s.taps.pre_answer for s in specs)
        if eng.prefix_cache:
            eng.shared_prefix(rows)  # computes a new shared prefix's cache now, before the taps' hooks exist
        tickets, owner_ticket = self._tickets(specs, owners, one_ticket)
        cache = eng.new_cache(max_cells=self.max_cells)
        hooks = eng.taps((self.mid,)) if want_pre else None
        try:
            logits, mask = eng.prefill(rows, cache, chunked=not want_pre)  # [B, V], [B, T]
            pre_answer = hooks.outputs[self.mid][:, -1, :].to(torch.float32) if hooks is not None else None  # [B, d]
        finally:
            if hooks is not None:
                hooks.close()
        for t in tickets:
            t.t_start = t0
        self._enter(specs, [tickets[i] for i in owner_ticket], rows, truncated, cache, mask, logits, pre_answer,
                    per_row)
        return tickets

    def admit(self, specs: list[_Spec] | list[tuple], owners: list[Any] | None = None) -> list[Ticket]:
        """Queue ``specs`` for a chunked prefill: :meth:`step` prefills at most its token budget of them per step
        (shortest first) before decoding, and their rows join the loop at the step their prefill ends. One
        :class:`Ticket` per spec. Prompts are encoded (and checked) now: a bad prompt raises here."""
        eng = self.runner
        specs = [s if isinstance(s, _Spec) else _Spec(*s) for s in specs]
        rows, truncated = eng.encode([s.prompt for s in specs], [s.config.max_new_tokens for s in specs])
        tickets, _ = self._tickets(specs, owners, None)
        for idx in eng.prefill_chunks([len(r) for r in rows]):  # rows of similar length prefill together
            self.prefilling.append(_Prefill([specs[i] for i in idx], [tickets[i] for i in idx], [rows[i] for i in idx],
                                            [truncated[i] for i in idx]))
        self._cap()
        return tickets

    def _prefilling_cells(self) -> int:
        """The cells the queued prefills' own caches take: each job's rows at its longest prompt."""
        return sum(len(job.rows) * max(len(r) for r in job.rows) for job in self.prefilling)

    def _cap(self) -> None:
        """Bound the spare of the loop's buffers by ``max_cells`` less what the queued prefills' caches may take, so
        that the loop and its prefills together stay within it."""
        if self.max_cells is None or self.cache is None:
            return
        held = self._prefilling_cells()
        for layer in self.cache.layers:
            if hasattr(layer, "max_cells"):
                layer.max_cells = max(1, self.max_cells - held)

    def _tickets(self, specs: list[_Spec], owners, one_ticket) -> tuple[list[Ticket], list[int]]:
        if one_ticket is not None:
            layers, pre, eos = one_ticket
            return [Ticket(owners[0] if owners else None, layers, pre, eos)], [0] * len(specs)
        return [Ticket(owners[i] if owners else None, tuple(s.taps.layers), s.taps.pre_answer, s.taps.eos_state)
                for i, s in enumerate(specs)], list(range(len(specs)))

    def _enter(self, specs: list[_Spec], tickets: list[Ticket], rows: list[list[int]], truncated: list[bool], cache,
               mask, logits, pre_answer, per_row: bool = True) -> None:
        """Fork the k samples of each prefilled prompt (``tickets[p]`` is prompt p's) and join their rows."""
        eng = self.runner
        b = len(specs)
        owner = [p for p in range(b) for _ in range(specs[p].k)]
        if len(owner) != b:
            if all(s.k == specs[0].k for s in specs):
                cache.batch_repeat_interleave(specs[0].k)
            else:
                cache.batch_select_indices(torch.tensor(owner, device=eng.device))
            index = torch.tensor(owner, device=eng.device)
            logits, mask = logits[index], mask[index]
            pre_answer = pre_answer[index] if pre_answer is not None else None
        new_rows, layers, running, count = self._new_rows(specs, tickets, rows, truncated, pre_answer, per_row)
        self._join(new_rows, cache, mask, logits, layers, running, count)

    def _new_rows(self, specs: list[_Spec], tickets: list[Ticket], rows: list[list[int]], truncated: list[bool],
                  pre_answer, per_row: bool = True) -> tuple[list[_Row], tuple[int, ...], Any, torch.Tensor]:
        """The rows of prefilled prompts ``specs`` (k samples each, prompt-major, ``pre_answer [N, d]`` already
        forked), each sampled row with its own generator; the loop's tapped layers with theirs, and zeroed running
        sums / counts for them."""
        eng = self.runner
        b = len(specs)
        # sequence i is sample j of prompt owner[i]
        owner = [p for p in range(b) for _ in range(specs[p].k)]
        sample = [j for p in range(b) for j in range(specs[p].k)]
        n = len(owner)
        new_rows = []
        for i in range(n):
            p = owner[i]
            s = specs[p]
            gen = None
            if s.config.do_sample:
                seed = s.seed
                if seed is None and per_row:
                    seed = s.config.seed if s.config.seed is not None else 0
                if seed is not None:
                    gen = torch.Generator(device=eng.device).manual_seed((int(seed) * 1_000_003 + sample[i]) % (2**63))
            row = _Row(tickets[p], s.config, s.taps, gen, len(rows[p]), bool(truncated[p]))
            if pre_answer is not None:
                row.pre_answer = pre_answer[i]
            if tickets[p].cancelled:
                row.state, row.final = RowState.DONE, True
            row.ticket.rows.append(row)
            new_rows.append(row)
        t1 = time.perf_counter()
        for t in tickets:
            t.t_prefilled, t.prefill_s = t1, t1 - t.t_start
        layers = tuple(sorted(set(self.layers) | {x for s in specs for x in s.taps.layers}))
        d = eng.hidden_size
        running = torch.zeros((n, len(layers), d), dtype=torch.float32, device=eng.device) if layers else None
        count = torch.zeros(n, dtype=torch.float32, device=eng.device)
        return new_rows, layers, running, count

    def _prefill_some(self, budget: int | None) -> int:
        """Advance the queued prefills by at most ``budget`` tokens (rows × columns, padding included; None: all of
        them), the prefill with the fewest tokens left first (a short prompt is not held behind long ones); those
        that end join the loop. Returns the tokens run."""
        eng = self.runner
        ran = 0
        while self.prefilling and (budget is None or ran < budget):
            self.prefilling = [job for job in self.prefilling if not all(t.cancelled for t in job.tickets)]
            if not self.prefilling:
                break
            job = min(self.prefilling, key=lambda j: j.left)
            if job.cache is None:
                job.start(eng)
            n = len(job.rows)
            cols = job.ids.shape[1] - job.done
            if budget is not None:
                cols = min(cols, max(1, (budget - ran) // n))
            last = job.done + cols == job.ids.shape[1]
            want_pre = last and any(s.taps.pre_answer for s in job.specs)
            hooks = eng.taps((self.mid,)) if want_pre else None
            try:
                end = job.prefix + job.done + cols
                logits = eng.forward(job.ids[:, job.done:job.done + cols], job.mask[:, :end], job.cache, cols)
                pre_answer = hooks.outputs[self.mid][:, -1, :].to(torch.float32) if hooks is not None else None
            finally:
                if hooks is not None:
                    hooks.close()
            job.done += cols
            ran += n * cols
            if last:
                self.prefilling.remove(job)
                self._cap()
                self._enter(job.specs, job.tickets, job.rows, job.truncated, job.cache, job.mask, logits,
                            pre_answer)
        return ran

    def _join(self, rows: list[_Row], cache, mask, logits, layers, running, count) -> None:
        """Concatenate a prefilled block of rows to the loop. Finished rows are dropped first (a copy of the cache)
        only when they are half the loop or the block does not fit in place anyway; else they stay, masked, until
        the step that finds half the loop finished (joins come often: a copy at each would cost more than the
        finished rows' share of a few decode steps)."""
        if self.rows:
            live = [r for r, row in enumerate(self.rows) if not row.final]
            if len(live) < len(self.rows) and (2 * len(live) <= len(self.rows) or not self._fits(cache, mask)):
                self._select(live)
        if not self.rows:
            self.cache, self.mask = cache, mask
            self._append(rows, logits, layers, running, count)
            self._cap()  # a prefill's cache had no spare; the loop's may have up to its bound
            return
        if not all(hasattr(layer, "join") for layer in self.cache.layers):
            raise RuntimeError("this model's KV cache cannot take rows into a running loop (sliding-window layers): "
                               "give each loop one admission, as Engine.generate does")
        width = max(self.mask.shape[1], mask.shape[1])
        for a, b in zip(self.cache.layers, cache.layers):  # in place when the rows fit (see GrowingLayer.join)
            a.join(b.keys, b.values)
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])  # [M + N, W]
        self._append(rows, logits, layers, running, count)

    def _append(self, rows: list[_Row], logits, layers, running, count) -> None:
        """Add joining rows' logits ``[N, V]``, running sums ``[N, L', d]`` over ``layers`` and counts ``[N]`` after
        the loop's (its cache is the caller's)."""
        if not self.rows:
            self.rows, self.logits, self.layers, self.running, self.count = rows, logits, layers, running, count
            return
        if layers != self.layers:  # the running sums of both blocks laid out over the union of layers
            self.running = self._relayout(self.running, self.layers, layers, len(self.rows))
            self.layers = layers
        self.logits = torch.cat([self.logits, logits])
        if self.layers:
            self.running = torch.cat([self.running, running])
        self.count = torch.cat([self.count, count])
        self.rows = self.rows + rows

    def _fits(self, cache, mask) -> bool:
        """Whether rows with ``cache`` / ``mask`` can be written into the loop's buffers in place (no copy)."""
        layer = self.cache.layers[0]
        return (isinstance(layer, GrowingLayer.cls()) and mask.shape[1] <= self.mask.shape[1]
                and layer.has_room(len(self.rows) + mask.shape[0], self.mask.shape[1]))

    def _relayout(self, running, old: tuple[int, ...], new: tuple[int, ...], m: int):
        out = torch.zeros((m, len(new), self.runner.hidden_size), dtype=torch.float32, device=self.runner.device)
        for j, layer in enumerate(old):
            out[:, new.index(layer)] = running[:, j]
        return out

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in order) and trim the columns that are now padding for every row."""
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.mask, self.logits, self.running, self.count = [], None, None, None, None, None
            self.layers = ()
            return
        idx = torch.tensor(keep, device=self.runner.device)
        self.mask = self.mask[idx]
        self.logits = self.logits[idx]
        if self.running is not None:
            self.running = self.running[idx]
        self.count = self.count[idx]
        self.rows = [self.rows[r] for r in keep]
        if all(hasattr(layer, "select") for layer in self.cache.layers):
            used = self.mask.any(0).nonzero()
            first = int(used[0]) if used.numel() else self.mask.shape[1]  # leading columns no row attends
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.select(idx, first)
        else:  # a sliding-window cache: its columns are not the mask's, so rows only
            self.cache.batch_select_indices(idx)

    def cancel(self, ticket: Ticket) -> None:
        """Stop ``ticket``'s rows: they stop attending at the next step and leave with the finished rows (a
        prefill whose tickets are all cancelled is dropped before its next chunk)."""
        ticket.cancelled = True
        for row in ticket.rows:
            row.state, row.final = RowState.DONE, True

    def drop_ended(self) -> None:
        """Free now what the loop holds for cancelled generations when nothing else runs in it: cancelled rows and
        prefills otherwise leave at the next step, and a scheduler with no live program takes none (a server whose
        last requests timed out kept their cache while idle). An idle loop holds no cache."""
        self._drop_cancelled_prefills()
        if not self.busy:
            self._clear_rows()

    def _drop_cancelled_prefills(self) -> None:
        kept = [job for job in self.prefilling if not all(t.cancelled for t in job.tickets)]
        if len(kept) < len(self.prefilling):
            self.prefilling = kept
            self._cap()  # what the dropped prefills' caches would have taken is the loop's spare again

    def _clear_rows(self) -> None:
        """Every row leaves (all have ended)."""
        self._select([])

    # ------------------------------------------------------------------ decoding
    @torch.inference_mode()
    def step(self, prefill_budget: int | None = None) -> list[Ticket]:
        """One decode iteration: first up to ``prefill_budget`` tokens of the queued prefills (None: all of them;
        see :meth:`admit`), then choose every active row's next token, feed it, read the taps. Returns the tickets
        whose last row finished in it."""
        if self.prefilling:
            self._prefill_some(prefill_budget)
        rows = self.rows
        if not rows:
            return []
        eng = self.runner
        m = len(rows)
        feed, attend, counts_now, capture_eos = self._feeds()
        done = self._finalize([r for r in range(m) if not attend[r]])
        keep = [r for r in range(m) if attend[r]]
        if not keep:
            self._select([])
            return done
        if len(keep) <= m // 2 and not self.shared_rng:
            # Half the rows have finished: they leave, so that the steps left (often one long answer among short
            # ones) run at the batch size still generating. A shared random stream keeps every row (see __init__).
            self._select(keep)
            feed, attend = [feed[r] for r in keep], [attend[r] for r in keep]
            counts_now, capture_eos = [counts_now[r] for r in keep], [capture_eos[r] for r in keep]
            rows = self.rows
        feed_t = torch.tensor(feed, dtype=torch.long, device=eng.device)[:, None]  # [M, 1]
        attend_t = torch.tensor(attend, dtype=self.mask.dtype, device=eng.device)[:, None]  # [M, 1]
        self.mask = torch.cat([self.mask, attend_t], dim=1)
        tap_layers = tuple(sorted(set(self.layers) | ({self.mid} if any(capture_eos) else set())))
        hooks = eng.taps(tap_layers) if tap_layers else None
        try:
            self.logits = eng.forward(feed_t, self.mask, self.cache, 1)  # [M, V]
            t_taps = time.perf_counter()
            self._read_taps(lambda layer: hooks.outputs[layer][:, -1, :], counts_now, capture_eos)
            taps_s = time.perf_counter() - t_taps  # host time; on CUDA the launches are asynchronous
        finally:
            if hooks is not None:
                hooks.close()
        for ticket in {id(row.ticket): row.ticket for row in rows if not row.final}.values():
            ticket.forwards += 1
            ticket.taps_s += taps_s
        done += self._finalize([r for r, row in enumerate(rows) if row.state == RowState.DONE and not row.final])
        if not self.busy:
            self._select([])  # the last rows finished: hold nothing
        return done

    def _feeds(self) -> tuple[list[int], list[int], list[float], list[bool]]:
        """Choose every active row's next token, then what each row feeds this step: its token (attend 1; counted
        in the running sums unless it is a flushed EOS), a forced EOS whose state is read, or nothing (a finished
        row: attend 0). Advances the rows' flush states."""
        eng, rows = self.runner, self.rows
        m = len(rows)
        active = [r for r in range(m) if rows[r].state == RowState.ACTIVE]
        if active:
            self._choose(active)
        feed = [eng.pad_id] * m
        attend = [0] * m
        counts_now = [0.0] * m
        capture_eos = [False] * m
        for r, row in enumerate(rows):
            s = row.state
            if row.final:
                continue
            if s == RowState.ACTIVE:
                feed[r], attend[r], counts_now[r] = row.tokens[-1], 1, 1.0
            elif s == RowState.FLUSH_LAST:
                last = row.tokens[-1]
                feed[r], attend[r] = last, 1
                is_eos = last in eng.eos_id_set
                counts_now[r] = 0.0 if is_eos else 1.0
                if row.taps.eos_state and is_eos:
                    capture_eos[r] = True
                    row.state = RowState.DONE
                else:
                    row.state = RowState.FLUSH_EOS if row.taps.eos_state else RowState.DONE
            elif s == RowState.FLUSH_EOS:
                feed[r], attend[r] = eng.eos_id, 1
                capture_eos[r] = True
                row.state = RowState.DONE
        return feed, attend, counts_now, capture_eos

    def _read_taps(self, state, counts_now: list[float], capture_eos: list[bool]) -> None:
        """Add this step's states (``state(layer) -> [M, d]``) to the rows' running sums and keep the forced EOS
        states."""
        eng = self.runner
        if self.running is not None:
            states = torch.stack([state(layer) for layer in self.layers], dim=1).to(torch.float32)  # [M, L, d]
            weight = torch.tensor(counts_now, dtype=torch.float32, device=eng.device)  # [M]
            eng.accumulate(self.running, states, weight)
            self.count += weight
        if any(capture_eos):
            mid = state(self.mid)  # [M, d]
            for r, row in enumerate(self.rows):
                if capture_eos[r]:
                    row.eos_state = mid[r].to(torch.float32)

    def _choose(self, active: list[int]) -> None:
        """Choose the next token of every active row (greedy or sampled with its settings) and record it."""
        with serial_torch(self.logits, len(self.rows)):  # few rows: torch's threads would spin beside the kernels
            self._choose_rows(active)
            self._record_top(active)

    def _record_top(self, active: list[int]) -> None:
        """Each active row that asks (``top_logprobs``): the most likely tokens of this step and their log-probs,
        from the logits its token was chosen from. Why here: a second forward over prompt and answer after the
        generation (what plain completions ran) took seconds of the scheduler's thread for a long prompt, outside
        the prefill budget, and stalled every other request."""
        rows = self.rows
        asking = [r for r in active if rows[r].cfg.top_logprobs]
        if not asking:
            return
        idx = torch.tensor(asking, device=self.logits.device)
        lp = torch.log_softmax(self.logits.index_select(0, idx), dim=-1)  # [A, V]: token_logprobs' own values
        vals, ids = lp.topk(min(max(rows[r].cfg.top_logprobs for r in asking), lp.shape[-1]), dim=-1)  # [A, n]
        for r, v, i in zip(asking, vals.tolist(), ids.tolist()):
            row = rows[r]
            n = row.cfg.top_logprobs
            if row.top is None:
                row.top = []
            row.top.append(list(zip(i[:n], v[:n])))

    def _choose_rows(self, active: list[int]) -> None:
        eng, rows, logits = self.runner, self.rows, self.logits
        m = len(rows)
        # rows that sample with the same settings are processed together (row-wise ops: identical per row)
        groups: dict[tuple, list[int]] = {}
        for r in (range(m) if self.shared_rng else active):
            c = rows[r].cfg
            if c.do_sample:
                groups.setdefault((c.temperature, c.top_k, c.top_p), []).append(r)
        if not groups:  # every row greedy: the argmax and its log-prob in one op (log_softmax's bits)
            self._record(active, *eng.ops.token_logprobs(logits))
            return
        greedy = any(not rows[r].cfg.do_sample for r in range(m))
        chosen = logits.argmax(-1) if greedy else torch.zeros(m, dtype=torch.long, device=eng.device)  # [M]
        is_active = set(active)
        for rows_g in groups.values():
            live = [r for r in rows_g if r in is_active]
            if not live:
                continue
            whole = len(rows_g) == m
            sub = logits if whole else logits[torch.tensor(rows_g, device=eng.device)]
            probs = process_logits(sub, rows[rows_g[0]].cfg).softmax(-1)  # [G, V]
            if self.shared_rng and whole and all(rows[r].gen is None for r in live):
                chosen = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)  # [M]
                continue
            pos = {r: j for j, r in enumerate(rows_g)}
            for r in live:
                gen = rows[r].gen if rows[r].gen is not None else self.generator
                chosen[r] = torch.multinomial(probs[pos[r]], 1, generator=gen)[0]
        self._record(active, *eng.ops.token_logprobs(logits, chosen))

    def _record(self, active: list[int], chosen: torch.Tensor, chosen_lp: torch.Tensor) -> None:
        """Append each active row's token ``chosen [M]`` and its log-prob ``chosen_lp [M]``."""
        rows = self.rows
        chosen_l, chosen_lp_l = chosen.tolist(), chosen_lp.tolist()
        for r in active:
            row = rows[r]
            row.tokens.append(chosen_l[r])
            row.logps.append(chosen_lp_l[r])
            self._update_finish(row)

    def _update_finish(self, row: _Row) -> None:
        """Record the row's new token and move it out of ACTIVE if it stops."""
        eng, cfg, tokens = self.runner, row.cfg, row.tokens
        finished: FinishReason | None = None
        if cfg.stop_at_eos and tokens[-1] in eng.eos_id_set:
            finished = "eos"
            row.text = eng.tokenizer.decode(tokens[:-1], skip_special_tokens=True)
            row.answer_len = len(tokens) - 1
        else:
            if not cfg.stop and len(tokens) < cfg.max_new_tokens:
                # no stop strings to look for: the text is read only when the row ends (a decode of the whole answer
                # each step costs O(its length): 0.12 ms at 60 tokens in a batch-1 step on a 2-core CPU)
                return
            text = eng.tokenizer.decode(tokens, skip_special_tokens=True)
            cut, matched = -1, None
            for s in cfg.stop:
                pos = text.find(s)
                if pos >= 0 and (cut < 0 or pos < cut):
                    cut, matched = pos, s
            if cut >= 0:
                finished = "stop"
                row.stop = matched
                row.text = text[:cut]
                row.answer_len = eng.tokens_before(tokens, cut)
            else:
                row.text, row.answer_len = text, len(tokens)
                if len(tokens) >= cfg.max_new_tokens:
                    finished = "length"
        if finished is not None:
            row.reason = finished
            row.state = RowState.FLUSH_LAST if row.taps.needs_flush else RowState.DONE

    def _finalize(self, finished: list[int]) -> list[Ticket]:
        """Take the results of rows ``finished`` (done, their taps complete); the tickets this completes."""
        done = []
        col = {layer: j for j, layer in enumerate(self.layers)}
        for r in finished:
            row = self.rows[r]
            if row.final:
                continue
            row.final = True
            if row.ticket.layers:
                cols = torch.tensor([col[x] for x in row.ticket.layers], device=self.runner.device)
                row.sums = self.running[r].index_select(0, cols)  # [L_ticket, d]
            row.count = float(self.count[r])
            ticket = row.ticket
            if not ticket.cancelled and ticket.result is None and all(x.final for x in ticket.rows):
                ticket.result = self._result(ticket)
                done.append(ticket)
        return done

    def _result(self, ticket: Ticket) -> GenerationBatch:
        rows, dev = ticket.rows, self.runner.device
        d = self.runner.hidden_size
        t_end = time.perf_counter()
        return GenerationBatch(
            sequences=[Generation(text=r.text, token_ids=r.tokens, token_logprobs=r.logps, answer_tokens=r.answer_len,
                                  finish_reason=r.reason, prompt_tokens=r.prompt_len, truncated=r.truncated,
                                  stop_string=r.stop, top_logprobs=r.top) for r in rows],
            running_sum=torch.stack([r.sums for r in rows]) if ticket.layers else None,  # [k, L, d]
            count=torch.tensor([r.count for r in rows], dtype=torch.float32, device=dev) if ticket.layers else None,
            pre_answer=torch.stack([r.pre_answer for r in rows]) if ticket.want_pre else None,  # [k, d]
            eos_state=torch.stack([r.eos_state if r.eos_state is not None else torch.zeros(d, device=dev)
                                   for r in rows]) if ticket.want_eos else None,  # [k, d]
            layers=ticket.layers,
            steps=max((len(r.tokens) for r in rows), default=0),
            forwards=ticket.forwards,
            timings={"prefill_s": ticket.prefill_s, "decode_s": t_end - ticket.t_prefilled,
                     "total_s": t_end - ticket.t_start, "taps_s": ticket.taps_s},
        )


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask [M, T]`` left-padded with zeros to ``[M, width]``."""
    return mask if mask.shape[1] == width else F.pad(mask, (width - mask.shape[1], 0))
