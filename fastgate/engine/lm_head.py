"""The LM head computed in column slices on CPU.

Why: the output projection ``hidden [M, K] @ W.T`` with ``W [V, K]`` and a 49k–152k-token vocabulary is the largest
product of a decode step (SmolLM2-135M: 28 M of its 135 M weights; Qwen2.5-0.5B: 136 M of 494 M). With torch 2.13's
MKL sgemm on a 2-core EPYC it runs 25–30% slower at 4–32 rows than the same product taken in 2048-column slices
(``bench/bench_lm_head.py``). Every logit is the same K-long dot product either way, but the order in which MKL sums
it depends on the kernel it picks for the product's shape and the machine: on that EPYC every shape tested gave
bitwise the plain product; on a 2-core Xeon with AVX-512, Qwen2.5-0.5B's head (K 896) differs in the last bit at 4–15
rows and some awkward shapes differ at one row. So :class:`SlicedHead` checks, the first time it sees a row count,
whether the slices give bitwise the plain product for that shape on this machine (on random data: the summation order
depends on shapes, not values) and keeps the plain product for the shapes where they do not. The answers never depend
on the slicing; the speed does. At one row the slices gain nothing, and on GPU cuBLAS picks its own tiling, so both
keep the plain product.

:func:`slice_head` turns a model's ``lm_head`` into a :class:`SlicedHead` once, when the engine is built
(the choice is made at construction, never per call; the per-row-count check is made once per shape and remembered).
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
    kernels and can differ from the plain product in the last bit (measured on a 2-core EPYC: 156 of 648 awkward
    shapes for evenly spread widths, none for these). On other machines these can differ too, for some row counts:
    :class:`SlicedHead` checks each row count before it uses the slices.

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
    rows or more and, for that row count, the slices give bitwise the plain product on this machine (one row, or a
    shape where they do not: the plain product).

    :attr:`bitwise` maps ``(rows, threads, contiguous)`` to the verdict of the one check made for that key: the plain
    product and the sliced one on a seeded random ``x`` of that shape. The call that makes the check returns the plain
    product, so every call's logits are bitwise those of ``nn.Linear``.
    """

    columns: int = DEFAULT_COLUMNS
    bitwise: dict[tuple[int, int, bool], bool]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., V]
        rows = x.numel() // max(1, x.shape[-1])
        if rows <= 1:
            return super().forward(x)  # one row: the plain product is as fast
        key = (rows, torch.get_num_threads(), x.is_contiguous())
        same = self.bitwise.get(key)
        if same is None:
            self.bitwise[key] = self._slices_are_bitwise(x)
            return super().forward(x)
        return sliced_linear(x, self.weight, self.bias, self.columns) if same else super().forward(x)

    def _slices_are_bitwise(self, x: torch.Tensor) -> bool:
        """Whether the slices give bitwise the plain product for ``x``'s shape and layout, on seeded random data."""
        gen = torch.Generator(device="cpu").manual_seed(len(self.bitwise))
        if x.is_contiguous():
            probe = torch.randn(x.shape, generator=gen, dtype=x.dtype)  # [..., K]
        else:  # the same layout as x: a strided view of a wider tensor
            probe = torch.randn((*x.shape[:-1], 2 * x.shape[-1]), generator=gen, dtype=x.dtype)[..., ::2]  # [..., K]
        return torch.equal(sliced_linear(probe, self.weight, self.bias, self.columns),
                           F.linear(probe, self.weight, self.bias))


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
            del head.columns, head.bitwise
            return False
        if head.columns != columns:
            head.columns, head.bitwise = columns, {}
        return True
    if (not columns or type(head) is not nn.Linear or head.weight.device.type != "cpu"
            or head.weight.dtype != torch.float32):
        return False
    head.__class__ = SlicedHead
    head.columns = columns
    head.bitwise = {}
    return True
