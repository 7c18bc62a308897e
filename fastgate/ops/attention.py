"""The decode rows' attention over a bf16 key / value store on a CPU (op ``decode_attention``, docs/ARCHITECTURE.md).

The reference (:func:`fastgate.ops.reference.decode_attention`) is what the packed pass always did: cast the rows'
keys and values to float32 and call torch's SDPA. That makes three passes over the cache a layer (read bf16, write
and read float32); the C++ kernel (``fastgate._C.decode_attention_bf16``) reads each key and value once, widening in
registers, and accumulates in float32 too. With AVX-512 and head dims of 32, 64 or 128 (up to 8 query heads a key
head) it runs 16 floats a vector with the value product's outputs in registers: SmolLM2's batch-1 step at 600 tokens
took ~2.2 ms more than at 30 with the 8-wide loop, ~0.6 ms more with this one. torch has no CPU kernel that does this
(its bf16 SDPA ran ~6x slower than float32 on a Zen 4 EPYC without AMX), which is why it is written here.

The extension does not link against torch: it gets the tensors' data pointers and strides, after the checks below,
and every input it cannot take (a head dim over 256, another device, another dtype) goes to the reference. The
decode-only pass's op (``decode_attention_step``) also takes a float32 store where the CPU has AVX2 and FMA
(``decode_attention_step_f32``: the same loop reading float32 keys and values): a float32 model of quantized weights
spent ~4 ms of a ~28 ms batch-1 step of SmolLM2 in the store's indexed writes, the mask and SDPA as torch operations
(an AVX2-only EPYC).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from fastgate.errors import ShapeError
from fastgate.ops import reference
from fastgate.ops.layer import ext_kernels

__all__ = ["ext_decode_attention", "ext_decode_attention_step"]

_MAX_HEAD_DIM = 256  # the kernel keeps one key / value row in registers: kMaxD in csrc/ops.cpp


def ext_decode_attention(ext: ModuleType) -> Callable[..., torch.Tensor]:
    """The C++ decode attention with the reference's signature; inputs it cannot run go to the reference."""

    def runs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> bool:
        return (keys.device.type == "cpu" and keys.dtype is torch.bfloat16 and values.dtype is torch.bfloat16
                and keys.stride() == values.stride() and keys.stride(-1) == 1 and keys.shape[-1] <= _MAX_HEAD_DIM
                and q.device.type == "cpu" and pos.device.type == "cpu")

    def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
        if not runs(q, keys, values, pos):
            return reference.decode_attention(q, keys, values, pos, scale)
        reference.check_decode_attention_args(q, keys, values, pos, positions=False)  # the kernel checks positions
        m, heads, dim = q.shape
        qf = q.to(torch.float32).contiguous()  # [m, H, D]
        pos = pos.to(torch.int64).contiguous()  # [m] (no copy when it is one already)
        out = torch.empty((m, heads, dim), dtype=torch.float32)  # [m, H, D]
        if m:
            s_row, s_head, s_col, _ = keys.stride()
            try:
                ext.decode_attention_bf16(qf.data_ptr(), keys.data_ptr(), values.data_ptr(), pos.data_ptr(),
                                          out.data_ptr(), m, heads, keys.shape[1], dim, keys.shape[2], s_row, s_head,
                                          s_col, dim ** -0.5 if scale is None else float(scale),
                                          torch.get_num_threads())
            except ValueError as exc:
                raise ShapeError(str(exc)) from None
        return out

    return decode_attention


