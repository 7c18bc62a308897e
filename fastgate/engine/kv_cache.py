"""KV memory: :class:`KVCacheManager`, the one object that says what a row of the cache costs, and a KV cache whose
layers append in place.

:class:`KVCacheManager` (one per model runner, ``runner.kv``; the scheduler's admission asks it through
``engine.kv``) owns the KV geometry (:class:`KVGeometry`: layers, KV heads, head size, dtype, and so the bytes one
cell costs), the prompt's truncation to the context (room for the new tokens and a forced EOS step) and a row's
worst case (:data:`EXTRA_STEPS` beyond its new tokens: the forced EOS and the flush step). The decode loops size
their buffers with it and admission bounds the KV budget with it, so the rule is written once, like vLLM's
``KVCacheManager``.

HF's ``DynamicLayer`` appends a decode step's keys / values with ``torch.cat`` of the whole cache: every step reads
and writes the entire cache once more (at batch 16 with 600-token contexts, 442 MB a step for SmolLM2-135M).
:class:`GrowingLayer` keeps spare capacity after the filled columns and writes the new ones in place; the model sees
a view of the filled part, exactly what ``DynamicLayer`` would hold. When the capacity runs out, or when code outside
replaces the layer's tensors (batch selection, a merge), the next append moves them into a fresh buffer with room to
grow (amortised: a quarter of the length, at least ``spare`` columns).

A cache built with ``max_cells`` never gives a layer's buffer more than that many rows × columns of spare: the
spare shrinks to fit (a need beyond it is still met exactly; keeping needs within the budget is the scheduler's
admission control, see :class:`fastgate.scheduler.Scheduler`).

Layers that are not plain growing layers (sliding windows) are left as HF builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgate.errors import InputError

__all__ = ["EXTRA_STEPS", "GrowingLayer", "KVCacheManager", "KVGeometry", "cache_bytes", "cell_bytes", "new_cache",
           "plain_layers", "within_cells"]

EXTRA_STEPS = 2  # the columns a row takes beyond its prompt and new tokens: the forced EOS step and the flush step


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's keys and values: ``layers`` × (keys, values) × ``kv_heads`` × ``head_dim`` of
    ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> KVGeometry:
        """The geometry of a model ``config`` (its text config for a multimodal one) with caches of ``dtype``."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(text.num_hidden_layers, heads, head_dim, dtype)

    @property
    def cell_bytes(self) -> int:
        """Bytes one token of one sequence takes in the KV cache of every layer (keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class KVCacheManager:
    """What KV memory a generation takes, for one model: the prompt's truncation, a row's worst case in columns and
    the budget in cells (rows × columns). Computes; allocates nothing (the loops' buffers do, sized by it).

    Args:
        geometry: the model's :class:`KVGeometry`.
        max_context: the model's context in tokens (prompt, new tokens and the forced EOS step must fit).
    """

    def __init__(self, geometry: KVGeometry, max_context: int) -> None:
        self.geometry = geometry
        self.max_context = max_context

    @property
    def cell_bytes(self) -> int:
        """Bytes one cell (one token of one row, every layer) costs."""
        return self.geometry.cell_bytes

    def budget_cells(self, budget_bytes: int | None) -> int | None:
        """A budget in bytes as cells (at least one); None (no bound) stays None."""
        return None if budget_bytes is None else max(1, budget_bytes // self.cell_bytes)

    def prompt_room(self, max_new_tokens: int) -> int:
        """The most prompt tokens a row generating ``max_new_tokens`` keeps (room for the forced EOS step).

        Raises:
            InputError: ``max_new_tokens`` leaves no room for a prompt in the context.
        """
        room = self._room(max_new_tokens)
        if room < 1:
            raise InputError(f"max_new_tokens={max_new_tokens} leaves no room in the {self.max_context}-token context")
        return room

    def truncate(self, rows: list[list[int]], max_new_tokens: list[int]) -> tuple[list[list[int]], list[bool]]:
        """Each prompt's token ids cut on the left to its :meth:`prompt_room` (the end holds the question), and
        whether it was cut."""
        rooms = [self.prompt_room(m) for m in max_new_tokens]
        truncated = [len(r) > b for r, b in zip(rows, rooms)]
        return [r[-b:] if t else r for r, t, b in zip(rows, truncated, rooms)], truncated

    def prompt_tokens(self, tokens: int, max_new_tokens: int) -> int:
        """The prompt tokens a row keeps of ``tokens`` (after :meth:`truncate`)."""
        return min(tokens, self._room(max_new_tokens))

    def _room(self, max_new_tokens: int) -> int:
        return self.max_context - max_new_tokens - 1  # the forced EOS step takes the last column

    @staticmethod
    def steps_left(max_new_tokens: int, generated: int = 0) -> int:
        """The most columns a row that has generated ``generated`` of ``max_new_tokens`` may still add."""
        return max_new_tokens - generated + EXTRA_STEPS

    @classmethod
    def row_columns(cls, prompt: int, max_new_tokens: int, generated: int = 0) -> int:
        """A row's worst case in columns: its prompt (or its length now) and every step it may still take."""
        return prompt + cls.steps_left(max_new_tokens, generated)


def _dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def plain_layers(cache) -> bool:
    """Whether every layer of ``cache`` keeps all its columns (no sliding window): caches of different lengths can
    then be aligned by left padding."""
    base = _dynamic_layer()
    return all(isinstance(layer, base) and not getattr(layer, "is_sliding", False) for layer in cache.layers)


def new_cache(config, max_cells: int | None = None):
    """An empty ``DynamicCache`` for ``config`` whose plain layers are :class:`GrowingLayer` (buffers of at most
    ``max_cells`` rows × columns of spare each, see the module docstring)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    grow = GrowingLayer.cls()
    cache.layers = [grow() if type(layer) is _dynamic_layer() else layer for layer in cache.layers]
    for layer in cache.layers:
        if isinstance(layer, grow):
            layer.max_cells = max_cells
    return cache


def within_cells(rows: int, cols: int, need_rows: int, need_cols: int, max_cells: int | None) -> tuple[int, int]:
    """A buffer of ``rows`` × ``cols`` (spare included) with less spare, rows first, where it would pass
    ``max_cells``; never below ``need_rows`` × ``need_cols`` (a need beyond the bound is still met)."""
    if max_cells is not None and rows * cols > max_cells:
        rows = max(need_rows, min(rows, max_cells // cols))
        if rows * cols > max_cells:
            cols = max(need_cols, max_cells // rows)
    return rows, cols


def cell_bytes(config, dtype: torch.dtype) -> int:
    """Bytes one token of one sequence takes in the KV cache of every layer (keys and values)."""
    return KVGeometry.of(config, dtype).cell_bytes


def cache_bytes(cache) -> int:
    """Bytes a cache holds: its growing layers' whole buffers (spare included), other layers' tensors."""
    if cache is None:
        return 0
    total = 0
    for layer in cache.layers:
        buf = getattr(layer, "_buf_k", None)
        if buf is not None:
            total += 2 * buf.numel() * buf.element_size()
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4 and not (buf is not None and keys is layer._view_k):
            total += 2 * keys.numel() * keys.element_size()  # tensors set from outside (a fork, a selection)
    return total


class GrowingLayer:
    """Namespace for the lazily built ``DynamicLayer`` subclass (transformers is an optional import here)."""

    _cls = None

    @classmethod
    def cls(cls):
        if cls._cls is None:
            cls._cls = _make_growing_layer(_dynamic_layer())
        return cls._cls


def _make_growing_layer(base):
    class _GrowingLayer(base):
        spare = 64  # the fewest spare columns a new buffer gets
        spare_rows = 4  # the fewest spare rows (sequences that may join without moving the others)
        max_cells: int | None = None  # rows × columns the spare may fill up to (set by new_cache)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self._buf_k = self._buf_v = None  # [rows capacity, heads, columns capacity, head_dim]

        def has_room(self, rows: int, cols: int) -> bool:
            """Whether ``rows`` rows of ``cols`` columns can be written into this layer's own buffer in place."""
            return (getattr(self, "_buf_k", None) is not None and self._ours() and rows <= self._buf_k.shape[0]
                    and cols <= self._buf_k.shape[2])

        def _ours(self) -> bool:
            """Whether ``keys`` is still the view of our buffer we last handed out (nobody replaced it)."""
            return self._buf_k is not None and self.keys is self._view_k

        def _publish(self, m: int, t: int) -> None:
            self._view_k, self._view_v = self._buf_k[:m, :, :t], self._buf_v[:m, :, :t]  # views: no copy
            self.keys, self.values = self._view_k, self._view_v

        def _reallocate(self, m: int, need: int, like: torch.Tensor, keys=None, values=None) -> None:
            """Fresh buffers with room for ``m`` rows × ``need`` columns and spare; ``keys`` / ``values``
            [m, h, t, d] copied in (once) as the first t columns."""
            rows, cols = within_cells(m + max(self.spare_rows, m // 2), need + max(self.spare, need // 4), m, need,
                                      self.max_cells)
            h, d = like.shape[1], like.shape[3]
            self._buf_k = like.new_zeros((rows, h, cols, d))
            self._buf_v = like.new_zeros((rows, h, cols, d))
            t = 0 if keys is None else keys.shape[2]
            if t:
                self._buf_k[:m, :, :t] = keys
                self._buf_v[:m, :, :t] = values
            self._publish(m, t)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            m, n = key_states.shape[0], key_states.shape[-2]  # key_states [M, heads, n, head_dim]
            t = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            if not (self._ours() and self.keys.shape[0] == m and t + n <= self._buf_k.shape[2]):
                self._reallocate(m, t + n, key_states, self.keys if t else None, self.values if t else None)
            self._buf_k[:m, :, t:t + n] = key_states
            self._buf_v[:m, :, t:t + n] = value_states
            self._publish(m, t + n)
            return self.keys, self.values

        def join(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Add rows ``keys`` / ``values`` [N, heads, T', head_dim] after ours, right-aligned (left-padded with
            zeros) to our width T. In place when the buffer has room for them and T' <= T; else everything moves
            once to a bigger buffer."""
            m, t = self.keys.shape[0], self.keys.shape[2]
            n, tb = keys.shape[0], keys.shape[2]
            width = max(t, tb)
            if not (self._ours() and m + n <= self._buf_k.shape[0] and width == t):
                old_k, old_v = self.keys, self.values
                self._reallocate(m + n, width, keys)
                self._buf_k[:m, :, width - t:width] = old_k  # right-aligned: left padding stays zero
                self._buf_v[:m, :, width - t:width] = old_v
            else:
                self._buf_k[m:m + n, :, :width] = 0  # a row that left may have used these slots
                self._buf_v[m:m + n, :, :width] = 0
            self._buf_k[m:m + n, :, width - tb:width] = keys
            self._buf_v[m:m + n, :, width - tb:width] = values
            self._publish(m + n, width)

        def select(self, index: torch.Tensor, first: int = 0) -> None:
            """Keep rows ``index`` and columns from ``first`` on (a compaction: one copy into a fresh buffer)."""
            keys, values = self.keys[index, :, first:], self.values[index, :, first:]
            self._reallocate(keys.shape[0], keys.shape[2], keys, keys, values)

    _GrowingLayer.__name__ = _GrowingLayer.__qualname__ = "GrowingLayer"
    return _GrowingLayer
