"""The static decode step: one compiled pass over the packed loop's decode rows, taps and token choice included.

The eager packed pass (:mod:`fastgate.engine.packed`) runs HF's model forward with per-step hooks, an attention
implementation switched on and off, a width that grows every step and a host read of the chosen tokens before the
next step can start. On a GPU that step is bound by ~1,500 kernel launches; on a CPU by Python and dispatch
overhead at small batch. This module replaces the decode-only pass (no prompt chunk in it) with one function whose
every shape is fixed by a *bucket* — ``B`` rows (1, 2, 4, … 128; the rows past the loop's own are padding) and
``W`` columns, the store's whole width, which grows in powers of two in this mode (a view's strides follow its
buffer's width: attending over all of it keeps one graph per width) — so that ``torch.compile(fullgraph=True)``
traces it once per bucket and, on CUDA, captures it as a CUDA graph (:class:`_Graph`), as vLLM and SGLang capture
one graph per batch size. On a CPU there is no graph to capture and compiling takes minutes a shape: the sizes are
left symbolic (``dynamic=True``), one graph (two: batch 1 is specialised) serves every bucket, and on a CPU the step
attends over the columns the rows use rather than the store's whole width (at 16 rows × 600 tokens reading the spare
of a 1024-column store made the step 1.2× slower than the eager one). On CUDA the sizes are symbolic too: two
compiles (batch 1's graph and the rest's), then a CUDA graph captured per bucket, as vLLM compiles once and captures
per batch size. Fixed sizes (``StepConfig.sizes="bucket"``) compile at each new bucket's first step, 26-47 s on an
H200 with the scheduler waiting, for a warm step no faster (bench/bench_gpu_serving.py, 2026-11-30: 0.193 s against
0.197 s for 64 tokens at batch 1, 0.279 s against 0.259 s at batch 4). Inside the one graph:

* the model's own decoder layers (HF's modules, called one by one: the same arithmetic as the eager pass), each
  writing its new key / value into the packed loop's :class:`~fastgate.engine.packed.SlotStore` rows at the row's own
  column and attending over the first ``W`` columns with a per-row length mask;
* the taps: every layer's state is added, weighted by the row's count for this step, into the loop's running sums
  ``[rows, n_layers + 1, d]`` (all layers, so that the graph never depends on which layers the rows asked for; the
  rows' own layers are picked when they finish), and the EOS state is kept where a row asks for it;
* the next token of every row: greedy (argmax) or sampled with the row's temperature, top-k (at most
  :data:`TOP_K_MAX`) and top-p, drawn from a counter-based uniform of the row's seed and token index
  (:func:`uniform`), so that draws never depend on the batch or on which pass produced the logits.

The host writes the step's inputs (tokens, columns, counts, sampling settings: a few integers per row) and reads its
chosen tokens and their log-probs once, to detokenize and finish rows; nothing inside the step reads the device from
the host (a test runs it under a dispatch mode that rejects such reads).

Why a function over HF's layers rather than a model of our own: the layers stay HF's (any checkpoint transformers
loads for Llama / Qwen2 / Mistral works unchanged, and float32 tokens equal the eager pass's); only the cache and the
attention mask around them are ours, which is what HF's ``StaticCache`` would also need, but a ``StaticCache`` keeps
one column per position for all rows alike, while the packed store keeps each row at its own length.

Eager stays the reference and the fallback: :class:`StaticStep` with ``compiled=False`` runs the very same function
uncompiled, and a pass with prompt chunks, or rows whose sampling the step does not cover (top-k 0 or above
:data:`TOP_K_MAX` with sampling on), runs the eager packed pass.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastgate.assets.quant import Int4Linear, Int8Linear
from fastgate.engine.attention import attention_dtype, attention_implementation, register_attention
from fastgate.errors import InputError, out_of_memory

__all__ = ["BATCH_BUCKETS", "STEP_MODES", "STEP_SIZES", "TOP_K_MAX", "StaticStep", "StepConfig", "batch_bucket",
           "choose", "compiled_by_default", "covers", "row_key", "uniform", "width_bucket"]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # the batch sizes a graph is traced for (vLLM captures a similar set)
TOP_K_MAX = 64  # sampled rows draw among their top-k within this many candidates (SeaKR samples with top-k 50)
MIN_WIDTH = 64  # the narrowest attended width: below it a bucket saves nothing


def batch_bucket(m: int) -> int:
    """The smallest batch bucket holding ``m`` rows (beyond the largest: ``m`` rounded up to a multiple of it)."""
    for b in BATCH_BUCKETS:
        if m <= b:
            return b
    top = BATCH_BUCKETS[-1]
    return -(-m // top) * top


def width_bucket(w: int) -> int:
    """The attended width for ``w`` columns: a power of two, at least :data:`MIN_WIDTH`."""
    return max(MIN_WIDTH, 1 << max(0, w - 1).bit_length())


def row_key(seed: int) -> int:
    """A sampled row's 32-bit key for :func:`uniform` from its (63-bit) seed."""
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def uniform(key: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row from its ``key [B]`` and token index ``draw [B]`` (int64): a 32-bit integer hash
    (two rounds of xor-shift-multiply), so that a row's draws depend on nothing but its seed and position. Every
    product stays below 2**63: no overflow, the same bits on every device."""
    x = (key ^ ((draw * 0x9E3779B1) & 0xFFFFFFFF)) & 0xFFFFFFFF  # [B]
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))  # 24 bits: exact in float32


CDF_BLOCK = 256  # the whole vocabulary's cdf in blocks of this many tokens: two short scans, none over V


def cdf_count(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of ``probs [B, V]``, how many entries of its cumulative distribution are ``<= u [B, 1]``: the
    inverse-cdf draw's token. The cdf is built in two short scans (within blocks of :data:`CDF_BLOCK` tokens, then
    over the blocks' totals) rather than one over the vocabulary: inductor (torch 2.11, CUDA) failed to generate the
    split scan of a 49,152-wide cumsum at batch 16 and 64, and the compiled step fell back to eager for those buckets.
    The same function runs in the eager packed loop, so both loops draw alike. Returns ``[B]`` int64."""
    b, v = probs.shape
    nb = -(-v // CDF_BLOCK)
    blocks = F.pad(probs, (0, nb * CDF_BLOCK - v)).view(b, nb, CDF_BLOCK)  # [B, nb, CDF_BLOCK]
    inner = blocks.cumsum(-1)  # [B, nb, CDF_BLOCK] within each block
    totals = inner[:, :, -1]  # [B, nb]
    before = F.pad(totals.cumsum(-1)[:, :-1], (1, 0))  # [B, nb] the mass before each block: an exclusive scan, so
    # a block's first entry never falls below the one before it (a cumsum less the totals could, by an ulp)
    cdf = (before[:, :, None] + inner).flatten(1)[:, :v]  # [B, V]
    return (cdf <= u).sum(-1)


def choose(logits: torch.Tensor, sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, key: torch.Tensor, draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's next token and its log-prob: argmax where ``sample`` is False, else a draw from the row's
    distribution after temperature, top-k (``1 <= top_k <= TOP_K_MAX``) and top-p, as
    :func:`fastgate.engine.decode.process_logits` shapes it (top-p over the top-k survivors, ties at the k-th value kept
    within the :data:`TOP_K_MAX` candidates), or over the whole vocabulary with top-k 0 and top-p 1.

    ``logits [B, V]`` float32; ``sample [B]`` bool; ``temperature``, ``top_p [B]`` float32; ``top_k``, ``key``,
    ``draw [B]`` int64. Returns ``tokens [B]`` int64 and ``logprobs [B]`` float32 (of the unprocessed distribution,
    as the eager loop records them). No host reads: it runs inside the compiled step.
    """
    logp = torch.log_softmax(logits, dim=-1)  # [B, V]
    greedy = logits.argmax(-1)  # [B]
    k_max = min(TOP_K_MAX, logits.shape[-1])
    vals, idx = torch.topk(logits / temperature[:, None], k_max, dim=-1)  # [B, K] descending
    kth = vals.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])  # [B, 1]
    vals = vals.masked_fill(vals < kth, float("-inf"))  # top-k, ties at the k-th value kept
    asc = vals.flip(-1)  # [B, K] ascending, as HF sorts for top-p
    remove_asc = asc.softmax(-1).cumsum(-1) <= (1 - top_p)[:, None]
    remove_asc[:, -1] = False  # keep at least the most likely token
    probs = vals.masked_fill(remove_asc.flip(-1), float("-inf")).softmax(-1)  # [B, K]
    u = uniform(key, draw)[:, None]  # [B, 1]
    pick = (probs.cumsum(-1) <= u).sum(-1).clamp_max(k_max - 1)  # [B] the first candidate whose cdf passes u
    drawn = idx.gather(1, pick[:, None])[:, 0]  # [B]
    # top-k 0 (and top-p 1): the whole vocabulary, in token order
    whole = (logits / temperature[:, None]).softmax(-1)  # [B, V]
    drawn = torch.where(top_k == 0, cdf_count(whole, u).clamp_max(logits.shape[-1] - 1), drawn)  # [B]
    tokens = torch.where(sample, drawn, greedy)  # [B]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


class _StoreView:
    """What HF's attention layers call ``cache.update`` on: writes each row's new key / value at its own column of
    the store's bucket views and returns the views (``[B, Hkv, W, D]``) to attend over."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: torch.Tensor,
                 cols: torch.Tensor) -> None:
        self.keys, self.values, self.rows, self.cols = keys, values, rows, cols

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]  # [B, Hkv, W, D]
        k[self.rows, :, self.cols] = key_states[:, :, 0]  # [B, Hkv, D] at each row's own column
        v[self.rows, :, self.cols] = value_states[:, :, 0]
        return k, v


STEP_MODES = ("auto", "eager", "compiled")  # how decode steps run: auto is compiled on CUDA, eager on a CPU
STEP_SIZES = ("auto", "bucket", "symbolic")  # the compiled step's sizes (StepConfig.sizes)
_ATTENTION = "fastgate_static"  # the step's attention function's name in transformers' AttentionInterface


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The step's attention (an HF attention function): ``query [B, H, 1, D]`` over ``key / value [B, Hkv, W, D]``
    with the rows' length mask ``[B, 1, 1, W]``; returns ``[B, 1, H, D]`` as HF's functions do. Grouped-query
    heads go to SDPA as they are (``enable_gqa``): HF's own SDPA function copies every key and value head group by
    group (``repeat_kv``) whenever torch.compile traces it with a mask, which at batch 16 and 600 columns made the
    compiled step 3× slower than the eager one."""
    dtype = query.dtype
    wide = attention_dtype(query.device, dtype)  # bf16 on a CPU: in float32, as the eager packed pass attends
    if wide is not None:
        query, key, value = query.to(wide), key.to(wide), value.to(wide)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=getattr(module, "num_key_value_groups", 1) > 1)  # [B, H, 1, D]
    return out.transpose(1, 2).to(dtype), None


def _decode(model, cache_kw: str, mid: int, keys: list[torch.Tensor], values: list[torch.Tensor],
            ints: torch.Tensor, floats: torch.Tensor, running: torch.Tensor, count: torch.Tensor, eos: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step itself, for one bucket (the shapes of its inputs fix ``B`` and ``W``).

    ``keys / values``: per layer the store's ``[B, Hkv, W, D]`` views; ``ints [6, B]`` int64: the token each row
    feeds, its column, whether it samples, its top-k, key and token index; ``floats [4, B]``: its count for the taps
    (1 or 0), whether its EOS state is kept (1 or 0), temperature and top-p; ``running [B, n_layers + 1, d]``,
    ``count [B]``, ``eos [B, d]`` float32, updated in place. Returns the next ``tokens [B]`` and their ``logprobs [B]``.
    """
    inner = model.model
    tokens, cols = ints[0], ints[1]  # [B]
    b, width = tokens.shape[0], keys[0].shape[2]
    rows = torch.arange(b, device=tokens.device)  # [B]
    positions = cols[:, None]  # [B, 1]: a row's token sits at its own column
    mask = (torch.arange(width, device=tokens.device)[None, :] <= positions)[:, None, None, :]  # [B, 1, 1, W]
    h = inner.embed_tokens(tokens[:, None])  # [B, 1, d]
    states = [h]
    pe = inner.rotary_emb(h, positions)
    view = _StoreView(keys, values, rows, cols)
    n = len(inner.layers)
    for i, layer in enumerate(inner.layers):
        h = layer(h, attention_mask=mask, position_ids=positions, use_cache=True, position_embeddings=pe,
                  **{cache_kw: view})  # [B, 1, d]
        if i < n - 1:
            states.append(h)
    h = inner.norm(h)
    states.append(h)  # layer n is the normed output, as HF's hidden_states[-1]
    stacked = torch.cat(states, dim=1).to(torch.float32)  # [B, n + 1, d]
    weight, capture = floats[0], floats[1]  # [B]
    running.add_(stacked * weight[:, None, None])
    count.add_(weight)
    eos.copy_(torch.where(capture[:, None] > 0, stacked[:, mid], eos))
    head = model.get_output_embeddings()
    # a float head's plain product (a sliced head's per-shape check is no graph); a quantized head its own module
    logits = (head(h[:, 0]) if isinstance(head, (Int8Linear, Int4Linear))
              else F.linear(h[:, 0], head.weight, head.bias)).to(torch.float32)  # [B, V]
    return choose(logits, ints[2] > 0, floats[2], ints[3], floats[3], ints[4], ints[5])


def covers(cfg) -> bool:
    """Whether :func:`choose` draws as generation config ``cfg`` asks (see :meth:`StaticStep.covers`). A row that
    wants each step's top log-probs is still drawn by it (the same tokens as without them), over logits an eager pass
    kept (:meth:`fastgate.engine.packed.PackedLoop._static_pass` declines while such a row decodes)."""
    return not cfg.do_sample or 1 <= cfg.top_k <= TOP_K_MAX or (cfg.top_k == 0 and cfg.top_p >= 1.0)


@dataclass(frozen=True)
class StepConfig:
    """How the packed loop runs its decode-only steps (chosen once, when the runner is built)."""

    mode: str = "auto"  # compiled on CUDA (CUDA graphs), eager on CPU (see compiled_by_default); or eager, compiled
    backend: object = "inductor"  # torch.compile's backend ("aot_eager": tracing without code generation, for tests)
    cache_dir: str | None = None  # compiled kernels' cache (None: $FASTGATE_HOME/compile): a later start reuses them
    # the compiled step's sizes: symbolic (one graph serves every bucket; on CUDA a CUDA graph is still captured per
    # bucket, as vLLM does), or fixed per bucket (a compile for each bucket a server meets: 26-47 s each on an H200,
    # the scheduler stalled meanwhile, for a warm step no faster there); auto: symbolic everywhere
    sizes: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in STEP_MODES:
            raise InputError(f"step must be auto, eager or compiled, got {self.mode!r}")
        _check_sizes(self.sizes)


def _check_sizes(sizes: str) -> None:
    if sizes not in STEP_SIZES:
        raise InputError(f"the step's sizes must be {', '.join(STEP_SIZES)}, got {sizes!r}")


def compiled_by_default(device) -> bool:
    """``auto``'s choice: compiled on CUDA, where the eager step is launch-bound; eager on a CPU, where compiling
    takes minutes per bucket and a step gains little (see docs/RESULTS.md, "The compiled step")."""
    return torch.device(device).type == "cuda"


class StaticStep:
    """The static decode step of one runner's model: traced (and compiled) once per (batch, width) bucket.

    Args:
        runner: the :class:`~fastgate.engine.model_runner.ModelRunner` whose model it runs.
        mid: the layer whose state is kept as a row's EOS state.
        compiled: run through ``torch.compile(fullgraph=True)``, and on CUDA captured as a CUDA graph per bucket
            (:class:`_Graph`); False: the same function eagerly (the reference).
        backend: ``torch.compile``'s backend.
        cache_dir: where inductor caches the compiled kernels (None: ``$FASTGATE_HOME/compile``).
        sizes: ``symbolic`` (one graph for every bucket), ``bucket`` (a graph per bucket) or ``auto`` (symbolic): see
            :class:`StepConfig`.
    """

    def __init__(self, runner, mid: int, compiled: bool = True, backend: str = "inductor",
                 cache_dir: str | None = None, sizes: str = "auto") -> None:
        self.runner, self.mid, self.compiled, self.backend = runner, mid, compiled, backend
        self.buckets: set[tuple[int, int]] = set()  # (B, W) buckets run so far
        self.cuda_graphs = compiled and torch.device(runner.device).type == "cuda"
        _check_sizes(sizes)
        # symbolic sizes (auto): one graph serves every bucket (two: batch 1 is specialised), so a server compiles
        # once, for a minute or two, instead of at each new bucket while its requests wait
        self.symbolic = sizes != "bucket"
        self._graphs: dict[tuple[int, int], _Graph] = {}  # (B, W) -> its CUDA graph (on CUDA)
        self._pool = None  # the graphs' shared memory pool (one bucket replays at a time, as in vLLM)
        fn = _decode
        self.cache_dir: str | None = None  # where inductor caches the compiled kernels (None: not compiled)
        self._announced: set = set()  # the graphs whose compile's start was told on stderr (_announce)
        if compiled:
            self.cache_dir = _configure(cache_dir)
            # the graphs are captured here, not by mode="reduce-overhead": its trees skip graphs whose inputs are
            # mutated and not static (the store's views, the tap buffers), which is every input this step writes
            fn = torch.compile(_decode, fullgraph=True, dynamic=self.symbolic, backend=backend)
        self._fn = fn
        self._fns: dict[tuple[int, int], Callable] = {}  # (B, W) -> the function a bucket runs where not self._fn
        self.eager_buckets: set[tuple[int, int]] = set()  # buckets whose compile failed: they run eagerly
        # symbolic sizes: what the buckets of a graph (keyed by batch == 1) run after its compile failed: the retry
        # compiled without split reductions, or the eager step
        self._fallback: dict[bool, Callable] = {}
        register_attention(_ATTENTION, _attention)  # before the step is traced

    @property
    def layers(self) -> int:
        """Rows of the running sums the step keeps: every layer, 0 .. n_layers."""
        return self.runner.n_layers + 1

    def covers(self, cfgs) -> bool:
        """Whether the step can choose tokens for rows with generation configs ``cfgs``: greedy, or sampling with a
        top-k within :data:`TOP_K_MAX`, or with neither top-k nor top-p."""
        return all(covers(c) for c in cfgs)

    def __call__(self, keys: list[torch.Tensor], values: list[torch.Tensor], ints: torch.Tensor,
                 floats: torch.Tensor, running: torch.Tensor, count: torch.Tensor, eos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one bucket (see :func:`_decode` for the arguments); the shapes must be a bucket's."""
        b, width = ints.shape[1], keys[0].shape[2]
        if b not in BATCH_BUCKETS and b % BATCH_BUCKETS[-1]:
            raise ValueError(f"static step: {b} rows is not a batch bucket {BATCH_BUCKETS}")
        if (self.cuda_graphs or not self.symbolic) and width != width_bucket(width):
            raise ValueError(f"static step: width {width} is not a width bucket")
        bucket = (b, width_bucket(width))  # with symbolic sizes any width runs: its bucket is what it was traced for
        new = bucket not in self.buckets
        self.buckets.add(bucket)
        r = self.runner
        args = (r.model, r.cache_kw, self.mid, keys, values, ints, floats, running, count, eos)
        if not new or self._fn is _decode:
            return self._run(bucket, args)
        # with symbolic sizes a bucket's graph is one of two (batch 1 is specialised): where that graph's compile
        # failed at an earlier bucket, this one takes what that bucket ended with, not another failing compile
        fallback = self._fallback.get(b == 1) if self.symbolic else None
        if fallback is _decode:
            return self._eager(bucket, args)
        if fallback is not None:
            self._fns[bucket] = fallback
        self._announce(bucket)
        try:  # a bucket's first call compiles it; a compiler that fails leaves that bucket eager (the same results)
            with _distinct_sizes():
                return self._run(bucket, args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the step itself is correct eagerly
            if out_of_memory(exc):  # not the compiler's fault: the caller frees memory or fails the rows (a
                # retry would compile for tens of seconds, then pin the bucket eager for good)
                self._forget(bucket)
                raise
            failure = exc
        retry = self._without_split_reductions() if fallback is None else None
        if retry is not None:  # inductor's CUDA codegen failed at 16 and 64 rows in its split reductions (an H200)
            self._fns[bucket] = retry
            self._graphs.pop(bucket, None)
            try:
                with _distinct_sizes():
                    out = self._run(bucket, args)
                if self.symbolic:
                    self._fallback[b == 1] = retry
                return out
            except Exception as exc:  # noqa: BLE001 - as above
                if out_of_memory(exc):
                    self._forget(bucket)
                    raise
                failure = exc
        later = ("so do the later buckets of its graph (symbolic sizes: one graph for batch 1, one for more rows), "
                 "the other graph stays compiled" if self.symbolic else "the other buckets stay compiled")
        warnings.warn(f"fastgate: compiling the decode step for {b} rows x {bucket[1]} columns failed "
                      f"({type(failure).__name__}: {failure}); that bucket's steps run eagerly, {later}",
                      RuntimeWarning, stacklevel=2)
        if self.symbolic:
            self._fallback[b == 1] = _decode
        return self._eager(bucket, args)

    def _forget(self, bucket: tuple[int, int]) -> None:
        """``bucket`` as if it had not run: its next call is a first call again (a compile failure there still falls
        back; with symbolic sizes it takes its graph's fallback then)."""
        self.buckets.discard(bucket)
        self._fns.pop(bucket, None)

    def _eager(self, bucket: tuple[int, int], args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``bucket`` eagerly from now on (its compile failed)."""
        self._fns[bucket] = _decode
        self.eager_buckets.add(bucket)
        self._graphs.pop(bucket, None)
        return self._run(bucket, args)

    def _announce(self, bucket: tuple[int, int]) -> None:
        """One line on stderr as a bucket's compile starts: the step then stalls for tens of seconds (minutes on a
        CPU) with nothing else to show for it. With sizes fixed per bucket every bucket compiles; with symbolic sizes
        two graphs serve them all (batch 1 is specialised), so each is told once. Test backends (anything but
        inductor) compile nothing worth telling."""
        graph = bucket[0] == 1 if self.symbolic else bucket
        if self.backend != "inductor" or graph in self._announced:
            return
        self._announced.add(graph)
        width = "" if self.symbolic else f" x {bucket[1]} columns"
        print(f"fastgate: compiling the decode step for batch {bucket[0]}{width} (cached in {self.cache_dir})",
              file=sys.stderr, flush=True)

    def _without_split_reductions(self) -> Callable | None:
        """The step compiled by inductor with split reductions off (None for another backend): the retry of a bucket
        whose compile failed, before it falls back to the eager step."""
        if self.backend != "inductor":
            return None
        return torch.compile(_decode, fullgraph=True, dynamic=self.symbolic, backend="inductor",
                             options={"split_reductions": False})

    def _run(self, bucket: tuple[int, int], args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        # the layers read the attention implementation from the shared config when they run (and the compiled graph
        # guards on it): it names the step's own function for the step only, as the packed pass does for its own
        with attention_implementation(self.runner.model.config, _ATTENTION, _attention):
            return self._call(bucket, args)

    def _call(self, bucket: tuple[int, int], args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        fn = self._fns.get(bucket, self._fn)
        if not self.cuda_graphs or bucket in self.eager_buckets:
            return fn(*args)
        keys, values, ints, floats, running, count, eos = args[3:]
        graph = self._graphs.get(bucket)
        if graph is None or graph.buffers != _addresses(keys, values, running, count, eos):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = self._graphs[bucket] = _Graph(fn, args, self._pool)  # the store moved: captured again
        return graph(ints, floats)


def _addresses(keys, values, running, count, eos) -> tuple[int, ...]:
    """Where a captured graph reads and writes: the store's views and the tap buffers."""
    return tuple(t.data_ptr() for t in (*keys, *values, running, count, eos))


class _Graph:
    """One bucket's CUDA graph: the compiled step captured over the store's views, the tap buffers and its own copies
    of the per-step inputs, replayed after the host's inputs are copied in (vLLM's CUDA graph runner does the same).

    Capture needs two warm-up runs (the compile, and the allocator's first allocations) on a side stream. They write
    each row's key / value at its column (the very values the real step writes: idempotent) and add to the tap
    buffers, which are restored afterwards; the real step is then the first replay.
    """

    def __init__(self, fn, args: tuple, pool) -> None:
        model, cache_kw, mid, keys, values, ints, floats, running, count, eos = args
        self.buffers = _addresses(keys, values, running, count, eos)
        self.ints, self.floats = ints.clone(), floats.clone()  # [6, B], [4, B]: what every replay reads
        saved = (running.clone(), count.clone(), eos.clone())
        captured = (model, cache_kw, mid, keys, values, self.ints, self.floats, running, count, eos)
        side = torch.cuda.Stream()
        try:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(*captured)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = fn(*captured)  # (tokens [B], logprobs [B]): the graph's own buffers
        finally:  # also where a warm-up or the capture failed: the step then runs again (a retry, or eagerly), and
            # the tap sums must not keep the failed runs' additions (the rows' counts 5x this step's); after the side
            # stream's work, which a failed warm-up left unwaited
            torch.cuda.current_stream().wait_stream(side)
            running.copy_(saved[0])
            count.copy_(saved[1])
            eos.copy_(saved[2])

    def __call__(self, ints: torch.Tensor, floats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay with this step's inputs. The outputs are overwritten by the next replay: the loop reads them (its
        one host read) before the next step."""
        self.ints.copy_(ints, non_blocking=True)
        self.floats.copy_(floats, non_blocking=True)
        self.graph.replay()
        return self.out


@contextlib.contextmanager
def _distinct_sizes() -> Iterator[None]:
    """Within: dynamo's symbolic sizes are not unified because they happen to be equal when traced ("duck sizing"):
    a CPU graph traced at 2 rows of a model with 2 KV heads (qwen2.5-0.5b; 8 rows for Llama-3-8B), or at 4 rows
    beside the step's 4 rows of sampling settings, was guarded on that equality and compiled again for the next
    buckets (3 graphs for 2, 4, 8 rows or for 4, 8, 16; each a few minutes with inductor on a CPU). Distinct sizes
    make the one trace slower (SmolLM2 with inductor on a 2-core EPYC: 241 s against 179 s, one run each), not a
    trace a bucket. Set for a bucket's first call only, the one that traces (a scoped config costs ~10 us)."""
    import torch.fx.experimental._config as fx_config

    before = fx_config.use_duck_shape
    fx_config.use_duck_shape = False
    try:
        yield
    finally:
        fx_config.use_duck_shape = before


_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
# The variable as this module found it, and whether it can only have been the user's then: importing torch._dynamo
# sets it to torch's default (/tmp/torchinductor_<user>; torch 2.13), so a value seen before that import was not
# torch's. The CLI imports this module (through the model runner) before anything imports torch._dynamo.
_CACHE_AT_IMPORT: str | None = os.environ.get(_CACHE_VAR)
_CACHE_AT_IMPORT_IS_USERS: bool = _CACHE_AT_IMPORT is not None and "torch._dynamo" not in sys.modules


def _users_cache_dir() -> str | None:
    """The ``TORCHINDUCTOR_CACHE_DIR`` the user set themselves, None where it is unset or torch's own default.

    torch sets the variable to its default the first time anything asks for inductor's cache directory (importing
    ``torch._dynamo`` does), so its mere presence says nothing: it is the user's if it was there before torch could
    have set it (when this module was imported), or if it names another directory than torch's default."""
    value = os.environ.get(_CACHE_VAR)
    if value is None:
        return None
    if _CACHE_AT_IMPORT_IS_USERS and value == _CACHE_AT_IMPORT:
        return value
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return None if os.path.abspath(value) == os.path.abspath(default_cache_dir()) else value


_configured = False


def _configure(cache_dir: str | None) -> str:
    """Once per process: room for a graph per bucket, and the compiled kernels cached under ``$FASTGATE_HOME``
    (``cache_dir`` if given) unless the user set ``TORCHINDUCTOR_CACHE_DIR`` themselves. Returns the cache directory.

    Setting the variable is enough even after torch set it: inductor reads it each time it needs its cache directory
    (``torch._inductor.runtime.cache_dir_utils.cache_dir``), not once at import; and compile workers inherit it."""
    global _configured
    if _configured:
        return os.environ[_CACHE_VAR]
    import torch._dynamo

    from fastgate.assets.paths import home

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 512)
    if _users_cache_dir() is None:  # the user's own choice wins; torch's default (a /tmp directory) does not
        os.environ[_CACHE_VAR] = str(cache_dir or home() / "compile")
    _configured = True
    return os.environ[_CACHE_VAR]
