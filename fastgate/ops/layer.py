"""The fused pass's RMS norm and rotary embedding over bf16 (and float32) rows on a CPU, in one C++ call each (ops
``rms_norm``, ``rope``; docs/ARCHITECTURE.md).

As torch operations the norm is nine dispatches (cast, square, sum, divide, add, rsqrt, product, cast, product) and the
rotary embedding seven (two slices, a negation, a join, two products, a sum): about 700 of a batch-1 decode step of
SmolLM2's 30 layers, ~1 ms of a ~10 ms step at one thread. torch has no fused CPU kernel with HF's roundings
(``F.rms_norm`` multiplies by the weight before rounding to bf16), so these are written here
(``fastgate._C.rms_norm_bf16``, ``rope_bf16`` in csrc/ops.cpp). They keep every rounding of the references
(:func:`fastgate.ops.reference.rms_norm`, :func:`~fastgate.ops.reference.rope`): the rotary embedding is bitwise the
reference's, and so is the norm for rows of at least 8 features (its float32 sum of squares adds in torch's order,
at::native's cascade over vectors of 8 floats: torch registers its sum kernel without an AVX-512 build; shorter rows,
which torch sums otherwise, go to the reference).

float32 rows have loops of their own where the CPU has AVX2 and FMA (``rms_norm_f32``, ``rope_f32``; the registry's
``f32``): bitwise torch's float32 arithmetic, every product rounded before a sum (compiled without FMA contraction), the
sum of squares in torch's order. A batch-1 step of SmolLM2 in float32 spent ~5 ms of ~28 in these as torch operations
(an AVX2-only EPYC). Every input they cannot take (another dtype, another device, a last dimension with a stride, an odd
head dim) goes to the reference: a float32 model keeps torch's arithmetic exactly either way. So do more rows than an
op's limit (:func:`row_limits`), chosen once at construction by the vector width the CPU gives the loops: 16 floats with
AVX-512, 8 without. One thread of a Zen 4 EPYC (AVX-512), 1 / 16 / 64 / 1,024 rows, µs, torch against C++: the norm (576
wide) 14 / 17 / 26 / 2,300 against 0.8 / 3.7 / 13 / 200; the rotary embedding (12 heads of 64) 10 / 16 / 36 / 450
against 1.3 / 6.5 / 23 / 360. At 8 wide the rotary embedding loses from ~32 rows.

The gated MLP's activation ``silu(gate) * up`` of bf16 rows (op ``swiglu``, ``silu_mul_bf16``) is one C++ call too,
bound only where its loop is torch's bit for bit: it calls torch's own SLEEF exp (16 wide with AVX-512, the routine
torch's AVX-512 kernels call) and takes a row in torch's blocks, the rest with the C library's exp as torch's scalar
loop does; the registry probes it against torch's once. torch runs it as two operations on its own threads (an
OpenMP wake each); here the rows split over the extension's pool. Two Zen 4 threads, [T, 2 x 1,536], µs, torch
against C++: 34 rows 104 / 30, 100 rows 217 / 98, 256 rows 297 / 221, 497 rows 387 / 427: the C++ loop up to
:data:`SWIGLU_ROWS` rows (a step's decode rows with a few short prompts), torch's beyond (a prompt chunk).
(An earlier C++ SwiGLU with a polynomial exp of its own was not torch's bit for bit and was left out.)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from fastgate.ops import reference

__all__ = ["SWIGLU_ROWS", "UNLIMITED", "ext_kernels", "ext_rms_norm", "ext_rope", "ext_swiglu", "row_limits"]

UNLIMITED = 1 << 62  # a row limit that never binds: the C++ loop for any rows
# rows up to which the C++ SwiGLU beats torch's two operations (two Zen 4 threads, [T, 2 x 1,536], us, torch / C++:
# 64 rows 200 / 96, 256 rows 297 / 221, 320 rows 289 / 275, 497 rows 387 / 427; a 512-token chunk pass 418 against
# 425 ms through it)
SWIGLU_ROWS = 256


def row_limits(wide: bool) -> dict[str, int]:
    """Rows (tokens) up to which each C++ loop beats torch's operations, for a CPU with AVX-512 (``wide``) or
    without (module docstring)."""
    return {"rms_norm": UNLIMITED, "rope": UNLIMITED if wide else 16}


def ext_kernels(ext: ModuleType, name: str, *, bf16: bool = True, f32: bool = False) -> dict[torch.dtype, Callable]:
    """The extension's kernels ``{name}_bf16`` (bf16 rows) and ``{name}_f32`` (float32 rows, AVX2 and FMA) by the row
    dtype they take, those asked for only: every C++ op of this package picks its kernel by the rows' dtype here."""
    kernels = {}
    if bf16:
        kernels[torch.bfloat16] = getattr(ext, f"{name}_bf16")
    if f32:
        kernels[torch.float32] = getattr(ext, f"{name}_f32")
    return kernels


