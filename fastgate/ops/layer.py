"""The fused pass's RMS norm and rotary embedding over bf16 rows on a CPU, in one C++ call each (ops ``rms_norm``,
``rope``; docs/ARCHITECTURE.md).

As torch operations the norm is nine dispatches (cast, square, sum, divide, add, rsqrt, product, cast, product) and the
rotary embedding seven (two slices, a negation, a join, two products, a sum): about 700 of a batch-1 decode step of
SmolLM2's 30 layers, ~1 ms of a ~10 ms step at one thread. torch has no fused CPU kernel with HF's roundings
(``F.rms_norm`` multiplies by the weight before rounding to bf16), so these are written here
(``fastgate._C.rms_norm_bf16``, ``rope_bf16`` in csrc/ops.cpp). They keep every rounding of the references
(:func:`fastgate.ops.reference.rms_norm`, :func:`~fastgate.ops.reference.rope`); the rotary embedding is bitwise
the reference's, the norm's float32 sum of squares may add in another order than torch's reduction (its last bits).

Every input they cannot take (float32 or another dtype, another device, a last dimension with a stride, an odd head
dim) goes to the reference: a float32 model keeps torch's arithmetic exactly. So do more than :data:`MAX_ROWS` rows:
the loops here are scalar, and from ~16 rows torch's vectorized operations win (one thread of a Zen 4 EPYC, 576-wide
rows: 1 row 5 us against 14, 16 rows 17 against 17, 1,024 rows 870 against 295); what they remove is the dispatch of
a decode step's few rows.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from fastgate.ops import reference

__all__ = ["MAX_ROWS", "ext_rms_norm", "ext_rope"]

MAX_ROWS = 8  # rows (tokens) up to which the C++ loops beat torch's operations (module docstring)


def ext_rms_norm(ext: ModuleType) -> Callable[..., torch.Tensor]:
    """The C++ RMS norm with the reference's signature ``(x [..., d], weight [d], eps) -> [..., d]``."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if (x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.device.type != "cpu"
                or x.shape[0] > MAX_ROWS
                or x.dim() != 2 or x.stride(1) != 1 or x.stride(0) < x.shape[1] or not weight.is_contiguous()
                or weight.shape != x.shape[1:]):
            return reference.rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=torch.bfloat16)  # [T, d]
        ext.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                          float(eps), torch.get_num_threads())
        return out

    return rms_norm


def ext_rope(ext: ModuleType) -> Callable[..., torch.Tensor]:
    """The C++ rotary embedding with the reference's signature ``(x [T, H, D], cos, sin [T, 1, D]) -> [T, H, D]``."""

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if (x.dtype is not torch.bfloat16 or cos.dtype is not torch.bfloat16 or sin.dtype is not torch.bfloat16
                or x.device.type != "cpu" or x.shape[0] > MAX_ROWS or x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2
                or cos.shape != (x.shape[0], 1, x.shape[2]) or sin.shape != cos.shape or cos.stride(2) != 1
                or sin.stride() != cos.stride()):
            return reference.rope(x, cos, sin)
        t, h, d = x.shape
        out = torch.empty((t, h, d), dtype=torch.bfloat16)  # [T, H, D]
        ext.rope_bf16(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, h, d, x.stride(0), x.stride(1),
                      cos.stride(0), torch.get_num_threads())
        return out

    return rope
