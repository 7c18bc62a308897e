"""A KV cache whose layers append in place.

HF's ``DynamicLayer`` appends a decode step's keys / values with ``torch.cat`` of the whole cache: every step reads
and writes the entire cache once more (at batch 16 with 600-token contexts, 442 MB a step for SmolLM2-135M).
:class:`GrowingLayer` keeps spare capacity after the filled columns and writes the new ones in place; the model sees
a view of the filled part, exactly what ``DynamicLayer`` would hold. When the capacity runs out, or when code outside
replaces the layer's tensors (batch selection, a merge), the next append moves them into a fresh buffer with room to
grow (amortised: a quarter of the length, at least ``spare`` columns).

Layers that are not plain growing layers (sliding windows) are left as HF builds them.
"""

from __future__ import annotations

import torch

__all__ = ["GrowingLayer", "new_cache", "plain_layers"]


def _dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def plain_layers(cache) -> bool:
    """Whether every layer of ``cache`` keeps all its columns (no sliding window): caches of different lengths can
    then be aligned by left padding."""
    base = _dynamic_layer()
    return all(isinstance(layer, base) and not getattr(layer, "is_sliding", False) for layer in cache.layers)


def new_cache(config):
    """An empty ``DynamicCache`` for ``config`` whose plain layers are :class:`GrowingLayer`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    grow = GrowingLayer.cls()
    cache.layers = [grow() if type(layer) is _dynamic_layer() else layer for layer in cache.layers]
    return cache


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

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self._buf_k = self._buf_v = None

        def _in_place(self, n: int) -> bool:
            k, buf = self.keys, self._buf_k
            return (buf is not None and k.dim() == 4 and k.data_ptr() == buf.data_ptr() and k.stride() == buf.stride()
                    and k.shape[0] == buf.shape[0] and k.shape[2] + n <= buf.shape[2])

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]  # key_states [B, heads, n, head_dim]
            t = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            if not self._in_place(n):
                cap = t + n + max(self.spare, (t + n) // 4)
                b, h, _, d = key_states.shape
                buf_k = key_states.new_empty((b, h, cap, d))  # [B, heads, capacity, head_dim]
                buf_v = value_states.new_empty((b, value_states.shape[1], cap, value_states.shape[3]))
                if t:
                    buf_k[:, :, :t] = self.keys
                    buf_v[:, :, :t] = self.values
                self._buf_k, self._buf_v = buf_k, buf_v
            self._buf_k[:, :, t:t + n] = key_states
            self._buf_v[:, :, t:t + n] = value_states
            self.keys, self.values = self._buf_k[:, :, :t + n], self._buf_v[:, :, :t + n]  # views: no copy
            return self.keys, self.values

    _GrowingLayer.__name__ = _GrowingLayer.__qualname__ = "GrowingLayer"
    return _GrowingLayer
