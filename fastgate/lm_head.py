"""The LM head computed in column slices on CPU.

Why: the output projection ``hidden [M, K] @ W.T`` with ``W [V, K]`` and a 49k–152k-token vocabulary is the largest
product of a decode step (SmolLM2-135M: 28 M of its 135 M weights; Qwen2.5-0.5B: 136 M of 494 M). With torch 2.13's
MKL sgemm on this 2-core EPYC it runs 25–30% slower at 4–32 rows than the same product taken in 2048-column slices
(``bench/bench_lm_head.py``). Every logit is the same K-long dot product either way, so the results are bitwise the
same (tests check it on awkward shapes, and the real-model replay checks whole answers). At one row the slices gain
nothing, and on GPU cuBLAS picks its own tiling, so both keep the plain product.

:func:`slice_head` turns a model's ``lm_head`` into a :class:`SlicedHead` once, when the engine is built
(the choice is made at construction, never per call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastgate.errors import InputError

__all__ = ["DEFAULT_COLUMNS", "QUANTUM", "SlicedHead", "slice_edges", "slice_head", "sliced_linear"]

QUANTUM = 256  # slice widths and offsets that give bitwise the plain product (sliced_linear)
DEFAULT_COLUMNS = 2048  # fastest of 1024 / 2048 / 4096 for both embedded vocabularies at 4–32 rows (bench_lm_head)


def slice_edges(n: int, columns: int) -> list[int]:
    """Slice boundaries over ``n`` output features: every ``columns`` from 0, with a last slice narrower than half a
    slice merged into the one before it (``[0, c, 2c, ..., n]``)."""
    edges = [*range(0, n, columns), n]
    if len(edges) > 2 and edges[-1] - edges[-2] < columns // 2:
        edges.pop(-2)
    return edges


def sliced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  columns: int = DEFAULT_COLUMNS) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed ``columns`` output features at a time into one output.

    ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or None; returns ``[..., N]`` (``x``'s dtype). Slices start at
    multiples of ``columns``, a multiple of :data:`QUANTUM`: with MKL, slices of other widths or offsets run other
    kernels and can differ from the plain product in the last bit (measured: 156 of 648 awkward shapes for evenly
    spread widths, none for these).

    Raises:
        InputError: ``columns`` is not a positive multiple of :data:`QUANTUM`, or ``x``'s last dimension is not
            ``weight``'s second.
    """
    if columns < QUANTUM or columns % QUANTUM:
        raise InputError(f"sliced_linear: columns must be a positive multiple of {QUANTUM}, got {columns}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise InputError(f"sliced_linear: x [..., {x.shape[-1]}] does not match weight {list(weight.shape)}")
    edges = slice_edges(weight.shape[0], columns)
    if len(edges) == 2:
        return F.linear(x, weight, bias)
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))  # [..., N]
    for first, last in zip(edges, edges[1:]):
        out[..., first:last] = F.linear(x, weight[first:last], None if bias is None else bias[first:last])
    return out


class SlicedHead(nn.Linear):
    """An ``nn.Linear`` LM head computed in column slices of :attr:`columns` output features when ``x`` holds two
    rows or more (one row: the plain product)."""

    columns: int = DEFAULT_COLUMNS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., V]
        if x.numel() <= x.shape[-1]:
            return super().forward(x)  # one row: the plain product is as fast
        return sliced_linear(x, self.weight, self.bias, self.columns)


def slice_head(model: nn.Module, columns: int = DEFAULT_COLUMNS) -> bool:
    """Make ``model.lm_head`` a :class:`SlicedHead` of ``columns`` output features a slice when the model runs in
    float32 on CPU and its head is a plain ``nn.Linear`` (``columns=0``: back to the plain product). Returns whether
    the head is sliced afterwards.

    The module's class is switched in place rather than the module replaced: its weight stays the same parameter
    (tied to the embeddings in SmolLM2), its ``state_dict`` keys stay the same, and code that reads
    ``model.lm_head.weight`` sees no difference.
    """
    if columns < 0 or columns % QUANTUM:
        raise InputError(f"slice_head: columns must be 0 (no slices) or a multiple of {QUANTUM}, got {columns}")
    head = getattr(model, "lm_head", None)
    if isinstance(head, SlicedHead):
        if not columns:
            head.__class__ = nn.Linear
            del head.columns
            return False
        head.columns = columns
        return True
    if (not columns or type(head) is not nn.Linear or head.weight.device.type != "cpu"
            or head.weight.dtype != torch.float32):
        return False
    head.__class__ = SlicedHead
    head.columns = columns
    return True
