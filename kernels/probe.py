"""Tap accumulation and the fused prober (op 1, docs/ARCHITECTURE.md) as Triton kernels, with their torch references
beside them.

- ``accumulate``: ``running_sum[B, L, d] += states[B, L, d] * weight[B]``, one launch per decode step for all layers.
- ``probe_logits``: mean, LN0, Linear+SiLU+LN1, Linear+SiLU+LN2, Linear for every (b, l) in one launch.

The launchers validate shapes and raise :class:`fastgate.errors.ShapeError`; they run on CUDA tensors, or on CPU
tensors under ``TRITON_INTERPRET=1`` (how CI tests them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgate.errors import ShapeError
from fastgate.ops.reference import LN_EPS, ProbeParams
from fastgate.ops.reference import accumulate_taps as accumulate_reference
from fastgate.ops.reference import probe_logits as probe_logits_reference

__all__ = ["accumulate", "accumulate_reference", "probe_logits", "probe_logits_reference"]


# ---------------------------------------------------------------------------------------------------- accumulate
@triton.jit
def _accumulate_kernel(
    sum_ptr,  # [B, L, D] float32, contiguous
    states_ptr,  # [B, L, D] any float dtype, strided
    weight_ptr,  # [B] float32
    L,
    D,
    stride_sb,
    stride_sl,
    stride_sd,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    l = tl.program_id(1)  # noqa: E741
    offs = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    w = tl.load(weight_ptr + b)
    x = tl.load(states_ptr + b * stride_sb + l * stride_sl + offs * stride_sd, mask=mask, other=0.0).to(tl.float32)
    acc_ptrs = sum_ptr + (b * L + l) * D + offs
    acc = tl.load(acc_ptrs, mask=mask, other=0.0)
    tl.store(acc_ptrs, acc + x * w, mask=mask)


def accumulate(running_sum: torch.Tensor, states: torch.Tensor, weight: torch.Tensor) -> None:
    """``running_sum += states * weight[:, None, None]`` in place, in one launch.

    Args:
        running_sum: ``[B, L, d]`` float32, contiguous.
        states: ``[B, L, d]`` hidden states of the current token (any float dtype, any strides).
        weight: ``[B]`` 1 where the token counts, 0 for finished sequences.
    """
    if running_sum.ndim != 3 or running_sum.dtype != torch.float32 or not running_sum.is_contiguous():
        raise ShapeError(f"accumulate: running_sum must be a contiguous float32 [B, L, d], got "
                         f"{running_sum.dtype} {tuple(running_sum.shape)}")
    if states.shape != running_sum.shape:
        raise ShapeError(f"accumulate: states {tuple(states.shape)} != running_sum {tuple(running_sum.shape)}")
    b, n_layers, d = running_sum.shape
    if weight.shape != (b,):
        raise ShapeError(f"accumulate: weight must be [{b}], got {tuple(weight.shape)}")
    if b == 0 or n_layers == 0 or d == 0:
        return
    weight = weight.to(device=running_sum.device, dtype=torch.float32).contiguous()
    block = min(1024, triton.next_power_of_2(d))
    grid = (b, n_layers, triton.cdiv(d, block))
    _accumulate_kernel[grid](running_sum, states, weight, n_layers, d, states.stride(0), states.stride(1),
                             states.stride(2), BLOCK_D=block)


# ---------------------------------------------------------------------------------------------------- prober
@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _layer_norm(x, w_ptr, b_ptr, offs, mask, n, eps):
    # x [BLOCK] with zeros outside `mask`; w/b: this layer's affine parameters at `offs`
    mu = tl.sum(x, axis=0) / n
    c = tl.where(mask, x - mu, 0.0)
    y = c / tl.sqrt(tl.sum(c * c, axis=0) / n + eps)
    y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + tl.load(b_ptr + offs, mask=mask,
                                                                                other=0.0).to(tl.float32)
    return tl.where(mask, y, 0.0)


@triton.jit
def _probe_kernel(
    out_ptr,  # [B, L, 2] float32
    scratch_ptr,  # [B * L, H] float32, the hidden vector between layers
    sums_ptr,  # [B, L, D] any float, strided
    counts_ptr,  # [B] float32
    ln0_w_ptr, ln0_b_ptr,  # [L, D]
    w1_ptr,  # [L, D, H]
    b1_ptr, ln1_w_ptr, ln1_b_ptr,  # [L, H]
    w2_ptr,  # [L, H, H]
    b2_ptr, ln2_w_ptr, ln2_b_ptr,  # [L, H]
    w3_ptr,  # [L, H, 2]
    b3_ptr,  # [L, 2]
    B, L, D, H,
    stride_sb, stride_sl, stride_sd,
    eps,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    # b is the fast axis: the B programs of one layer run together and share that layer's weights in L2
    pid = tl.program_id(0)
    l = pid // B  # noqa: E741
    b = pid % B
    inv_count = 1.0 / tl.load(counts_ptr + b)
    row = sums_ptr + b * stride_sb + l * stride_sl
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < H

    # LN0 statistics over d, two passes (mean, then centred variance) for accuracy
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        acc += tl.load(row + offs * stride_sd, mask=offs < D, other=0.0).to(tl.float32) * inv_count
    mean = tl.sum(acc, axis=0) / D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(row + offs * stride_sd, mask=m, other=0.0).to(tl.float32) * inv_count
        x = tl.where(m, x - mean, 0.0)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)

    # h1 = LN0(x) @ w1: reduce over d in chunks, all h outputs at once
    h1 = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(row + offs * stride_sd, mask=m, other=0.0).to(tl.float32) * inv_count
        g = tl.load(ln0_w_ptr + l * D + offs, mask=m, other=0.0).to(tl.float32)
        beta = tl.load(ln0_b_ptr + l * D + offs, mask=m, other=0.0).to(tl.float32)
        xn = tl.where(m, (x - mean) * rstd * g + beta, 0.0)  # [BLOCK_D]
        w = tl.load(w1_ptr + l * D * H + offs[:, None] * H + offs_h[None, :], mask=m[:, None] & mask_h[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_H]
        h1 += tl.sum(xn[:, None] * w, axis=0)
    h1 = _silu(h1 + tl.load(b1_ptr + l * H + offs_h, mask=mask_h, other=0.0).to(tl.float32))
    h1 = _layer_norm(tl.where(mask_h, h1, 0.0), ln1_w_ptr + l * H, ln1_b_ptr + l * H, offs_h, mask_h, H, eps)

    # h2 = h1 @ w2 in output chunks (a full [H, H] tile would not fit in registers); chunks go through scratch
    scratch = scratch_ptr + pid * H
    for start in range(0, H, BLOCK_J):
        offs_j = start + tl.arange(0, BLOCK_J)
        mj = offs_j < H
        w = tl.load(w2_ptr + l * H * H + offs_h[:, None] * H + offs_j[None, :], mask=mask_h[:, None] & mj[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_J]
        part = tl.sum(h1[:, None] * w, axis=0) + tl.load(b2_ptr + l * H + offs_j, mask=mj, other=0.0).to(tl.float32)
        tl.store(scratch + offs_j, _silu(part), mask=mj)
    tl.debug_barrier()
    h2 = tl.load(scratch + offs_h, mask=mask_h, other=0.0)
    h2 = _layer_norm(h2, ln2_w_ptr + l * H, ln2_b_ptr + l * H, offs_h, mask_h, H, eps)

    # logits = h2 @ w3 + b3
    w3_0 = tl.load(w3_ptr + l * H * 2 + offs_h * 2, mask=mask_h, other=0.0).to(tl.float32)
    w3_1 = tl.load(w3_ptr + l * H * 2 + offs_h * 2 + 1, mask=mask_h, other=0.0).to(tl.float32)
    out = out_ptr + (b * L + l) * 2
    tl.store(out, tl.sum(h2 * w3_0, axis=0) + tl.load(b3_ptr + l * 2).to(tl.float32))
    tl.store(out + 1, tl.sum(h2 * w3_1, axis=0) + tl.load(b3_ptr + l * 2 + 1).to(tl.float32))


def probe_logits(sums: torch.Tensor, counts: torch.Tensor, params: ProbeParams) -> torch.Tensor:
    """Fused op 1 (docs/ARCHITECTURE.md): ``[B, L, d]`` running sums and ``[B]`` counts -> ``[B, L, 2]`` float32
    logits, one launch.

    Same semantics and errors as :func:`fastgate.ops.reference.probe_logits`.
    """
    params.validate()
    if sums.ndim != 3 or sums.shape[1:] != (params.n_layers, params.d):
        raise ShapeError(f"probe_logits: sums must be [B, {params.n_layers}, {params.d}], got {tuple(sums.shape)}")
    b, n_layers, d = sums.shape
    if counts.shape != (b,):
        raise ShapeError(f"probe_logits: counts must be [{b}], got {tuple(counts.shape)}")
    counts = counts.to(device=sums.device, dtype=torch.float32).contiguous()
    if bool((counts <= 0).any()):
        raise ShapeError("probe_logits: every count must be > 0 (a sequence with no generated tokens has no mean)")
    h = params.h
    p = [t.to(device=sums.device).contiguous() for t in params]
    out = torch.empty((b, n_layers, 2), dtype=torch.float32, device=sums.device)
    if b == 0:
        return out
    scratch = torch.empty((b * n_layers, h), dtype=torch.float32, device=sums.device)
    block_h = triton.next_power_of_2(h)
    block_d = max(1, min(triton.next_power_of_2(d), 8192 // block_h, 64))
    block_j = max(1, min(block_h, 8192 // block_h))
    _probe_kernel[(b * n_layers,)](
        out, scratch, sums, counts, *p, b, n_layers, d, h, sums.stride(0), sums.stride(1), sums.stride(2), LN_EPS,
        BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_J=block_j,
    )
    return out
