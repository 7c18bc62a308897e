"""One forward pass for the decode rows and the prompt chunks of a step: tokens of many sequences packed into one row.

A decode step of M rows and a prefill chunk of N prompt tokens used to be two forward passes; on a CPU each pass
costs a fixed ~100 ms beyond its tokens (every module's launch, the weights streamed once), so the chunked prefill
that keeps decode rows moving paid for itself in throughput. Packing the step's M decode tokens and the chunks'
tokens into one ``[1, M + N]`` input runs every linear layer once for all of them (as Sarathi / vLLM's mixed batches
do); only attention differs per sequence, and that is what this module supplies, as an HF attention function
(``AttentionInterface``) switched on for the packed pass only:

* **decode rows** live in :class:`SlotStore`: per layer ``keys / values [rows capacity, kv heads, columns capacity,
  head_dim]``, row r of the store is row r of the loop, written in place at its own column (its length); one SDPA call
  over ``[:M, :, :W]`` with a per-row length mask reads them (no copy of the cache, no left padding);
* **prompt chunks** write into their own prefill buffers (``[1, kv heads, prompt length, head_dim]`` per layer) at
  their offset and attend causally over what is there; when a prompt is prefilled its buffer is copied once into the
  store's rows (k of them for k samples).

Why not transformers' ``continuous_batching`` (paged cache, its own scheduler): the gates' taps, forced-EOS step and
per-row generators need the loop of :mod:`fastgate.engine.decode`; this module only replaces how its forward pass is
laid out. Models whose layers keep a sliding window (Gemma-3) keep the padded layout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fastgate.engine.attention import attention_implementation, sdpa_choice
from fastgate.engine.decode import DecodeLoop, _Spec, mergeable
from fastgate.engine.generation import RowState
from fastgate.engine.kv_cache import within_cells
from fastgate.engine.static_step import batch_bucket, choose, covers, row_key, width_bucket
from fastgate.ops.reference import prefill_attention, prefill_mask
from fastgate.ops.threads import serial_torch

__all__ = ["PAUSE_TOKENS", "PackedPlan", "PrefillSeg", "SegBatch", "SlotStore", "packed_forward"]

_NAME = "fastgate_packed"  # the packed attention function's name in transformers' AttentionInterface
# a pass of fewer prompt tokens does not pause between its layers: it ends soon (a 128-token chunk of SmolLM2 on two
# Zen 4 cores ~0.1 s, a 512-token one ~0.4 s)
PAUSE_TOKENS = 128


class SlotStore:
    """The decode rows' keys / values: per layer ``[rows, kv heads, columns, head_dim]``, grown by reallocation
    (amortised; capacity never shrinks) and bounded by ``max_cells`` rows × columns when the caller asks."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 buckets: bool = False) -> None:
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        # columns grow to width buckets (powers of two) only, for the static step: its graph for a batch bucket then
        # depends on the store's width alone (a view's strides follow the buffer's columns)
        self.buckets = buckets
        self.keys: list[torch.Tensor] = []  # per layer [R, Hkv, C, D]
        self.values: list[torch.Tensor] = []
        self.rows_cap = self.cols_cap = 0

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for k in self.keys)

    def reserve(self, rows: int, cols: int, used_rows: int, used_cols: int, max_cells: int | None = None,
                expect_rows: int = 0) -> None:
        """Room for ``rows`` × ``cols``; the first ``used_rows`` × ``used_cols`` move when the buffers grow. When they
        grow, their rows' spare covers at least ``expect_rows`` (the rows of prompts already queued), within
        ``max_cells``."""
        if rows <= self.rows_cap and cols <= self.cols_cap:
            return
        spare_c = width_bucket(cols) if self.buckets else cols + max(64, cols // 4)
        spare_r = max(rows + max(4, rows // 2), expect_rows)
        new_r, new_c = within_cells(self.rows_cap if rows <= self.rows_cap else spare_r,
                                    self.cols_cap if cols <= self.cols_cap else spare_c, rows, cols, max_cells)
        shape = (new_r, self.kv_heads, new_c, self.head_dim)
        used = used_rows and used_cols
        if used and len(self.keys) != self.n_layers:
            raise RuntimeError("the KV store lost its buffers in a growth that failed (an allocation): its rows "
                               "must be prefilled again in a new store")

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            # every cell written once: the kept rows' columns copied, the rest zeros (zero-filling all, then copying,
            # wrote the kept part twice: a served run's growths took ~2% of its time)
            new = torch.empty(shape, dtype=self.dtype, device=self.device)  # [R', Hkv, C', D]
            if old is None:
                return new.zero_()
            new[:used_rows, :, :used_cols] = old[:used_rows, :, :used_cols]
            new[:used_rows, :, used_cols:].zero_()
            new[used_rows:].zero_()
            return new

        # layer by layer, each old buffer dropped from the old lists once copied: a growth holds the new store and
        # one old layer's buffer, not both stores whole (the budget counts one). New lists: a list's identity says
        # its buffers are unchanged (the C++ decode stack keeps their pointers while the store's lists stay the same
        # objects); the old lists are emptied in place, as whoever keeps them must bind the new ones anyway
        old_keys, old_values = self.keys, self.values
        if not used:  # nothing to copy: the old buffers go before the new ones are made
            old_keys.clear()
            old_values.clear()
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        self.keys, self.values = keys, values
        try:
            for layer in range(self.n_layers):
                keys.append(grown(old_keys[layer] if used else None))
                values.append(grown(old_values[layer] if used else None))
                if used:
                    old_keys[layer] = old_values[layer] = None
        except BaseException:  # an allocation failed midway: the layers differ in shape, nothing of it can be used
            self.release()  # (a later growth that would copy rows says so)
            old_keys.clear()
            old_values.clear()
            raise
        self.rows_cap, self.cols_cap = new_r, new_c

    def release(self) -> None:
        """Let every buffer go, also where another holds the lists (the C++ decode stack keeps the last lists it
        bound): new empty lists, the old ones emptied."""
        old_keys, old_values = self.keys, self.values
        self.keys, self.values, self.rows_cap, self.cols_cap = [], [], 0, 0
        old_keys.clear()
        old_values.clear()

    def write_rows(self, first: int, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int, n: int) -> None:
        """Rows ``first .. first + n - 1`` get the first ``length`` columns of ``kv`` (one sequence's prefill
        buffers ``[1, Hkv, >= length, D]`` per layer). Columns past a row's length keep what an earlier row left
        there: the attention mask gives them weight 0, and the buffers only ever hold finite values."""
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][first:first + n, :, :length] = k[:, :, :length]
            self.values[layer][first:first + n, :, :length] = v[:, :, :length]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row ``src``'s first ``length`` columns into row ``dst`` (a finished row's place)."""
        for layer in range(self.n_layers):
            self.keys[layer][dst, :, :length] = self.keys[layer][src, :, :length]
            self.values[layer][dst, :, :length] = self.values[layer][src, :, :length]


@dataclass(eq=False)
class PrefillSeg:
    """One sequence's chunk in the packed pass: ``n`` tokens at pack offset ``offset``, columns ``start ..
    start + n - 1`` of its prefill buffers ``kv`` (per layer ``[1, Hkv, prompt length, D]``)."""

    offset: int
    n: int
    start: int
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # None: whole fresh prompts batched (SegBatch.kv holds them)
    mask: torch.Tensor | None = None  # [n, start + n] bool, built once per pass (None: plain causal, start == 0)

    def __post_init__(self) -> None:
        if self.kv is not None:
            self.mask = prefill_mask(self.start, self.n, self.kv[0][0].device)


@dataclass(eq=False)
class SegBatch:
    """The pass's prompt chunks as one padded batch for one attention call a layer (fresh prompts only: each chunk
    starts its sequence, so right padding keeps every real query's causal window real). On a GPU each chunk's own
    attention call and copies were ~10 kernel launches a layer and chunk: 16 prompts of a 16 x 700 prefill took 0.24x
    HF's one forward (docs/RESULTS.md); with the call batched, the chunks' buffer copies, allocations and one-by-one
    joins still took 0.48x (3,263 launches against HF's 1,071, bench/profile_step.py). So when every chunk is its
    whole prompt (``kv`` not None), the padded keys / values of each layer are the prompts' only buffers and join the
    store in one copy a layer (:meth:`PackedLoop._enter_batch`); chunks of one length packed end to end (``base`` not
    None) are views of the pass's tensors, no gather."""

    idx: torch.Tensor | None  # [S * L] long: pack position of each padded slot (a padding slot repeats its chunk's
    # last); None with base
    dst: torch.Tensor | None  # [sum n] long: the padded slot of each chunk token, in pack order
    src: torch.Tensor | None  # [sum n] long: its pack position
    rows: int  # S, the chunks
    width: int  # L, the longest chunk
    base: int | None = None  # pack offset of the first chunk when all are L long and back to back (views, no gather)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [S, Hkv, L, D], filled by the pass (whole)

    @classmethod
    def of(cls, segs: list[PrefillSeg], device, whole: bool = False) -> SegBatch:
        """The padded batch of ``segs``; ``whole``: every chunk is its prompt whole, its keys / values kept here."""
        width = max(seg.n for seg in segs)
        kv = [] if whole else None
        first = segs[0].offset
        if all(seg.n == width and seg.offset == first + r * width for r, seg in enumerate(segs)):
            return cls(None, None, None, len(segs), width, first, kv)
        # tensor arithmetic, not Python lists: a 16 x 700 pass's three index lists took ~6 ms of host time on a GPU
        n = torch.tensor([seg.n for seg in segs])  # [S]
        col = torch.arange(width)  # [L]
        idx = (torch.tensor([seg.offset for seg in segs])[:, None]
               + torch.minimum(col[None, :], n[:, None] - 1)).flatten()  # [S * L]
        real = (col[None, :] < n[:, None]).flatten()  # [S * L]: the chunks' own slots
        return cls(idx.to(device), real.nonzero().flatten().to(device), idx[real].to(device), len(segs), width, None,
                   kv)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """``x [1, H, T, D]`` (the pass's queries, keys or values) as the padded batch ``[S, H, L, D]``."""
        heads, dim = x.shape[1], x.shape[3]
        if self.base is not None:
            t = x[0, :, self.base:self.base + self.rows * self.width]  # [H, S * L, D]
        else:
            t = x[0][:, self.idx]  # [H, S * L, D]
        return t.view(heads, self.rows, self.width, dim).transpose(0, 1)  # [S, H, L, D]


@dataclass(eq=False)
class PackedPlan:
    """What the packed pass's attention reads: the first ``m`` tokens are one token of store rows ``0 .. m - 1``,
    written at columns ``pos``; then the prefill segments."""

    store: SlotStore | None
    m: int
    pos: torch.Tensor | None  # [m] long
    width: int  # columns the decode rows attend (max pos + 1)
    mask: torch.Tensor | None  # [m, 1, 1, width] bool (None: built by decode_mask where read)
    segs: list[PrefillSeg] = field(default_factory=list)
    rows: torch.Tensor | None = None  # [m] arange, for the in-place write (None: built by row_index where read)
    attn_dtype: torch.dtype | None = None  # the decode rows' attention computes in this dtype (None: the cache's)
    attend: Callable | None = None  # the decode rows' attention op over a bf16 store (ModelRunner.decode_attention)
    prefill_attend: Callable = prefill_attention  # the chunks' attention op (ModelRunner.ops.prefill_attention)
    seg_batch: SegBatch | None = None  # the chunks as one padded attention call a layer (ModelRunner.batch_prefill)
    pause: Callable[[], None] | None = None  # called between layers of a long pass (PackedLoop.pause; fused pass only)

    def decode_mask(self) -> torch.Tensor:
        """``mask``, built on first use: column ``c`` of decode row ``r`` attended where ``c <= pos[r]``. The C++ decode
        paths never read it, and a batch-1 step's host operations run ~10x slower than alone after its layers stream
        the weights through the caches (docs/RESULTS.md: a step's host time)."""
        if self.mask is None:
            self.mask = (torch.arange(self.width, device=self.pos.device)[None, :]
                         <= self.pos[:, None])[:, None, None, :]  # [m, 1, 1, W]
        return self.mask

    def row_index(self) -> torch.Tensor:
        """``rows`` (``arange(m)``: the decode rows' store rows), built on first use as :meth:`decode_mask` is."""
        if self.rows is None:
            self.rows = torch.arange(self.m, device=self.pos.device)  # [m]
        return self.rows


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function for a packed pass. ``query [1, H, T, D]``, ``key / value [1, Hkv, T, D]`` (RoPE applied
    with each token's own position); returns ``[1, T, H, D]`` as HF's own functions do."""
    plan: PackedPlan = kwargs["fastgate_plan"]
    layer = module.layer_idx
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    out = query.new_empty((query.shape[2], heads, dim))  # [T, H, D]
    m = plan.m
    if m:
        keys, values = plan.store.keys[layer], plan.store.values[layer]  # [R, Hkv, C, D]
        rows = plan.row_index()
        keys[rows, :, plan.pos] = key[0, :, :m].transpose(0, 1)  # [m, Hkv, D] at each row's own column
        values[rows, :, plan.pos] = value[0, :, :m].transpose(0, 1)
        if plan.attend is not None:  # one pass over the bf16 store, float32 inside (fastgate.ops.attention)
            out[:m] = plan.attend(query[0, :, :m].transpose(0, 1), keys, values, plan.pos, scaling)  # [m, H, D]
        else:
            # a key head's query heads as that many query rows of one head: no GQA flag, so no key copies, and on
            # CUDA the memory-efficient kernel takes the mask (with enable_gqa SDPA fell back to its math path there:
            # ~15 small kernels a layer, a third of an eager step's host time; bench/profile_step.py)
            q = query[0, :, :m].transpose(0, 1).reshape(m, kv_heads, heads // kv_heads, dim)  # [m, Hkv, G, D]
            k, v = keys[:m, :, :plan.width], values[:m, :, :plan.width]  # [m, Hkv, W, D]
            if plan.attn_dtype is not None:  # bf16 caches on a CPU: in float32 (ModelRunner.attention_dtype)
                q, k, v = q.to(plan.attn_dtype), k.to(plan.attn_dtype), v.to(plan.attn_dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask(), scale=scaling)  # [m, Hkv, G, D]
            out[:m] = o.reshape(m, heads, dim)
    sb = plan.seg_batch
    segs = getattr(plan.prefill_attend, "segs", None) if sb is None and plan.segs else None
    # every chunk in one call where the op has it (bf16 on a CPU with AVX512-BF16): its buffers' writes too
    if segs is not None and segs(query, key, value, [(s.offset, s.n, s.start, *s.kv[layer]) for s in plan.segs],
                                 scaling, out):
        return out.unsqueeze(0), None
    if sb is None or sb.kv is None:
        for seg in plan.segs:  # each prompt's buffers take the chunk's columns (its later chunks and the store read)
            k_buf, v_buf = seg.kv[layer]  # [1, Hkv, P, D]
            k_buf[:, :, seg.start:seg.start + seg.n] = key[:, :, seg.offset:seg.offset + seg.n]
            v_buf[:, :, seg.start:seg.start + seg.n] = value[:, :, seg.offset:seg.offset + seg.n]
    if sb is not None:  # every chunk starts its prompt: one causal call over the padded batch
        q, k, v = sb.padded(query), sb.padded(key), sb.padded(value)  # [S, H, L, D], [S, Hkv, L, D] x 2
        if sb.kv is not None:  # whole prompts: these are their buffers (the store takes them when the pass ends)
            # views of the pass (base) would keep each layer's whole q/k/v projection alive: 4.5x SmolLM2's keys /
            # values until the pass ends; a gather is already a tensor of its own
            sb.kv.append((k.contiguous(), v.contiguous()) if sb.base is not None else (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                           enable_gqa=heads != kv_heads)  # [S, H, L, D]
        o = o.transpose(1, 2).reshape(sb.rows * sb.width, heads, dim)  # [S * L, H, D]
        if sb.base is not None:
            out[sb.base:sb.base + sb.rows * sb.width] = o
        else:
            out[sb.src] = o[sb.dst]  # [sum n, H, D]
        return out.unsqueeze(0), None
    for seg in plan.segs:
        k_buf, v_buf = seg.kv[layer]  # [1, Hkv, P, D]
        end = seg.start + seg.n
        q = query[:, :, seg.offset:seg.offset + seg.n]  # [1, H, n, D]
        o = plan.prefill_attend(q, k_buf[:, :, :end], v_buf[:, :, :end], seg.start, scaling, seg.mask)  # [1,H,n,D]
        out[seg.offset:seg.offset + seg.n] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def packed_forward(model, ids: torch.Tensor, positions: torch.Tensor, plan: PackedPlan,
                   keep: torch.Tensor) -> torch.Tensor:
    """Run ``ids [T]`` (decode tokens first, then the chunks) at ``positions [T]``; logits ``[len(keep), V]`` of the
    pack positions ``keep`` (float32)."""
    dummy = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=ids.device)  # a 4D mask: HF builds none of its own
    # every layer reads the implementation from the shared config: the packed function for this pass only
    with attention_implementation(model.config, _NAME, _packed_attention):
        out = model(input_ids=ids[None], position_ids=positions[None], attention_mask=dummy, use_cache=False,
                    logits_to_keep=keep, fastgate_plan=plan)
    return out.logits[0].to(torch.float32)  # [K, V]


class _Outputs:
    """The taps' outputs of a fused pass, read as :class:`fastgate.engine.model_runner.Taps` would keep them."""

    def __init__(self, outputs: dict[int, torch.Tensor]) -> None:
        self.outputs = outputs

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- the loop
def packable(engine) -> bool:
    """Whether ``engine``'s model can run packed passes: every cache layer is a plain one (no sliding window) and its
    attention goes through transformers' attention interface with the kwargs passed down (Llama, Qwen2, Mistral,
    SmolLM2)."""
    return mergeable(engine) and getattr(engine.model.config, "model_type", "") in _PACKABLE


_PACKABLE = frozenset({"llama", "qwen2", "mistral"})
WHOLE_PADDING = 1.25  # a pass's whole prompts keep their padded batch as buffers if it is at most this times their size


@dataclass(eq=False)
class _Job:
    """One prompt being prefilled (its k samples fork when it ends)."""

    spec: object  # fastgate.engine.decode._Spec
    ticket: object  # fastgate.engine.decode.Ticket
    ids: list[int]
    truncated: bool
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [1, Hkv, len(ids), D]
    started: bool = False  # its cached prefix looked up (buffers are allocated when a pass first needs them)
    done: int = 0  # columns prefilled (the cached prefix included)
    priority: tuple = ()  # prefill order: lower first (the caller's key, then arrival)
    cached: int = 0  # before it starts: the cached prefix it would start from (ModelRunner.cached_prefix_len)

    @property
    def specs(self) -> list:
        return [self.spec]

    @property
    def left(self) -> int:
        """Prompt tokens still to run: a queued prompt's own tokens after the cached prefix it will start from (a
        closed-book question after the cached few-shot block is ~10 tokens of its ~80, and goes express)."""
        return len(self.ids) - (self.done if self.started else self.cached)


class PackedLoop(DecodeLoop):
    """A :class:`~fastgate.engine.decode.DecodeLoop` whose every step is one packed pass: the decode rows' tokens and
    up to the step's prefill budget of prompt tokens (prompts by the caller's priority, then arrival). Rows keep
    store rows 0 .. M-1 in loop order; a finished row's place is taken by the last row (one row's copy)."""

    def __init__(self, runner, mid: int, max_cells: int | None = None, express_prefill: int = 0, **kwargs) -> None:
        if kwargs.get("shared_rng"):
            raise ValueError("a packed loop moves rows when others finish: it cannot keep a shared random stream")
        super().__init__(runner, mid, max_cells=max_cells)
        self.store = self._new_store()
        self.lens: list[int] = []  # columns each row holds in the store
        self._arrivals = 0  # admissions so far: the tie-break of equal priorities
        # prompts with at most this many tokens left go first in a budgeted step, within half its budget (0: off;
        # fastgate.scheduler.SchedulerConfig.express_prefill)
        self.express_prefill = express_prefill
        # the static step (None: every pass eager). With it, the running sums keep every layer (the graph never
        # depends on the rows' asks) and every row's token is chosen by fastgate.engine.static_step.choose, in the step
        # or, for logits from an eager pass, eagerly: the same draw whichever pass made the logits
        self.static = self.runner.static_step(mid)
        self.chosen: tuple[torch.Tensor, torch.Tensor] | None = None  # [M] tokens, [M] log-probs from the step
        self._bufs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # bucket -> running, count, eos
        self.static_steps = 0  # passes run by the static step (for tests and stats)
        # called between the layers of a pass of at least PAUSE_TOKENS prompt tokens (the fused forward only), where
        # nothing of the pass is in flight: the scheduler serves a new cheap request there in a loop of its own
        # (fastgate.scheduler.SchedulerConfig.interject); None: passes run through
        self.pause: Callable[[], None] | None = None
        # the cells the scheduler's other loops hold (its admission counts every loop against one budget): the store's
        # spare leaves room for them (None: this loop is the budget's only user)
        self.held_elsewhere: Callable[[], int] | None = None

    def _new_store(self) -> SlotStore:
        """An empty store for the runner's model (rows and columns are reserved as rows join)."""
        r = self.runner
        return SlotStore(r.n_layers, r.kv_heads, r.head_dim, r.dtype, r.device,
                         buckets=r.static_step(self.mid) is not None)

    def _let_store_go(self) -> None:
        """A new empty store; the old one's buffers released also where the C++ decode stack keeps its lists."""
        self.store.release()
        self.store = self._new_store()

    def drop(self) -> None:
        super().drop()
        self._let_store_go()

    # -------------------------------------------------------------- state
    @property
    def kv_bytes(self) -> int:
        jobs = sum(2 * k.numel() * k.element_size() for job in list(self.prefilling) if job.kv is not None
                   for k, _ in job.kv)
        return self.store.nbytes + jobs

    def _final_cols(self) -> int:
        """The columns the longest live row reaches by its end (a forced EOS and a flush step included)."""
        kv = self.runner.kv
        return max((kv.row_columns(n, r.cfg.max_new_tokens, len(r.tokens)) for r, n in zip(self.rows, self.lens)
                    if not r.final), default=0)

    def _prefill_cells(self, tokens: int) -> int:
        """The cells that prefill buffers for ``tokens`` prompt tokens can take: where fresh prompts are batched, up to
        :data:`WHOLE_PADDING` times as many (a pass of whole prompts holds their padded batch)."""
        return math.ceil(WHOLE_PADDING * tokens) if self.runner.batch_prefill else tokens

    def cells_after(self, joining: list[tuple[int, int, int]] = ()) -> int:
        """The most rows × columns the store and the prefill buffers can reach if generations ``joining``
        ((prompt tokens, rows, new tokens) each) join now and nothing else does: the store as it is where it need not
        grow, else the larger of that and its rows as wide as its longest row will grow (a growth's spare yields to
        the budget), plus every queued prompt's prefill buffer (where fresh prompts are batched, up to
        :data:`WHOLE_PADDING` times its length: a pass of whole prompts holds their padded batch)."""
        kv = self.runner.kv
        cols = [self._final_cols()]
        prompts = 0
        for job in self.prefilling:
            cols.append(kv.row_columns(len(job.ids), job.spec.config.max_new_tokens))
            prompts += len(job.ids)
        for prompt, _, new in joining:
            cols.append(kv.row_columns(prompt, new))
            prompts += prompt
        rows, width = self.size + sum(k for _, k, _ in joining), max(cols)
        store = self.store
        cells = store.rows_cap * store.cols_cap  # what it holds until it grows (a joining prompt's prefill first)
        if rows > store.rows_cap or width > store.cols_cap:
            # it grows, and a growth's spare yields to the budget (reserve, within_cells): rows x width at least.
            # Charging the spare it would grow to (the longest row + 64 or a quarter) kept a second generation out
            # of a budget that holds both: under a tight budget they ran one at a time
            cells = max(cells, rows * width)
        return cells + self._prefill_cells(prompts)

    # -------------------------------------------------------------- admission
    @torch.inference_mode()
    def add(self, specs, owners=None, one_ticket=None, per_row: bool = True):
        """Prefill ``specs`` now, whole (in packed passes of at most the runner's ``prefill_chunk`` tokens),
        and add their rows; one :class:`~fastgate.engine.decode.Ticket` per spec."""
        if one_ticket is not None:
            raise ValueError("a packed loop gives one ticket per prompt (Engine.generate uses DecodeLoop)")
        tickets = self.admit(specs, owners)
        mine = {id(t) for t in tickets}
        while any(id(job.ticket) in mine for job in self.prefilling):
            self._pass(self.runner.prefill_chunk or None, decode=False, only=mine)
        return tickets

    def admit(self, specs, owners=None, priority=None):
        """Queue ``specs`` for a chunked prefill (see :meth:`step`); prompts are encoded and checked now.
        ``priority``: one key per spec; queued prompts prefill lowest key first, ties in arrival order (the
        scheduler gives each generation its program's submission time, so the oldest request finishes first)."""
        eng = self.runner
        specs = [s if isinstance(s, _Spec) else _Spec(*s) for s in specs]
        keys = [0.0] * len(specs) if priority is None else list(priority)
        if len(keys) != len(specs):
            raise ValueError(f"priority has {len(keys)} keys for {len(specs)} prompts")
        rows, truncated = eng.encode([s.prompt for s in specs], [s.config.max_new_tokens for s in specs])
        if eng.prefix_cache and len(rows) > 1:
            eng.shared_prefix(rows)  # a prefix common to the batch is cached now, and found by each prompt
        tickets, _ = self._tickets(specs, owners, None)
        for spec, ticket, ids, cut, key in zip(specs, tickets, rows, truncated, keys):
            self._arrivals += 1
            self.prefilling.append(_Job(spec, ticket, ids, cut, priority=(key, self._arrivals),
                                        cached=eng.cached_prefix_len(ids)))
        self.prefilling.sort(key=lambda job: job.priority)  # stable, and a partly prefilled job keeps its key
        return tickets

    def _start(self, job: _Job) -> None:
        """The job's cached prefix, if any, copied into its new prefill buffers."""
        eng = self.runner
        job.started = True
        prefix = eng.shared_prefix([job.ids])
        if prefix is not None:
            eng.prefix_hits += 1
            p = len(prefix)
            self._allocate(job)
            for (k, v), (pk, pv) in zip(job.kv, eng.prefix_kv(prefix)):
                k[:, :, :p] = pk
                v[:, :, :p] = pv
            job.done = p

    def _allocate(self, job: _Job) -> None:
        """The job's prefill buffers (a pass that is not its whole prompt batched needs them)."""
        eng = self.runner
        n = len(job.ids)
        # empty, not zeros: every column is written (the cached prefix, then each chunk's own columns) before any pass
        # reads it, and zeroing 16 prompts' buffers cost ~2% of a 16 x 700 prefill
        job.kv = [(torch.empty((1, eng.kv_heads, n, eng.head_dim), dtype=eng.dtype, device=eng.device),
                   torch.empty((1, eng.kv_heads, n, eng.head_dim), dtype=eng.dtype, device=eng.device))
                  for _ in range(eng.n_layers)]  # per layer [1, Hkv, n, D]

    def _new_rows(self, specs, tickets, rows, truncated, pre_answer, per_row: bool = True):
        new_rows, layers, running, count = super()._new_rows(specs, tickets, rows, truncated, pre_answer, per_row)
        if self.static is not None:  # every layer: see __init__
            layers = tuple(range(self.static.layers))
            running = torch.zeros((len(new_rows), len(layers), self.runner.hidden_size), dtype=torch.float32,
                                  device=self.runner.device)
        return new_rows, layers, running, count

    def _append(self, rows, logits, layers, running, count) -> None:
        if self.static is not None:  # the joining rows' tokens are chosen now, as the step chooses them
            choice = self._choice(logits, rows)
            if self.rows:
                if self.logits is None:  # rows the step chose for keep no logits (only rows it cannot cover read them)
                    self.logits = logits.new_zeros((len(self.rows), logits.shape[-1]))
                choice = (torch.cat([self.chosen[0], choice[0]]), torch.cat([self.chosen[1], choice[1]]))
            self.chosen = choice
        super()._append(rows, logits, layers, running, count)

    def _choice(self, logits: torch.Tensor, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~fastgate.engine.static_step.choose` over ``logits [N, V]`` of ``rows``: tokens and log-probs
        ``[N]``."""
        dev = self.runner.device
        ints, floats = self._sampling(rows)
        ints, floats = ints.to(dev), floats.to(dev)
        return choose(logits, ints[0] > 0, floats[0], ints[1], floats[1], ints[2], ints[3])

    # -------------------------------------------------------------- token choice
    def _sampling(self, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``ints [4, M]`` (samples, top-k, key, token index) and ``floats [2, M]`` (temperature, top-p) of
        ``rows``, as :func:`fastgate.engine.static_step.choose` reads them."""
        ints, floats = [], []
        for row in rows:
            c = row.cfg
            seed = row.gen.initial_seed() if row.gen is not None else 0
            ints.append((int(c.do_sample), c.top_k, row_key(seed), len(row.tokens)))
            floats.append((c.temperature, c.top_p))
        return torch.tensor(ints, dtype=torch.long).T, torch.tensor(floats, dtype=torch.float32).T

    def _choose(self, active: list[int]) -> None:
        """With the static step: every active row's token from the step's choice, or from
        :func:`~fastgate.engine.static_step.choose` over logits an eager pass made (rows it does not cover: the eager
        loop's draw); one host read of the tokens."""
        if self.static is None:
            return super()._choose(active)
        rows = self.rows
        odd = [r for r in active if not covers(rows[r].cfg)]
        if odd:
            super()._choose(odd)
            eager = set(odd)
            active = [r for r in active if r not in eager]
        if not active:
            return
        if self.chosen is None:
            self.chosen = self._choice(self.logits, rows)
        tokens, logps = self.chosen[0].tolist(), self.chosen[1].tolist()
        self.chosen = None
        if any(rows[r].cfg.top_logprobs for r in active):  # an eager pass made these logits (_static_pass declined)
            with serial_torch(self.logits, len(rows)):
                self._record_top(active)
        for r in active:
            row = rows[r]
            row.tokens.append(tokens[r])
            row.logps.append(logps[r])
            self._update_finish(row)

    # -------------------------------------------------------------- decoding
    @torch.inference_mode()
    def step(self, prefill_budget: int | None = None) -> list:
        """One packed pass: every row's next token and up to ``prefill_budget`` prompt tokens. None: every
        queued prompt whole, the first ``runner.prefill_chunk`` tokens in the rows' pass and the rest in
        prefill passes (a forward of thousands of tokens runs slower per token on a CPU). Returns the tickets
        whose last row finished in it."""
        done: list = []
        if self.rows:
            feed, attend, counts_now, capture_eos = self._feeds()
            done = self._finalize([r for r in range(len(self.rows)) if not attend[r]])
            keep = [r for r in range(len(self.rows)) if attend[r]]
            order = self._compact(keep)
            feed = [feed[r] for r in order]
            counts_now = [counts_now[r] for r in order]
            capture_eos = [capture_eos[r] for r in order]
        else:
            feed, counts_now, capture_eos = [], [], []
        whole = prefill_budget is None
        chunk = (self.runner.prefill_chunk or None) if whole else prefill_budget
        self._pass(chunk, decode=True, feed=feed, counts_now=counts_now, capture_eos=capture_eos)
        while whole and self.prefilling:  # whole prompts: the rest in prefill passes of the runner's chunk
            self._pass(chunk, decode=False)
        done += self._finalize([r for r, row in enumerate(self.rows) if row.state == RowState.DONE and not row.final])
        if not self.busy:
            self._compact([])
        return done

    def _drop_cancelled_prefills(self) -> None:
        self.prefilling = [job for job in self.prefilling if not job.ticket.cancelled]

    def _clear_rows(self) -> None:
        """Every row leaves (all have ended); with no prompt queued the store goes too."""
        if self.rows:
            self._compact([])
        elif not self.prefilling and self.store.rows_cap:
            self._let_store_go()

    def _compact(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep``: each row that leaves takes the last kept row into its place (one row's copy of
        the store). Returns the old index of each row now in the loop, in its new order."""
        m = len(self.rows)
        if len(keep) == m:
            return list(range(m))
        if not keep:
            self.rows, self.lens, self.logits, self.running, self.count = [], [], None, None, None
            self.layers, self.chosen = (), None
            if not self.prefilling:  # an idle loop holds nothing
                self._let_store_go()
            return []
        order = list(range(m))
        kept = set(keep)
        holes = [r for r in range(len(keep)) if r not in kept]  # places below the new size that are free
        movers = [r for r in range(len(keep), m) if r in kept]  # kept rows beyond it
        for dst, src in zip(holes, movers):
            self.store.move_row(src, dst, self.lens[src])
            order[dst] = src
        order = order[:len(keep)]
        idx = torch.tensor(order, device=self.runner.device)
        self.rows = [self.rows[r] for r in order]
        self.lens = [self.lens[r] for r in order]
        self.logits = self.logits[idx] if self.logits is not None else None
        if self.chosen is not None:
            self.chosen = (self.chosen[0][idx], self.chosen[1][idx])
        if self.running is not None:
            self.running = self.running[idx]
        self.count = self.count[idx]
        return order

    def _prefill_order(self, budget: int | None) -> list[_Job]:
        """The queued prompts in the order a pass of ``budget`` tokens takes them: the queue's (priority, then
        arrival), except that with a budget the prompts of at most ``express_prefill`` tokens left that fit in half of
        it come first, in the queue's order among them."""
        queue = self.prefilling
        if not self.express_prefill or budget is None:
            return queue
        for job in queue:  # the cached prefix each queued prompt would start from now (one may have been evicted)
            if not job.started:
                job.cached = self.runner.cached_prefix_len(job.ids)
        first, room = [], budget // 2
        for job in queue:
            if job.left <= self.express_prefill:
                if job.left > room:
                    break
                first.append(job)
                room -= job.left
        if not first:
            return queue
        taken = {id(job) for job in first}
        return first + [job for job in queue if id(job) not in taken]

    def _pass(self, budget: int | None, decode: bool, feed=(), counts_now=(), capture_eos=(), only=None) -> int:
        """One packed forward: the rows' ``feed`` tokens (when ``decode``) and prompt chunks within ``budget``
        tokens; returns the prompt tokens run."""
        eng = self.runner
        self.prefilling = [job for job in self.prefilling if not job.ticket.cancelled]
        m = len(feed) if decode else 0
        segs: list[tuple[_Job, int]] = []  # (job, tokens this pass)
        ran = 0
        # by priority, then arrival (vLLM and Sarathi use arrival): the fewest-tokens-left order of the padded loop
        # starved long RAG prompts behind a stream of short ones (16 closed-loop clients: p95 50.3 s against 46.1 s)
        for job in self._prefill_order(budget):
            if only is not None and id(job.ticket) not in only:
                continue
            if budget is not None and ran >= budget:
                break
            if not job.started:
                self._start(job)
            n = job.left if budget is None else min(job.left, budget - ran)
            segs.append((job, n))
            ran += n
        if not m and not segs:
            return 0
        if m and not segs and self.static is not None and self._static_pass(feed, counts_now, capture_eos):
            return 0
        dev = eng.device
        ids = list(feed)
        positions = list(self.lens[:m])
        keep = list(range(m))
        # fresh prompts batched in one attention call a layer (CUDA); when every one is whole in this pass, that
        # call's padded keys / values are their only buffers (SegBatch)
        batched = eng.batch_prefill and len(segs) > 1 and all(job.done == 0 for job, _ in segs)
        # ... unless padding would make them much larger than the prompts (every layer's padded keys / values live
        # until the pass ends: one 4,000-token prompt among 63 short ones would hold 40x their size)
        whole = (batched and all(n == len(job.ids) for job, n in segs)
                 and len(segs) * max(n for _, n in segs) <= WHOLE_PADDING * sum(n for _, n in segs))
        plan_segs, ending = [], []
        for job, n in segs:
            if job.kv is None and not whole:
                self._allocate(job)
            off = len(ids)
            ids += job.ids[job.done:job.done + n]
            positions += range(job.done, job.done + n)
            plan_segs.append(PrefillSeg(off, n, job.done, job.kv))
            if job.done + n == len(job.ids):
                ending.append((job, len(keep)))
                keep.append(off + n - 1)
        plan = PackedPlan(self.store, m, None, 0, None, plan_segs, attn_dtype=eng.attention_dtype,
                          attend=eng.decode_attention, prefill_attend=eng.ops.prefill_attention,
                          pause=self.pause if ran >= PAUSE_TOKENS else None)
        if batched:
            plan.seg_batch = SegBatch.of(plan_segs, dev, whole)
        if m:
            width = max(self.lens) + 1
            self.store.reserve(m, width, m, width - 1, self.max_cells)  # (reserved at join: a no-op)
            pos = torch.tensor(self.lens, device=dev)  # [m]
            plan.pos, plan.width = pos, width  # its mask and row index: built where read (PackedPlan.decode_mask)
        want_pre = any(job.spec.taps.pre_answer for job, _ in ending)
        tap_layers = set(self.layers) if m else set()
        if (m and any(capture_eos)) or want_pre:
            tap_layers.add(self.mid)
        fused = eng.fused  # the model's own pass in few host operations (fastgate.engine.fused), or HF's with hooks
        hooks = eng.taps(tuple(sorted(tap_layers))) if tap_layers and fused is None else None
        try:
            # through numpy: torch.tensor of a Python list of 11,200 ints takes ~1 ms, five times numpy's
            args = (torch.from_numpy(np.asarray(ids, dtype=np.int64)).to(dev),
                    torch.from_numpy(np.asarray(positions, dtype=np.int64)).to(dev), plan,
                    torch.tensor(keep, dtype=torch.long, device=dev))
            with sdpa_choice(eng.sdpa_backends):  # the runner's SDPA kernels (no per-shape plan builds on CUDA)
                if fused is not None:
                    logits, outputs = fused(*args, _packed_attention, tap_layers, eng.ops.rms_norm, eng.ops.rope,
                                            eng.ops.decode_attention_step,
                                            (eng.ops.int4_matmul, eng.ops.int8_matmul, eng.ops.dense_linear),
                                            eng.ops.decode_layers, eng.ops.swiglu)  # [K, V]
                    hooks = _Outputs(outputs)
                else:
                    logits = packed_forward(eng.model, *args)  # [K, V]
            t_taps = time.perf_counter()
            if m:
                self._read_taps(lambda layer: hooks.outputs[layer][0, :m], list(counts_now), list(capture_eos))
            pre = {id(job): hooks.outputs[self.mid][0, keep[j]].to(torch.float32)
                   for job, j in ending} if want_pre else {}
            taps_s = time.perf_counter() - t_taps
        finally:
            if hooks is not None:
                hooks.close()
        if m:
            self.logits = logits[:m]
            self.chosen = self._choice(self.logits, self.rows) if self.static is not None else None
            self.lens = [n + 1 for n in self.lens]
            for ticket in {id(row.ticket): row.ticket for row in self.rows if not row.final}.values():
                ticket.forwards += 1
                ticket.taps_s += taps_s
        for job, n in segs:
            job.done += n
        if whole:
            self._enter_batch(ending, logits, pre, plan.seg_batch.kv)
            return ran
        if len(ending) > 1:  # the store grown once for all of them, not at each join (each growth copies every row)
            self._reserve_for([job for job, _ in ending])
        for job, j in ending:
            self.prefilling.remove(job)
            self._enter_job(job, logits[j], pre.get(id(job)))
        return ran

    def _cells_left(self, held: int, waiting: list[_Job]) -> int | None:
        """The cells the store may grow to under ``max_cells`` (None: no bound): the budget less ``held`` cells, the
        ``waiting`` prompts' prefill buffers and what the scheduler's other loops hold (admission counts them all)."""
        if self.max_cells is None:
            return None
        elsewhere = self.held_elsewhere() if self.held_elsewhere is not None else 0
        return max(1, self.max_cells - held - self._prefill_cells(sum(len(j.ids) for j in waiting)) - elsewhere)

    def _reserve_for(self, jobs: list[_Job], held: int | None = None) -> None:
        """Room in the store for every row of ``jobs`` (prompts ending in this pass), as wide as the longest live row
        will grow (no growth while they decode); under ``max_cells`` the spare leaves room for what the jobs hold
        while the store grows (``held`` cells: their own buffers' tokens by default, a padded batch's S × L) and for
        the prompts still queued (admission counted them, see :meth:`cells_after`). 64 short prompts ending in one
        pass, joining one by one, regrew the store five times, each a copy of every row so far."""
        kv = self.runner.kv
        ids = {id(job) for job in jobs}
        waiting = [j for j in self.prefilling if id(j) not in ids]  # the prompts still queued after these
        bound = self._cells_left(sum(len(job.ids) for job in jobs) if held is None else held, waiting)
        cols = max(self._final_cols(), *(kv.row_columns(len(job.ids), job.spec.config.max_new_tokens) for job in jobs))
        m, rows = len(self.rows), len(self.rows) + sum(job.spec.k for job in jobs)
        # a growth makes room for the queued prompts' rows too: 16 prompts of a 16 x 700 prefill joining a few a pass
        # regrew the store four times (float32: 0.3 s of copies and 0.4 s of zero-fill in a 17 s prefill)
        expect = rows + sum(job.spec.k for job in waiting)
        self.store.reserve(rows, cols, m, max(self.lens, default=0), bound, expect_rows=expect)

    def _static_pass(self, feed: list[int], counts_now: list[float], capture_eos: list[bool]) -> bool:
        """The rows' step through the static step (:mod:`fastgate.engine.static_step`), padded to its batch and width
        buckets; False (nothing run) when the store cannot take a bucket within ``max_cells`` or a row samples in a
        way the step does not cover."""
        rows, m = self.rows, len(feed)
        if not self.static.covers(row.cfg for row in rows):
            return False
        if any(row.cfg.top_logprobs for row in rows):  # their alternatives are read from the logits an eager pass keeps
            return False
        b = batch_bucket(m)
        # the store the step needs: the bucket's rows, a width bucket's columns (a join under a budget can leave the
        # store narrower than a bucket: it then grows to one)
        cols = width_bucket(max(max(self.lens) + 1, self.store.cols_cap))
        bound = self._cells_left(0, self.prefilling)  # as the joins' reservations are bounded
        grows = b > self.store.rows_cap or cols > self.store.cols_cap
        if grows and bound is not None and b * cols > bound:
            # the bucket would pass the budget: the rows step eagerly in the store as it is. Growing it anyway cut its
            # width to the rows' need, past the budget, and moved every row again at each step's new column (17 rows
            # at 600 tokens: 32 x 601, 32 x 602, ...)
            return False
        self.store.reserve(b, cols, m, max(self.lens), bound)
        # on CUDA, or with sizes fixed per bucket, every column of the store: a graph (CUDA's, or a compiled one) per
        # (batch bucket, store width), whatever the rows' lengths; on a CPU with symbolic sizes the columns the rows
        # use, so that a long context does not read the store's spare
        whole = self.static.cuda_graphs or not self.static.symbolic
        width = self.store.cols_cap if whole else max(self.lens) + 1
        if self.store.rows_cap < b or self.store.cols_cap != width_bucket(self.store.cols_cap):  # max_cells cut them
            return False
        eng = self.runner
        dev = eng.device
        running, count, eos = self._buffers(b)
        if self.running is None or self.running.data_ptr() != running.data_ptr():  # rows joined or left: copy in
            running[:m] = self.running
            count[:m] = self.count
        sampling, temps = self._sampling(rows)  # [4, m], [2, m]
        ints = torch.zeros((6, b), dtype=torch.long)  # [6, B]: padding rows feed the pad token at column 0
        ints[0] = eng.pad_id
        ints[0, :m] = torch.tensor(feed)
        ints[1, :m] = torch.tensor(self.lens)
        ints[2:, :m] = sampling
        floats = torch.zeros((4, b), dtype=torch.float32)  # [4, B]; padding rows count 0
        floats[2] = 1.0
        floats[0, :m] = torch.tensor(counts_now, dtype=torch.float32)
        floats[1, :m] = torch.tensor([float(c) for c in capture_eos])
        floats[2:, :m] = temps
        keys = [k[:b, :, :width] for k in self.store.keys]  # [B, Hkv, W, D] views of the store
        values = [v[:b, :, :width] for v in self.store.values]
        tokens, logps = self.static(keys, values, ints.to(dev), floats.to(dev), running, count, eos)  # [B], [B]
        self.running, self.count = running[:m], count[:m]
        for r in range(m):
            if capture_eos[r]:
                rows[r].eos_state = eos[r].clone()
        self.chosen, self.logits = (tokens[:m], logps[:m]), None
        self.lens = [n + 1 for n in self.lens]
        self.static_steps += 1
        for ticket in {id(row.ticket): row.ticket for row in rows if not row.final}.values():
            ticket.forwards += 1
        return True

    def _buffers(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static step's tap buffers for bucket ``b`` (allocated once per loop and bucket): running sums
        ``[B, n_layers + 1, d]``, counts ``[B]`` and EOS states ``[B, d]``, float32."""
        bufs = self._bufs.get(b)
        if bufs is None:
            eng = self.runner
            d, dev = eng.hidden_size, eng.device
            bufs = self._bufs[b] = (torch.zeros((b, self.static.layers, d), dtype=torch.float32, device=dev),
                                    torch.zeros(b, dtype=torch.float32, device=dev),
                                    torch.zeros((b, d), dtype=torch.float32, device=dev))
        return bufs

    def _enter_batch(self, ending: list[tuple[_Job, int]], logits: torch.Tensor, pre: dict,
                     kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The prompts of a pass that prefilled each whole and batched join at once, in pass order, as
        :meth:`_enter_job` one by one would (same rows, store columns and logits): the store's next rows take each
        layer's padded keys / values ``kv [S, Hkv, L, D]`` in one copy (a prompt's k samples: its row k times; the
        padding past a prompt's length lands in columns its mask never reads, as any finite values may)."""
        jobs = [job for job, _ in ending]
        for job in jobs:
            self.prefilling.remove(job)
        ks = [job.spec.k for job in jobs]
        dev = self.runner.device
        at = torch.tensor([j for _, j in ending], dtype=torch.long, device=dev)  # [S]: each prompt's logits row
        fork = torch.repeat_interleave(torch.arange(len(jobs), device=dev), torch.tensor(ks, device=dev),
                                       output_size=sum(ks))  # [N]: each new row's prompt (no device sync)
        pre_rows = None
        if pre:
            pre_rows = torch.stack([pre[id(job)] for job in jobs])[fork]  # [N, d]
        rows, layers, running, count = self._new_rows([job.spec for job in jobs], [job.ticket for job in jobs],
                                                      [job.ids for job in jobs], [job.truncated for job in jobs],
                                                      pre_rows)
        m, n_new = len(self.rows), len(rows)
        # the padded batch is held while the store grows: S × L cells, at most WHOLE_PADDING × the prompts' tokens
        self._reserve_for(jobs, held=kv[0][0].shape[0] * kv[0][0].shape[2])
        forked = n_new != len(jobs)
        for layer, (k, v) in enumerate(kv):  # [S, Hkv, L, D] each
            width = k.shape[2]
            self.store.keys[layer][m:m + n_new, :, :width] = k[fork] if forked else k
            self.store.values[layer][m:m + n_new, :, :width] = v[fork] if forked else v
        self._append(rows, logits[at][fork], layers, running, count)  # logits [N, V]
        self.lens = self.lens + [len(job.ids) for job, k in zip(jobs, ks) for _ in range(k)]

    def _enter_job(self, job: _Job, logits: torch.Tensor, pre_answer) -> None:
        """The k samples of a prefilled prompt join: the store's next k rows get its keys / values."""
        k = job.spec.k
        pre = pre_answer[None].expand(k, -1) if pre_answer is not None else None  # [k, d]
        rows, layers, running, count = self._new_rows([job.spec], [job.ticket], [job.ids], [job.truncated], pre)
        m, n = len(self.rows), len(job.ids)
        self._reserve_for([job])  # the rows' final width now; a no-op when the pass reserved for every job ending
        self.store.write_rows(m, job.kv, n, k)
        job.kv = None
        self._append(rows, logits[None].repeat(k, 1), layers, running, count)  # logits [k, V]
        self.lens = self.lens + [n] * k