def ext_rms_norm(ext: ModuleType, max_rows: int, f32: bool = False) -> Callable[..., torch.Tensor]:
    """The C++ RMS norm with the reference's signature ``(x [..., d], weight [d], eps) -> [..., d]``: bf16 rows
    (``rms_norm_bf16``), and float32 rows where ``f32`` (``rms_norm_f32``: AVX2 and FMA), each bitwise the
    reference."""
    kernels = ext_kernels(ext, "rms_norm", f32=f32)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        if (dtype not in kernels or weight.dtype is not dtype or x.device.type != "cpu"
                or x.shape[0] > max_rows or x.shape[-1] < 8  # under 8 features torch sums in another order
                or x.dim() != 2 or x.stride(1) != 1 or x.stride(0) < x.shape[1] or not weight.is_contiguous()
                or not weight.is_cpu  # its address is read as host memory
                or weight.shape != x.shape[1:]):
            return reference.rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=dtype)  # [T, d]
        kernels[dtype](x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                       float(eps), torch.get_num_threads())
        return out

    return rms_norm


def ext_rope(ext: ModuleType, max_rows: int, f32: bool = False) -> Callable[..., torch.Tensor]:
    """The C++ rotary embedding with the reference's signature ``(x [T, H, D], cos, sin [T, 1, D]) -> [T, H, D]``:
    bf16 rows (``rope_bf16``), and float32 rows where ``f32`` (``rope_f32``: AVX2 and FMA), each bitwise the
    reference."""
    kernels = ext_kernels(ext, "rope", f32=f32)

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if (dtype not in kernels or cos.dtype is not dtype or sin.dtype is not dtype
                or x.device.type != "cpu" or not (cos.is_cpu and sin.is_cpu) or x.shape[0] > max_rows
                or x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2 or x.shape[1] == 0 or x.shape[2] == 0
                or cos.shape != (x.shape[0], 1, x.shape[2]) or sin.shape != cos.shape or cos.stride(2) != 1
                or sin.stride() != cos.stride()):
            return reference.rope(x, cos, sin)
        t, h, d = x.shape
        out = torch.empty((t, h, d), dtype=dtype)  # [T, H, D]
        kernels[dtype](x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, h, d, x.stride(0),
                       x.stride(1), cos.stride(0), torch.get_num_threads())
        return out

    return rope


def ext_swiglu(ext: ModuleType, max_rows: int = SWIGLU_ROWS) -> Callable[[torch.Tensor], torch.Tensor]:
    """The C++ SwiGLU with the reference's signature ``(gu [T, 2I]) -> [T, I]``: contiguous bf16 rows on a CPU, up to
    ``max_rows`` of them (``silu_mul_bf16``, its rows over the pool's threads), bitwise the reference where the
    registry binds it (its probe); every other input goes to the reference."""

    def swiglu(gu: torch.Tensor) -> torch.Tensor:
        if (gu.dtype is not torch.bfloat16 or gu.device.type != "cpu" or gu.dim() != 2 or gu.shape[1] % 2
                or not 0 < gu.shape[0] <= max_rows or not gu.shape[1] or not gu.is_contiguous()):
            return reference.swiglu(gu)
        t, inter = gu.shape[0], gu.shape[1] // 2
        out = torch.empty((t, inter), dtype=gu.dtype)  # [T, I]
        ext.silu_mul_bf16(gu.data_ptr(), out.data_ptr(), t, inter, torch.get_num_threads())
        return out

    return swiglu
