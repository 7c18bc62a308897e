"""The decoding engine: one batched decode loop over an HF causal LM with a KV cache, reading the gates' signals as
it goes.

Why our own loop instead of ``model.generate``: the gates need per-step hidden states of a few layers (summed on the
fly, never stored per token), log-probs of the chosen tokens, a forced EOS step after a sample stops, and k samples
that share one prefill. ``generate(output_hidden_states=True)`` materialises every layer at every step instead.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.errors import InputError
from fastgate.kv_cache import plain_layers
from fastgate.lm_head import DEFAULT_COLUMNS, slice_head
from fastgate.models import LoadedModel
from fastgate.ops.reference import accumulate_taps

__all__ = ["Engine", "Generation", "GenerationBatch", "accumulate_taps"]

FinishReason = Literal["eos", "stop", "length"]

# Per-sequence decode states.
_ACTIVE, _FLUSH_LAST, _FLUSH_EOS, _DONE = 0, 1, 2, 3


@dataclass
class Generation:
    """One generated sequence."""

    text: str  # decoded continuation, cut before the first stop string
    token_ids: list[int]  # every generated token, including EOS / stop-string tokens
    token_logprobs: list[float]  # log p(token) under the model (temperature 1), one per token_ids entry
    answer_tokens: int  # how many leading tokens make up `text` (excludes EOS and stop-string tokens)
    finish_reason: FinishReason
    prompt_tokens: int
    truncated: bool  # the prompt was cut on the left to fit the context
    stop_string: str | None = None  # the stop string that ended the sequence (finish_reason "stop")


@dataclass
class GenerationBatch:
    """The result of :meth:`Engine.generate` for B prompts × k samples (prompt-major order)."""

    sequences: list[Generation]
    running_sum: torch.Tensor | None = None  # [N, L, d] float32, sum of generated-token states per tapped layer
    count: torch.Tensor | None = None  # [N] float32, tokens in the running sums
    pre_answer: torch.Tensor | None = None  # [N, d] float32
    eos_state: torch.Tensor | None = None  # [N, d] float32
    layers: tuple[int, ...] = ()
    steps: int = 0  # tokens chosen per sequence at most (decode iterations)
    forwards: int = 0  # decode forward passes: one per fed token, plus the flushes that read the last token's states
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


class _EarlyExit(Exception):
    """Raised by a tap hook to stop a prefill once the deepest needed layer has run."""


class _Taps:
    """Forward hooks that keep the latest output of the tapped modules (only while a generate call runs).

    With ``stop_after`` set, the hook of that layer raises :class:`_EarlyExit` once it has stored its output, so a
    prefill that only needs a middle layer skips the rest of the network.
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
                raise _EarlyExit

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