def ext_decode_attention_step(ext: ModuleType, fuse_rope: bool = False,
                              f32: bool = False) -> Callable[..., torch.Tensor]:
    """The C++ store writes and attention of a decode-only pass with the reference's signature: bf16 in and out
    (``decode_attention_step_bf16``), and float32 in and out over a float32 store where ``f32``
    (``decode_attention_step_f32``: AVX2 and FMA; the op then says so: ``float32`` True); inputs it cannot run go to
    the reference.

    The op also offers ``roped(qkv, heads, cos, sin, keys, values, pos, scale, rope)`` (``qkv [m, H + 2 Hkv, D]``: the
    q, k_new and v_new heads side by side): the rotary embedding of q and k_new in the same call with the runner's
    rotary loop (``rope_bf16`` / ``rope_f32``), bitwise ``decode_attention_step(rope(q), rope(k_new), v_new, ...)``
    (one Python call a layer less: each costs ~5 us beside a batch-1 step's ~180 us a layer). bf16 rows take it where
    ``fuse_rope`` (the runner's ``rope`` is the C++ one for any rows: AVX-512), float32 rows wherever ``f32``."""
    kernels = ext_kernels(ext, "decode_attention_step", f32=f32)
    fused = {torch.float32} if f32 else set()
    if fuse_rope:
        fused.add(torch.bfloat16)

    def runs(q, k_new, v_new, keys, values, pos) -> bool:
        dtype = keys.dtype
        return (dtype in kernels and values.dtype is dtype and q.dtype is dtype and k_new.dtype is dtype
                and v_new.dtype is dtype and keys.device.type == "cpu"
                and q.device.type == "cpu" and pos.device.type == "cpu" and pos.dtype is torch.int64
                and keys.stride() == values.stride() and keys.stride(-1) == 1 and keys.shape[-1] <= _MAX_HEAD_DIM
                and q.stride(-1) == 1 and k_new.stride(-1) == 1 and v_new.stride(-1) == 1 and pos.is_contiguous()
                and q.dim() == 3 and k_new.shape == v_new.shape == (q.shape[0], keys.shape[1], q.shape[2]))

    def launch(q: tuple, k_new: tuple, v_new: tuple, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
               m: int, heads: int, dim: int, scale: float | None, rotary: tuple = (0, 0, 0)) -> torch.Tensor:
        """The kernel's call, checked by the caller: ``q``, ``k_new``, ``v_new`` as ``(pointer, row stride, head
        stride)``, ``rotary`` as ``(cos pointer, sin pointer, row stride)`` (0s: none); the output ``[m, H, D]`` in
        the store's dtype."""
        out = torch.empty((m, heads, dim), dtype=keys.dtype)  # [m, H, D]
        if m:
            ks, kst = keys.shape, keys.stride()
            try:
                kernels[keys.dtype](
                    *q, *k_new, *v_new, keys.data_ptr(), values.data_ptr(), pos.data_ptr(), out.data_ptr(), m, heads,
                    ks[1], dim, ks[2], kst[0], kst[1], kst[2], dim ** -0.5 if scale is None else float(scale),
                    torch.get_num_threads(), *rotary)
            except ValueError as exc:
                raise ShapeError(str(exc)) from None
        return out

    def decode_attention_step(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor,
                              values: torch.Tensor, pos: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        if not runs(q, k_new, v_new, keys, values, pos):
            return reference.decode_attention_step(q, k_new, v_new, keys, values, pos, scale)
        reference.check_decode_attention_args(q, keys, values, pos, positions=False)  # the kernel checks positions
        m, heads, dim = q.shape
        return launch((q.data_ptr(), q.stride(0), q.stride(1)), (k_new.data_ptr(), k_new.stride(0), k_new.stride(1)),
                      (v_new.data_ptr(), v_new.stride(0), v_new.stride(1)), keys, values, pos, m, heads, dim, scale)

    int64 = torch.int64

    def roped(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, pos: torch.Tensor, scale: float | None,
              rope: Callable[..., torch.Tensor]) -> torch.Tensor:
        # qkv [m, H + 2 Hkv, D]: the q, k_new, v_new heads side by side, before the rotary embedding; cos / sin
        # [m, 1, D]. The checks read each shape and stride once (30 calls a step; slices and per-tensor checks cost
        # more than the kernel at short contexts), the pointers of k_new and v_new are offsets into qkv.
        qs, ks, cs = qkv.shape, keys.shape, cos.shape
        qst, kst, cst = qkv.stride(), keys.stride(), cos.stride()
        m, dim, kv_heads = qs[0], qs[2], ks[1] if len(ks) == 4 else 0
        dtype = qkv.dtype
        if not (dtype in fused and keys.dtype is dtype and values.dtype is dtype and cos.dtype is dtype
                and sin.dtype is dtype and pos.dtype is int64 and qkv.is_cpu and keys.is_cpu and cos.is_cpu
                and pos.is_cpu and len(qs) == 3 and len(ks) == 4 and qs[1] == heads + 2 * kv_heads
                and heads % kv_heads == 0 and ks[3] == dim and dim <= _MAX_HEAD_DIM and dim % 2 == 0
                and m <= ks[0] and values.shape == ks and values.stride() == kst and kst[3] == 1 and qst[2] == 1
                and pos.shape == (m,) and pos.is_contiguous() and cs == (m, 1, dim) and sin.shape == cs
                and cst[2] == 1 and sin.stride() == cst):
            k_new, v_new = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
            return decode_attention_step(rope(qkv[:, :heads], cos, sin), rope(k_new, cos, sin), v_new, keys, values,
                                         pos, scale)
        base, head_bytes = qkv.data_ptr(), qst[1] * qkv.element_size()
        return launch((base, qst[0], qst[1]), (base + heads * head_bytes, qst[0], qst[1]),
                      (base + (heads + kv_heads) * head_bytes, qst[0], qst[1]), keys, values, pos, m, heads, dim,
                      scale, (cos.data_ptr(), sin.data_ptr(), cst[0]))

    if fused:
        decode_attention_step.roped = roped  # type: ignore[attr-defined]
    decode_attention_step.float32 = f32  # type: ignore[attr-defined]  (float32 rows run C++: fastgate.engine.fused)
    return decode_attention_step
