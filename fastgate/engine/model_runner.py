"""The model runner: one loaded model's forward passes, and what the decode loops need around them.

It owns the model, its tokenizer and special tokens, the gating ops chosen for its device, the prefix cache, the
prefill (whole, in row chunks, or from a cached prefix), the padded decode step, the taps (forward hooks that keep
chosen layers' outputs) and token text helpers. :class:`~fastgate.engine.decode.DecodeLoop` and
:class:`~fastgate.engine.packed.PackedLoop` decode through this public API only, and
:class:`~fastgate.engine.local.Engine` is a
facade that builds one and runs a loop per ``generate`` call; so the loops never import the engine nor touch its
private members. The slot store of the packed layout stays with that layout (:class:`fastgate.engine.packed.SlotStore`),
built from the runner's KV geometry (``kv_heads``, ``head_dim``, ``dtype``).

Why our own runner instead of ``model.generate``: the gates need per-step hidden states of a few layers (summed on the
fly, never stored per token), log-probs of the chosen tokens, a forced EOS step after a sample stops, and k samples
that share one prefill. ``generate(output_hidden_states=True)`` materialises every layer at every step instead.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import OrderedDict

import torch

from fastgate.assets.models import LoadedModel, return_freed_memory
from fastgate.config import as_integer, check_tap_layers
from fastgate.engine.attention import attention_dtype, sdpa_backends, sdpa_choice
from fastgate.engine.fused import canonical_forward, fusable, fused_forward
from fastgate.engine.kv_cache import KVCacheManager, KVGeometry, new_cache, plain_layers
from fastgate.engine.lm_head import DEFAULT_COLUMNS, slice_head
from fastgate.engine.static_step import StaticStep, StepConfig, compiled_by_default
from fastgate.errors import InputError

__all__ = ["EarlyExit", "ModelRunner", "NEW_PREFIX_TOKENS", "Taps", "runner_of"]

# the fixed cost of computing a new shared prefix, in prompt tokens: its own forward's start (about a 32-token
# prefill's time on a CPU), weighed in ModelRunner.shared_prefix against what the prefix saves the batch
NEW_PREFIX_TOKENS = 32
# The prefix cache's bounds. Prefixes given by cache_prefix (the methods' few-shot blocks) are pinned: prompts shared
# by a batch's rows, found on their own (shared_prefix), never evict them. Why: bursts of clients' prompts sharing a
# prefix once filled the 16 places, held 1.75 MB of keys and values outside the scheduler's KV budget (any length: a
# 3,000-token shared document too) and evicted the methods' blocks, whose prompts then prefilled them again.
PINNED_PREFIXES = 16  # the most pinned prefixes kept (a few few-shot blocks per method), least recently used out
FOUND_PREFIXES = 8  # the most found prefixes kept, least recently used out
FOUND_PREFIX_BYTES = 64 * 2**20  # their keys and values at most, together (64 MiB)
FOUND_PREFIX_TOKENS = 1024  # a found prefix's tokens at most (or the prefill chunk, if larger): its forward is one pass


class EarlyExit(Exception):
    """Raised by a tap hook to stop a prefill once the deepest needed layer has run."""


class Taps:
    """Forward hooks that keep the latest output of the tapped modules (only while a pass that reads them runs).

    Layer 0 is the embeddings' output, layer ``n`` the final norm's (HF's ``hidden_states[-1]``), layer ``i`` in
    between the output of decoder layer ``i - 1``. With ``stop_after`` set, the hook of that layer raises
    :class:`EarlyExit` once it has stored its output, so a prefill that only needs a middle layer skips the rest.
    """

    def __init__(self, model, layers: tuple[int, ...], stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = []
        inner = model.model
        n = len(inner.layers)
        for layer in layers:
            if layer == 0:
                module = inner.embed_tokens
            elif layer == n:
                module = inner.norm  # HF hidden_states[-1] is the normed final output
            else:
                module = inner.layers[layer - 1]
            self._handles.append(module.register_forward_hook(self._hook(layer)))

    def _hook(self, layer: int):
        def fn(_module, _inputs, output):
            self.outputs[layer] = output[0] if isinstance(output, tuple) else output
            if layer == self.stop_after:
                raise EarlyExit

        return fn

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the printable stand-in character of each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _piece_decoder(tokenizer):
    """A function ``ids -> list[bytes]`` giving each token's raw bytes, chosen once per tokenizer.

    Byte-level BPE (GPT-2, SmolLM2) maps its printable stand-ins back to bytes; SentencePiece (Gemma) maps ``▁`` to a
    space and ``<0xHH>`` byte-fallback tokens to their byte; anything else decodes token by token.
    """
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    kind = type(decoder).__name__ if decoder is not None else ""
    desc = repr(decoder)
    special = set(tokenizer.all_special_ids)
    if "ByteLevel" in kind or "ByteLevel" in desc:
        byte_of = _byte_level_decoder()
        vocab: list[bytes] = []  # token id -> bytes, built on first use (one pass over the vocabulary)

        def pieces(ids: list[int]) -> list[bytes]:
            if not vocab:
                toks = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
                vocab.extend(b"" if i in special or t is None else bytes(byte_of[c] for c in t if c in byte_of)
                             for i, t in enumerate(toks))
            n = len(vocab)
            return [vocab[i] if 0 <= i < n else b"" for i in ids]  # ids past the tokenizer: model padding

        return pieces
    if "Metaspace" in desc or "ByteFallback" in desc or "Replace" in desc:

        def pieces(ids: list[int]) -> list[bytes]:
            out = []
            for i, t in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
                if i in special:
                    out.append(b"")
                elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                    out.append(bytes([int(t[3:5], 16)]))
                else:
                    out.append(t.replace("\u2581", " ").encode("utf-8"))
            return out

        return pieces
    return lambda ids: [tokenizer.decode([i], skip_special_tokens=True).encode("utf-8") for i in ids]


def runner_of(owner) -> ModelRunner:
    """``owner``'s runner: a :class:`ModelRunner` itself, or the ``runner`` of an :class:`~fastgate.engine.local.Engine`
    (the loops take either)."""
    return owner if isinstance(owner, ModelRunner) else owner.runner


class ModelRunner:
    """Prefill, decode steps and taps on one loaded model (see the module docstring).

    Args:
        model: a :class:`~fastgate.assets.models.LoadedModel`; its weights' dtype was chosen when it loaded
            (:func:`fastgate.assets.models.load`), and logits, taps and log-probs come back float32 whatever it is.
        backend: ``auto|triton|ext|torch|python`` for the gating ops (tap accumulate, prober, eigenscore); ``auto``: the
            Triton kernels on CUDA, the C++ eigenscore on CPU when the extension is built, the torch references
            otherwise (see :mod:`fastgate.ops.registry`). Chosen here, once, for every op: ``runner.ops``.
        prefix_cache: keep the KV cache of shared prompt prefixes (the few-shot examples every prompt starts with) and
            prefill only what follows them; 0 turns it off, else the fewest tokens worth caching.
        prefill_chunk: most tokens (rows × longest row) per prefill forward; None: 1024 on CPU, where smaller
            forwards run faster per token, and 0 (one forward for the batch) on GPU.
        head_columns: on a float32 CPU model, compute the LM head this many vocabulary columns at a time (bitwise the
            same logits: a row count where this machine's BLAS sums the slices in another order keeps the plain
            product; 1.2–1.5× faster at 4–32 rows on a 2-core EPYC; :mod:`fastgate.engine.lm_head`); 0: the plain
            product. This sets the shared model's head, so the last runner built on a model decides.
        step: how the packed loop runs its decode-only steps: ``compiled`` (one static step per batch and width
            bucket through ``torch.compile``, a CUDA graph on GPU: :mod:`fastgate.engine.static_step`), ``eager`` (the
            packed pass), or ``auto`` (compiled on CUDA, eager on CPU); a
            :class:`~fastgate.engine.static_step.StepConfig`
            for the compile backend and cache too. Chosen here, once.
        forward: how packed passes run the model: ``fused`` (:mod:`fastgate.engine.fused`: the same arithmetic in a
            few host operations a layer, the q/k/v and gate/up products concatenated), ``hf`` (HF's modules with
            forward hooks for the taps), or ``auto`` (fused wherever :func:`~fastgate.engine.fused.fusable` covers
            the model). Chosen here, once: ``runner.fused`` (None: HF's forward).
    """

    def __init__(self, model: LoadedModel, backend: str = "auto", prefix_cache: int = 32,
                 prefill_chunk: int | None = None, head_columns: int = DEFAULT_COLUMNS,
                 step: StepConfig | str = "auto", forward: str = "auto") -> None:
        from fastgate.ops.registry import build_ops

        # integers checked first (head_columns="a" was a bare TypeError, prefix_cache=2.5 taken)
        prefix_cache = as_integer("prefix_cache", prefix_cache)
        prefill_chunk = None if prefill_chunk is None else as_integer("prefill_chunk", prefill_chunk)
        head_columns = as_integer("head_columns", head_columns)
        self.lm = model
        self.model = model.model
        self.tokenizer = model.tokenizer
        # transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns on every call from 5.2x on
        # and goes in 5.40); the name this model's forward takes is looked up once, here
        params = inspect.signature(type(self.model).forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        # every op (docs/ARCHITECTURE.md, Ops) is bound once, for the model's device
        self.ops = build_ops(backend, model.device)
        self.backend = self.ops.backend
        self.accumulate = self.ops.accumulate  # running [M, L, d] += states [M, L, d] * weight [M], float32
        gen_cfg = getattr(self.model, "generation_config", None)
        eos: set[int] = set()
        for source in (getattr(gen_cfg, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source is not None:
                eos.update(int(x) for x in source)
        if not eos:
            raise InputError(f"model {model.name} has no EOS token")
        self.eos_ids = sorted(eos)
        self.eos_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.eos_ids[0]
        self.eos_id_set = frozenset(self.eos_ids)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.n_layers = model.n_layers
        self.hidden_size = model.hidden_size
        self.device = model.device
        self.bind_thread()  # the building thread; a server's scheduler thread binds itself when it starts
        self.dtype = next(self.model.parameters()).dtype  # the weights' (and KV cache's), chosen when the model loaded
        # chosen once: the packed decode rows' attention over a bf16 / fp16 cache on a CPU runs in float32
        # (fastgate.engine.attention.attention_dtype); prompt chunks keep the cache's dtype (equal there)
        self.attention_dtype = attention_dtype(model.device, self.dtype)
        # and over a bf16 store, through the C++ op where the extension is built: one read of the cache, not a cast
        # copy and SDPA (fastgate.ops.attention); None: the cast and torch's SDPA
        self.decode_attention = (self.ops.decode_attention if self.ops.backends["decode_attention"] == "ext"
                                 and self.dtype is torch.bfloat16 and self.attention_dtype is not None else None)
        # and which SDPA kernels the passes may use on this device (cuDNN's plans are rebuilt every decode step)
        self.sdpa_backends = sdpa_backends(model.device)
        # fresh prompts' chunks of a packed pass as one padded attention call a layer, where kernel launches cost
        # more than the padding's arithmetic: on CUDA (a CPU keeps one call a chunk: its C++ kernel, no padding)
        self.batch_prefill = torch.device(model.device).type == "cuda"
        # the one owner of KV arithmetic (truncation, a row's worst case, bytes a cell): fastgate.engine.kv_cache
        self.kv = KVCacheManager(KVGeometry.of(self.model.config, self.dtype), self.lm.max_context)
        self.kv_heads, self.head_dim = self.kv.geometry.kv_heads, self.kv.geometry.head_dim
        self._pieces = _piece_decoder(self.tokenizer)
        if prefix_cache < 0:
            raise InputError(f"prefix_cache must be >= 0, got {prefix_cache}")
        self.prefix_cache = prefix_cache
        if prefill_chunk is None:
            prefill_chunk = 1024 if torch.device(model.device).type == "cpu" else 0
        if prefill_chunk < 0:
            raise InputError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.sliced_head = slice_head(self.model, head_columns)  # chosen once, here (a width not 0 or k*256 raises)
        # prefix token ids -> per-layer (keys, values) [1, heads, P, head_dim], least recently used first
        self._prefixes: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._pinned: set[tuple[int, ...]] = set()  # the prefixes cache_prefix asked for (never evicted by found ones)
        self.prefix_hits = 0  # prompts whose prefill started from a cached prefix (for tests and stats)
        self.step_config = step if isinstance(step, StepConfig) else StepConfig(mode=step)
        self.compiled = (compiled_by_default(model.device) if self.step_config.mode == "auto"
                         else self.step_config.mode == "compiled")
        if self.compiled and hasattr(self.ops.dense_linear, "keeping_copies"):
            # a compiled step traces HF's modules: their kept copies stay plain tensors it traces (an adopted one's
            # product is not traceable, fastgate.ops.dense.OnednnDense)
            self.ops = dataclasses.replace(self.ops, dense_linear=self.ops.dense_linear.keeping_copies())
        self._static: dict[int, StaticStep] = {}  # EOS layer -> its static step (traced per bucket on first use)
        self.forward_mode = canonical_forward(forward)
        if self.forward_mode == "fused" and not fusable(self.model):
            raise InputError(f"forward='fused': {type(self.model).__name__} is not covered by fastgate.engine.fused")
        self.fused = (fused_forward(self.model) if self.forward_mode == "fused"
                      or (self.forward_mode == "auto" and fusable(self.model)) else None)
        if self.fused is not None:
            # its layers' joins replaced the parts' own weights and de-quantized copies by views of one tensor: the
            # parts' buffers are free now (qwen2.5-0.5b int4-dense: 0.55 GB resident given back)
            return_freed_memory()

    def bind_thread(self) -> None:
        """Make the model's CUDA device the calling thread's current one (torch's current device is per thread).
        CUDA graphs are captured on the current device's streams and Triton launches its kernels there: on
        ``cuda:1`` they ran on device 0 with device 1's pointers. Nothing off CUDA or on the default device."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def static_step(self, mid: int) -> StaticStep | None:
        """The static decode step keeping layer ``mid``'s EOS states (None when decode steps run eager)."""
        if not self.compiled:
            return None
        step = self._static.get(mid)
        if step is None:
            step = self._static[mid] = StaticStep(self, mid, backend=self.step_config.backend,
                                                  cache_dir=self.step_config.cache_dir, sizes=self.step_config.sizes)
        return step

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as records and ``/healthz`` name it (``float32``, ``bfloat16``)."""
        return str(self.dtype).removeprefix("torch.")

    # ------------------------------------------------------------------ tokens
    def count_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` as a prompt (special tokens included)."""
        return len(self.tokenizer(text)["input_ids"])

    def encode(self, prompts: list[str], max_new_tokens: int | list[int]) -> tuple[list[list[int]], list[bool]]:
        """Token ids of each prompt, cut on the left to leave room for its ``max_new_tokens`` (and a forced EOS)."""
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        for m in limits:
            self.kv.prompt_room(m)  # a limit leaving no room is the caller's error, before any tokenising
        rows = list(self.tokenizer(prompts)["input_ids"]) if prompts else []  # one batch call: the fast tokenizer's
        # threads, and one Python round trip instead of one a prompt (16 prompts of 700 tokens: ~6 ms on a GPU host)
        empty = [i for i, r in enumerate(rows) if not r]
        if empty:
            raise InputError(f"prompt {empty[0]} is empty after tokenisation")
        return self.kv.truncate(rows, limits)

    def pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``ids [N, T]`` and ``mask [N, T]``: every row's next token then sits in the last column."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [N, T]
        mask = torch.zeros((len(rows), width), dtype=torch.long)  # [N, T]
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        return ids.to(self.device), mask.to(self.device)

    def token_pieces(self, token_ids: list[int]) -> list[bytes]:
        """Raw bytes of each token (special tokens give ``b""``), the input of ``ops.align_words``."""
        return self._pieces(list(token_ids))

    def tokens_before(self, token_ids: list[int], n_chars: int) -> int:
        """Number of leading tokens whose text starts before character ``n_chars`` of the decoded continuation."""
        for j in range(1, len(token_ids) + 1):
            if len(self.tokenizer.decode(token_ids[:j], skip_special_tokens=True)) >= n_chars:
                return j if n_chars > 0 else 0
        return len(token_ids)

    # ------------------------------------------------------------------ KV caches and taps
    def new_cache(self, max_cells: int | None = None):
        """An empty padded-layout KV cache for this model (see :func:`fastgate.engine.kv_cache.new_cache`)."""
        return new_cache(self.model.config, max_cells=max_cells)

    def taps(self, layers: tuple[int, ...], stop_after: int | None = None) -> Taps:
        """Hooks keeping ``layers``' latest outputs until :meth:`Taps.close` (see :class:`Taps`)."""
        return Taps(self.model, layers, stop_after)

    # ------------------------------------------------------------------ prefix cache
    def cache_prefix(self, text: str) -> int:
        """Compute and keep the KV cache of ``text`` (e.g. few-shot examples) for prompts that start with its tokens.

        Returns the number of prefix tokens (0 when the prefix cache is off). Prefixes shared by all prompts of a
        batch are also found and cached automatically.
        """
        if not self.prefix_cache:
            return 0
        ids = tuple(self.tokenizer(text)["input_ids"])
        if ids:
            self.prefix_kv(ids, pinned=True)
        return len(ids)

    @torch.inference_mode()
    def prefix_kv(self, ids: tuple[int, ...], pinned: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The per-layer ``(keys, values)`` ``[1, heads, P, head_dim]`` of prefix ``ids``, computed on first use and
        kept: ``pinned`` (:meth:`cache_prefix`) among the :data:`PINNED_PREFIXES` most recently used pinned ones, else
        among the :data:`FOUND_PREFIXES` most recently used found ones, within :data:`FOUND_PREFIX_BYTES` (a prefix
        asked pinned that was found before becomes pinned)."""
        from transformers import DynamicCache

        kv = self._prefixes.get(ids)
        if kv is None:
            cache = DynamicCache(config=self.model.config)
            t = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, P]
            self.model(input_ids=t, attention_mask=torch.ones_like(t), **{self.cache_kw: cache}, use_cache=True,
                       logits_to_keep=1)
            kv = [(layer.keys, layer.values) for layer in cache.layers]  # [1, heads, P, head_dim] each
            self._prefixes[ids] = kv
        if pinned:
            self._pinned.add(ids)
        self._prefixes.move_to_end(ids)
        self._evict_prefixes(keep=ids)
        return kv

    def _evict_prefixes(self, keep: tuple[int, ...]) -> None:
        """The least recently used prefixes out past the bounds (module constants), ``keep`` (just asked) never."""
        def nbytes(kv) -> int:
            return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)

        pinned = [ids for ids in self._prefixes if ids in self._pinned]  # least recently used first
        found = [ids for ids in self._prefixes if ids not in self._pinned]
        for ids in pinned[:max(0, len(pinned) - PINNED_PREFIXES)]:
            if ids != keep:
                del self._prefixes[ids]
                self._pinned.discard(ids)
        held = sum(nbytes(self._prefixes[ids]) for ids in found)
        for i, ids in enumerate(found):
            if len(found) - i <= FOUND_PREFIXES and held <= FOUND_PREFIX_BYTES:
                break
            if ids != keep:
                held -= nbytes(self._prefixes.pop(ids))

    def cached_prefixes(self) -> list[tuple[int, ...]]:
        """The token ids of the prefixes whose KV is kept, least recently used first."""
        return list(self._prefixes)

    def cached_prefix_len(self, ids: list[int]) -> int:
        """The length of the longest cached prefix ``ids`` starts with (leaving it a token of its own), 0 if none: a
        lookup only, nothing computed and the cache's order untouched (the queue's view of a prompt's work)."""
        if not self.prefix_cache:
            return 0
        best = self._longest_cached([ids])
        return 0 if best is None else len(best)

    def _longest_cached(self, rows: list[list[int]]) -> tuple[int, ...] | None:
        """The longest cached prefix every row starts with, leaving each row a token of its own; None if none."""
        shortest = min(len(r) for r in rows)
        best: tuple[int, ...] | None = None
        for ids in self._prefixes:
            p = len(ids)
            if p < shortest and (best is None or p > len(best)) and all(tuple(r[:p]) == ids for r in rows):
                best = ids
        return best

    def shared_prefix(self, rows: list[list[int]]) -> tuple[int, ...] | None:
        """The longest cached prefix every row starts with, else (for a batch) the rows' common prefix if it is long
        enough. A row keeps at least one token of its own, whose logits start the decoding. A new prefix's keys and
        values are computed here: call it before registering taps on the model."""
        if not self.prefix_cache:
            return None
        best = self._longest_cached(rows)
        if len(rows) > 1:
            first, p = rows[0], 0
            limit = min(len(r) for r in rows) - 1
            while p < limit and all(r[p] == first[p] for r in rows):
                p += 1
            # a new prefix runs all its p tokens in a forward of its own (HF's, batch 1: SmolLM2 on a 2-core EPYC
            # 50 ms for 10 tokens, 121 ms for 73, about twice a packed pass's time a token), so it must save the
            # rows at least twice its tokens plus that fixed cost: 11 closed-book prompts that shared 7 tokens past
            # the cached few-shot block paid 127 ms to save 77 tokens, on every request of a burst. Two rows never
            # pay (2 (p - have) < 2 (p + 32)): a pair starts from a cached prefix only (Engine.cache_prefix)
            have = 0 if best is None else len(best)
            # at most FOUND_PREFIX_TOKENS or a prefill chunk (its forward is one pass outside the scheduler's
            # prefill budget: a burst sharing a 3,000-token document ran all of it in one) and within the found
            # prefixes' bytes
            p = min(p, max(FOUND_PREFIX_TOKENS, self.prefill_chunk),
                    FOUND_PREFIX_BYTES // KVGeometry.of(self.model.config, self.dtype).cell_bytes)
            if p >= self.prefix_cache and p > have and len(rows) * (p - have) >= 2 * (p + NEW_PREFIX_TOKENS):
                best = tuple(first[:p])
        if best is not None:
            self.prefix_kv(best)  # computed now: callers ask before registering hooks on the model
        return best

    def prefix_inputs(self, rows: list[list[int]], prefix: tuple[int, ...] | None, cache
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the cached ``prefix``'s keys / values (if any) into ``cache``; the rows' own tokens after it,
        left-padded ``ids [N, S]``, and the ``mask [N, P + S]`` of prefix and own tokens."""
        if prefix is None:
            return self.pad(rows)
        p, n = len(prefix), len(rows)
        for layer, (k, v) in enumerate(self.prefix_kv(prefix)):
            cache.update(k.expand(n, -1, -1, -1).contiguous(), v.expand(n, -1, -1, -1).contiguous(), layer)
        ids, own = self.pad([r[p:] for r in rows])
        return ids, torch.cat([torch.ones((n, p), dtype=own.dtype, device=own.device), own], dim=1)

    # ------------------------------------------------------------------ prefill and step
    def prefill(self, rows: list[list[int]], cache, chunked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill ``cache`` with the prompts; returns the last position's ``logits [N, V]`` and the ``mask [N, T]``.

        With a shared prefix cached, its keys / values are copied into the batch's cache and only the rest of each
        prompt runs through the model; the rows' own tokens are left-padded after the prefix (pads are masked, and
        positions come from the mask, so the result equals a full prefill).

        On CPU the prompts are prefilled in chunks of rows of similar length holding at most ``prefill_chunk`` tokens
        (padding included), then merged into one left-padded cache: a 32 × 600-token forward runs a third slower per
        token than 600-token chunks (its activations leave the caches), and sorting by length cuts padding.
        """
        prefix = self.shared_prefix(rows)
        p = 0 if prefix is None else len(prefix)
        if prefix is not None:
            self.prefix_hits += len(rows)
        chunks = self.prefill_chunks([len(r) - p for r in rows]) if chunked else [list(range(len(rows)))]
        if len(chunks) == 1 or not plain_layers(cache):
            return self.prefill_rows(rows, prefix, cache)
        from transformers import DynamicCache

        parts = []
        for idx in chunks:
            sub = DynamicCache(config=self.model.config)
            logits, mask = self.prefill_rows([rows[i] for i in idx], prefix, sub)
            parts.append((torch.tensor(idx, device=self.device), logits, mask, sub))
        n, width = len(rows), max(m.shape[1] for _, _, m, _ in parts)
        mask = torch.zeros((n, width), dtype=parts[0][2].dtype, device=self.device)  # [N, W]
        logits = torch.empty((n, parts[0][1].shape[-1]), dtype=torch.float32, device=self.device)  # [N, V]
        for idx, lg, m, _ in parts:
            mask[idx, width - m.shape[1]:] = m  # left padding: every row still ends in the last column
            logits[idx] = lg
        for layer in range(len(parts[0][3].layers)):
            k0 = parts[0][3].layers[layer].keys  # [c, heads, w, head_dim]
            keys = k0.new_zeros((n, k0.shape[1], width, k0.shape[3]))  # [N, heads, W, head_dim]
            values = keys.clone()
            for idx, _, m, sub in parts:
                keys[idx, :, width - m.shape[1]:] = sub.layers[layer].keys
                values[idx, :, width - m.shape[1]:] = sub.layers[layer].values
            cache.update(keys, values, layer)
        return logits, mask

    def prefill_chunks(self, lengths: list[int]) -> list[list[int]]:
        """Row indices grouped longest first, each group's rows × longest row within ``prefill_chunk`` tokens."""
        if not self.prefill_chunk or len(lengths) == 1:
            return [list(range(len(lengths)))]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        chunks: list[list[int]] = []
        for i in order:
            if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= self.prefill_chunk:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks

    def prefill_rows(self, rows: list[list[int]], prefix: tuple[int, ...] | None, cache
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``rows`` (after the cached ``prefix``, if any) into ``cache``: ``logits [N, V]`` float32
        and ``mask [N, T]``."""
        ids, mask = self.prefix_inputs(rows, prefix, cache)
        return self.forward(ids, mask, cache, ids.shape[1]), mask

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, cache, n_new: int) -> torch.Tensor:
        """One padded-layout pass of ``ids [N, n_new]`` after what ``cache`` holds (``mask [N, T]`` covers both);
        the last position's ``logits [N, V]``, float32."""
        positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -n_new:]  # [N, n_new]
        with sdpa_choice(self.sdpa_backends):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                **{self.cache_kw: cache},
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1, :].to(torch.float32)  # [N, V]

    @torch.inference_mode()
    def prompt_states(self, prompts: list[str], layer: int | None = None, batch_size: int = 16) -> torch.Tensor:
        """Hidden state at ``layer`` of each prompt's last token, from a prefill only (no decoding).

        This is CBDR's pre-answer state: one batched prefill per group of prompts, stopped right after ``layer``
        (default ``n_layers // 2``), so the layers above it never run. A cached shared prefix (the few-shot block)
        is not recomputed, and groups are formed as in the chunked prefill (at most ``batch_size`` prompts each).

        Returns:
            ``[B, d]`` float32 on the runner's device.
        """
        if not prompts:
            raise InputError("prompt_states: no prompts")
        layer = self.n_layers // 2 if layer is None else layer
        check_tap_layers((layer,), self.n_layers)
        from transformers import DynamicCache

        rows = self.encode(prompts, 1)[0]
        prefix = self.shared_prefix(rows)  # a new shared prefix is computed here, before the hooks exist
        p = 0 if prefix is None else len(prefix)
        if prefix is not None:
            self.prefix_hits += len(rows)
        out = torch.empty((len(rows), self.hidden_size), dtype=torch.float32, device=self.device)  # [B, d]
        for chunk in self.prefill_chunks([len(r) - p for r in rows]):
            for start in range(0, len(chunk), batch_size):
                idx = chunk[start:start + batch_size]
                hooks = self.taps((layer,), stop_after=layer)
                try:
                    self.prefill_rows([rows[i] for i in idx], prefix, DynamicCache(config=self.model.config))
                except EarlyExit:
                    pass
                finally:
                    hooks.close()
                # left padding puts every row's last token in the last column
                out[torch.tensor(idx, device=self.device)] = hooks.outputs[layer][:, -1, :].to(torch.float32)
        return out