def _process_logits(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
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


def _per_prompt(value, kind: type, n: int, what: str) -> list:
    """``value`` (one ``kind``, None for the default, or one per prompt) as a list of ``n``."""
    if value is None or isinstance(value, kind):
        return [value if value is not None else kind()] * n
    out = [v if v is not None else kind() for v in value]
    if len(out) != n:
        raise InputError(f"generate: {len(out)} {what} for {n} prompts")
    if any(not isinstance(v, kind) for v in out):
        raise InputError(f"generate: {what} must be {kind.__name__} objects")
    return out


class Engine:
    """Batched generation with taps on one loaded model.

    Args:
        model: a :class:`~fastgate.models.LoadedModel`.
        backend: ``auto|triton|ext|torch|python`` for the gating ops (tap accumulate, prober, eigenscore); ``auto``: the
            Triton kernels on CUDA, the C++ eigenscore on CPU when the extension is built, the torch references
            otherwise (see :mod:`fastgate.ops.registry`). Chosen here, once, for every op: ``engine.ops``.
        prefix_cache: keep the KV cache of shared prompt prefixes (the few-shot examples every prompt starts with) and
            prefill only what follows them; 0 turns it off, else the fewest tokens worth caching.
        prefill_chunk: most tokens (rows × longest row) per prefill forward; None: 1024 on CPU, where smaller
            forwards run faster per token, and 0 (one forward for the batch) on GPU.
        head_columns: on a float32 CPU model, compute the LM head this many vocabulary columns at a time (bitwise the
            same logits: a row count where this machine's BLAS sums the slices in another order keeps the plain
            product; 1.2–1.5× faster at 4–32 rows on a 2-core EPYC; :mod:`fastgate.lm_head`); 0: the plain product.
            This sets the shared model's head, so the last engine built on a model decides.
    """

    def __init__(self, model: LoadedModel, backend: str = "auto", prefix_cache: int = 32,
                 prefill_chunk: int | None = None, head_columns: int = DEFAULT_COLUMNS) -> None:
        from fastgate.ops.backend import GateOps
        from fastgate.ops.registry import build_ops

        self.lm = model
        self.model = model.model
        self.tokenizer = model.tokenizer
        # transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns on every call from 5.2x on
        # and goes in 5.40); the name this model's forward takes is looked up once, here
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # every op of SPEC §4 is bound once, for the model's device; gate_ops is the gating ops' view of the same choice
        self.ops = build_ops(backend, model.device)
        self.gate_ops = GateOps.of(self.ops)
        self.backend = self.ops.backend
        self._accumulate = self.ops.accumulate
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
        self.device = model.device
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
        self.prefix_hits = 0  # prompts whose prefill started from a cached prefix (for tests and stats)

    # ------------------------------------------------------------------ helpers
    def count_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` as a prompt (special tokens included)."""
        return len(self.tokenizer(text)["input_ids"])

    def _encode(self, prompts: list[str], max_new_tokens: int | list[int]) -> tuple[list[list[int]], list[bool]]:
        """Token ids of each prompt, cut on the left to leave room for its ``max_new_tokens`` (and a forced EOS)."""
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        budgets = [self.lm.max_context - m - 1 for m in limits]  # room for the forced EOS step
        for m, budget in zip(limits, budgets):
            if budget < 1:
                raise InputError(f"max_new_tokens={m} leaves no room in the {self.lm.max_context}-token context")
        rows = [self.tokenizer(p)["input_ids"] for p in prompts]
        empty = [i for i, r in enumerate(rows) if not r]
        if empty:
            raise InputError(f"prompt {empty[0]} is empty after tokenisation")
        truncated = [len(r) > b for r, b in zip(rows, budgets)]
        rows = [r[-b:] if t else r for r, t, b in zip(rows, truncated, budgets)]  # keep the end: it holds the question
        return rows, truncated

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``ids [N, T]`` and ``mask [N, T]``: every row's next token then sits in the last column."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        return ids.to(self.device), mask.to(self.device)

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
            self._prefix_kv(ids)
        return len(ids)

    @torch.inference_mode()
    def _prefix_kv(self, ids: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from transformers import DynamicCache

        kv = self._prefixes.get(ids)
        if kv is None:
            cache = DynamicCache(config=self.model.config)
            t = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, P]
            self.model(input_ids=t, attention_mask=torch.ones_like(t), **{self._cache_kw: cache}, use_cache=True,
                       logits_to_keep=1)
            kv = [(layer.keys, layer.values) for layer in cache.layers]  # [1, heads, P, head_dim] each
            self._prefixes[ids] = kv
            while len(self._prefixes) > 16:  # a few few-shot blocks per method; bounded memory
                self._prefixes.popitem(last=False)
        self._prefixes.move_to_end(ids)
        return kv

    def _shared_prefix(self, rows: list[list[int]]) -> tuple[int, ...] | None:
        """The longest cached prefix every row starts with, else (for a batch) the rows' common prefix if it is long
        enough. A row keeps at least one token of its own, whose logits start the decoding."""
        if not self.prefix_cache:
            return None
        shortest = min(len(r) for r in rows)
        best: tuple[int, ...] | None = None
        for ids in self._prefixes:
            p = len(ids)
            if p < shortest and (best is None or p > len(best)) and all(tuple(r[:p]) == ids for r in rows):
                best = ids
        if len(rows) > 1:
            first, p = rows[0], 0
            limit = shortest - 1
            while p < limit and all(r[p] == first[p] for r in rows):
                p += 1
            if p >= self.prefix_cache and (best is None or p > len(best)):
                best = tuple(first[:p])
        if best is not None:
            self._prefix_kv(best)  # computed now: callers ask before registering hooks on the model
        return best

    def _prefill(self, rows: list[list[int]], cache, chunked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill ``cache`` with the prompts; returns the last position's ``logits [N, V]`` and the ``mask [N, T]``.

        With a shared prefix cached, its keys / values are copied into the batch's cache and only the rest of each
        prompt runs through the model; the rows' own tokens are left-padded after the prefix (pads are masked, and
        positions come from the mask, so the result equals a full prefill).

        On CPU the prompts are prefilled in chunks of rows of similar length holding at most ``prefill_chunk`` tokens
        (padding included), then merged into one left-padded cache: a 32 × 600-token forward runs a third slower per
        token than 600-token chunks (its activations leave the caches), and sorting by length cuts padding.
        """
        prefix = self._shared_prefix(rows)
        p = 0 if prefix is None else len(prefix)
        if prefix is not None:
            self.prefix_hits += len(rows)
        chunks = self._prefill_chunks([len(r) - p for r in rows]) if chunked else [list(range(len(rows)))]
        if len(chunks) == 1 or not plain_layers(cache):
            return self._prefill_rows(rows, prefix, cache)
        from transformers import DynamicCache

        parts = []
        for idx in chunks:
            sub = DynamicCache(config=self.model.config)
            logits, mask = self._prefill_rows([rows[i] for i in idx], prefix, sub)
            parts.append((torch.tensor(idx, device=self.device), logits, mask, sub))
        n, width = len(rows), max(m.shape[1] for _, _, m, _ in parts)
        mask = torch.zeros((n, width), dtype=parts[0][2].dtype, device=self.device)  # [N, W]
        logits = torch.empty((n, parts[0][1].shape[-1]), dtype=torch.float32, device=self.device)  # [N, V]
        for idx, lg, m, _ in parts:
            mask[idx, width - m.shape[1]:] = m  # left padding: every row still ends in the last column
            logits[idx] = lg
        for layer in range(len(parts[0][3].layers)):
            k0 = parts[0][3].layers[layer].keys  # [c, heads, w, head_dim]
            keys = k0.new_zeros((n, k0.shape[1], width, k0.shape[3]))
            values = keys.clone()
            for idx, _, m, sub in parts:
                keys[idx, :, width - m.shape[1]:] = sub.layers[layer].keys
                values[idx, :, width - m.shape[1]:] = sub.layers[layer].values
            cache.update(keys, values, layer)
        return logits, mask

    def _prefill_chunks(self, lengths: list[int]) -> list[list[int]]:
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

    def _prefill_rows(self, rows: list[list[int]], prefix: tuple[int, ...] | None, cache
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``rows`` (after the cached ``prefix``, if any) into ``cache``."""
        ids, mask = self._prefix_inputs(rows, prefix, cache)
        return self._forward(ids, mask, cache, ids.shape[1]), mask

    def _prefix_inputs(self, rows: list[list[int]], prefix: tuple[int, ...] | None, cache
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the cached ``prefix``'s keys / values (if any) into ``cache``; the rows' own tokens after it,
        left-padded ``ids [N, S]``, and the ``mask [N, P + S]`` of prefix and own tokens."""
        if prefix is None:
            return self._pad(rows)
        p, n = len(prefix), len(rows)
        for layer, (k, v) in enumerate(self._prefix_kv(prefix)):
            cache.update(k.expand(n, -1, -1, -1).contiguous(), v.expand(n, -1, -1, -1).contiguous(), layer)
        ids, own = self._pad([r[p:] for r in rows])
        return ids, torch.cat([torch.ones((n, p), dtype=own.dtype, device=own.device), own], dim=1)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache, n_new: int) -> torch.Tensor:
        positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -n_new:]  # [N, n_new]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].to(torch.float32)  # [N, V]

    def token_pieces(self, token_ids: list[int]) -> list[bytes]:
        """Raw bytes of each token (special tokens give ``b""``), the input of :func:`fastgate.ops.align_words`."""
        return self._pieces(list(token_ids))

    @torch.inference_mode()
    def prompt_states(self, prompts: list[str], layer: int | None = None, batch_size: int = 16) -> torch.Tensor:
        """Hidden state at ``layer`` of each prompt's last token, from a prefill only (no decoding).

        This is CBDR's pre-answer state: one batched prefill per group of prompts, stopped right after ``layer``
        (default ``n_layers // 2``), so the layers above it never run. A cached shared prefix (the few-shot block)
        is not recomputed, and groups are formed as in :meth:`generate`'s chunked prefill (at most ``batch_size``
        prompts each).

        Returns:
            ``[B, d]`` float32 on the engine's device.
        """
        if not prompts:
            raise InputError("prompt_states: no prompts")
        layer = self.n_layers // 2 if layer is None else layer
        if not 0 <= layer <= self.n_layers:
            raise InputError(f"tap layer {layer} out of range 0..{self.n_layers}")
        from transformers import DynamicCache

        rows = self._encode(prompts, 1)[0]
        prefix = self._shared_prefix(rows)  # a new shared prefix is computed here, before the hooks exist
        p = 0 if prefix is None else len(prefix)
        if prefix is not None:
            self.prefix_hits += len(rows)
        out = torch.empty((len(rows), self.lm.hidden_size), dtype=torch.float32, device=self.device)  # [B, d]
        for chunk in self._prefill_chunks([len(r) - p for r in rows]):
            for start in range(0, len(chunk), batch_size):
                idx = chunk[start:start + batch_size]
                hooks = _Taps(self.model, (layer,), stop_after=layer)
                try:
                    self._prefill_rows([rows[i] for i in idx], prefix, DynamicCache(config=self.model.config))
                except _EarlyExit:
                    pass
                finally:
                    hooks.close()
                # left padding puts every row's last token in the last column
                out[torch.tensor(idx, device=self.device)] = hooks.outputs[layer][:, -1, :].to(torch.float32)
        return out

    # ------------------------------------------------------------------ main entry
    @torch.inference_mode()
    def generate(
        self,
        prompts: list[str],
        config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        taps: TapSpec | Sequence[TapSpec | None] | None = None,
        k: int | Sequence[int] = 1,
        seeds: Sequence[int | None] | None = None,
    ) -> GenerationBatch:
        """Generate for a batch of prompts.

        Args:
            prompts: B prompt strings (left-padded into one batch).
            config: decoding settings, one for the batch or one per prompt (rows may then differ in temperature,
                top-k, top-p, stop strings, max tokens and greedy vs sampled).
            taps: signals to capture, one :class:`~fastgate.config.TapSpec` for the batch or one per prompt; with
                per-prompt taps the running sums cover the union of the layers asked for (``batch.layers``), and
                rows that asked for none of them are still summed (their sums are simply not read).
            k: samples per prompt (an int, or one per prompt); the k samples share the prompt's prefill (KV cache
                expanded after it).
            seeds: one sampling seed per prompt. Sample j of prompt i then draws from its own generator seeded with
                ``(seeds[i], j)``, so its tokens do not depend on what else is in the batch. With one config and no
                seeds, ``config.seed`` seeds one generator shared by the whole batch; with per-prompt configs a
                sampled row without a seed draws from its own generator seeded with its config's seed (0 if None).

        Returns:
            A :class:`GenerationBatch` with ``Σ k_i`` sequences, prompt-major (the samples of prompt i follow those of
            prompt i-1).
        """

        if not prompts:
            raise InputError("generate: no prompts")
        b = len(prompts)
        per_row = not (config is None or isinstance(config, GenerationConfig)) or not (
            taps is None or isinstance(taps, TapSpec)) or not isinstance(k, int)
        cfgs = _per_prompt(config, GenerationConfig, b, "configs")
        row_taps = _per_prompt(taps, TapSpec, b, "taps")
        ks = [k] * b if isinstance(k, int) else list(k)
        if len(ks) != b:
            raise InputError(f"generate: {len(ks)} sample counts for {b} prompts")
        if any(not isinstance(x, int) or x < 1 for x in ks):
            raise InputError(f"k must be >= 1, got {k}")
        if seeds is not None and len(seeds) != b:
            raise InputError(f"generate: {len(seeds)} seeds for {b} prompts")
        mids = {t.mid_layer if t.mid_layer is not None else self.n_layers // 2
                for t in row_taps if t.pre_answer or t.eos_state}
        if len(mids) > 1:
            raise InputError(f"generate: rows ask for pre-answer / EOS states at different layers {sorted(mids)}")
        mid = mids.pop() if mids else (row_taps[0].mid_layer if row_taps[0].mid_layer is not None
                                       else self.n_layers // 2)
        if per_row:
            layers = tuple(sorted({x for t in row_taps for x in t.layers}))
        else:
            layers = tuple(row_taps[0].layers)
        for layer in (*layers, mid):
            if not 0 <= layer <= self.n_layers:
                raise InputError(f"tap layer {layer} out of range 0..{self.n_layers}")
        want_pre = any(t.pre_answer for t in row_taps)
        want_eos = any(t.eos_state for t in row_taps)
        from fastgate.decode import DecodeLoop

        # One config: sampled rows without a seed share one generator (its config's seed), and with no seeds at all
        # they draw together over the whole batch (their draws then depend on the batch, as they always have).
        generator = None
        if not per_row and cfgs[0].do_sample and cfgs[0].seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(cfgs[0].seed)
        loop = DecodeLoop(self, mid, shared_rng=not per_row and seeds is None, generator=generator)
        specs = [(prompts[i], cfgs[i], row_taps[i], ks[i], seeds[i] if seeds is not None else None) for i in range(b)]
        (ticket,) = loop.add(specs, one_ticket=(layers, want_pre, want_eos), per_row=per_row)
        while ticket.result is None:
            loop.step()
        return ticket.result

    def _tokens_before(self, token_ids: list[int], n_chars: int) -> int:
        """Number of leading tokens whose text starts before character ``n_chars`` of the decoded continuation."""
        for j in range(1, len(token_ids) + 1):
            if len(self.tokenizer.decode(token_ids[:j], skip_special_tokens=True)) >= n_chars:
                return j if n_chars > 0 else 0
        return len(token_ids)
