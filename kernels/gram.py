"""Batched eigenscore (op 2, docs/ARCHITECTURE.md) as one Triton launch for B requests, with the torch reference beside
it.

Each program takes one request: in one pass over its z, the k×k Gram matrix and the row sums of its rows shifted by
their first element (centring is then the rank-one correction ``Y Yᵀ - s sᵀ / d``), then an in-register Cholesky
factorisation whose log-pivots sum to the log-determinant. The Gram matrix and the factorisation are float64, as in
the reference. Near-identical samples make the Gram matrix nearly rank-one next to a ridge of 1e-3, and float32
accumulation would blur exactly the small eigenvalues the score is about.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgate.errors import ShapeError
from fastgate.ops.reference import NON_FINITE_Z, check_eigenscore_args
from fastgate.ops.reference import eigenscore as eigenscore_reference

__all__ = ["MAX_K", "eigenscore", "eigenscore_reference"]

MAX_K = 64  # most samples per request: the k×k Gram matrix and its factorisation live in registers


@triton.jit
def _eigenscore_kernel(
    out_ptr,  # [B] float32
    bad_ptr,  # [B] int32: non-finite entries of the Gram matrix (any NaN or inf in the request's z shows up there)
    z_ptr,  # [B, K, D] any float dtype, strided
    valid_ptr,  # [B, K] int8, 1 = keep the sample
    K,
    D,
    stride_zb,
    stride_zk,
    stride_zd,
    alpha,
    scale,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < K
    keep = (tl.load(valid_ptr + b * K + offs_k, mask=mk, other=0) != 0) & mk  # [BLOCK_K]
    base = z_ptr + b * stride_zb + offs_k[:, None] * stride_zk

    # one pass over z: the Gram matrix and the row sums of each row shifted by its first element, float64. Centring
    # comes after, as a rank-one correction: Zc Zcᵀ = Y Yᵀ - s sᵀ / d with Y = Z - z₀·1ᵀ and s = Y·1 (centring is
    # blind to a per-row shift). Without the shift, a row mean large next to its spread (1e4-1e6 against 1) made
    # Z Zᵀ and s sᵀ / d cancel to their rounding: 1e-4 off the reference at 1e4, NaN at 1e6. After it, |Y| is the
    # spread's size and the rounding stays ~1e-16 of it, far below the 1e-3 ridge; z is still read once.
    x0 = tl.load(base, mask=mk[:, None], other=0.0).to(tl.float64)  # [BLOCK_K, 1]: each row's first element
    gram = tl.zeros([BLOCK_K, BLOCK_K], dtype=tl.float64)
    rsum = tl.zeros([BLOCK_K], dtype=tl.float64)
    for start in range(0, D, BLOCK_D):
        offs_d = start + tl.arange(0, BLOCK_D)
        m = mk[:, None] & (offs_d[None, :] < D)
        x = tl.load(base + offs_d[None, :] * stride_zd, mask=m, other=0.0).to(tl.float64)  # [BLOCK_K, BLOCK_D]
        x = tl.where(m, x - x0, 0.0)  # a NaN or inf in x0 makes its row NaN: still caught below
        gram += tl.sum(x[:, None, :] * x[None, :, :], axis=2)
        rsum += tl.sum(x, axis=1)
    gram = gram - rsum[:, None] * rsum[None, :] / D

    # checked before the valid mask, so a NaN in a dropped sample is an error too (as in the reference)
    non_finite = (gram != gram) | (tl.abs(gram) == float("inf"))
    n_bad = tl.sum(tl.sum(tl.where(non_finite, 1, 0), axis=1), axis=0)
    tl.store(bad_ptr + b + tl.arange(0, 1), tl.zeros([1], dtype=tl.int32) + n_bad)

    # dropped and padding samples become identity rows/columns: they add log(1) = 0
    rows = offs_k[:, None]
    cols = offs_k[None, :]
    both = keep[:, None] & keep[None, :]
    diag = rows == cols
    a = tl.where(both, gram * scale, 0.0) + tl.where(diag, tl.where(keep[:, None], alpha, 1.0), 0.0)

    # right-looking Cholesky: logdet = Σ log(pivot_j)
    logdet = tl.zeros([1], dtype=tl.float64)
    for j in range(0, BLOCK_K):
        pivot = tl.sum(tl.sum(tl.where(diag & (rows == j), a, 0.0), axis=1), axis=0)
        logdet += tl.log(pivot)
        col = tl.sum(tl.where(cols == j, a, 0.0), axis=1)  # a[:, j]
        below = tl.where(offs_k > j, col / tl.sqrt(pivot), 0.0)
        a = a - below[:, None] * below[None, :]
    n_keep = tl.sum(keep.to(tl.float64), axis=0)
    score = tl.where(n_keep > 0, logdet / tl.maximum(n_keep, 1.0), float("inf"))
    tl.store(out_ptr + b + tl.arange(0, 1), score.to(tl.float32))


def eigenscore(z: torch.Tensor, alpha: float = 1e-3, valid: torch.Tensor | None = None,
               scale: str | None = None) -> torch.Tensor:
    """Fused op 2 (docs/ARCHITECTURE.md) for ``z [B, k, d]`` -> ``[B]`` float32, one launch; same semantics and errors
    as
    :func:`fastgate.ops.reference.eigenscore` (a request with no valid sample gets +inf)."""
    valid = check_eigenscore_args(z, alpha, valid, scale)
    b, k, d = z.shape
    if k > MAX_K:  # the registry's eigenscore sends such inputs to the reference instead
        raise ShapeError(f"eigenscore: the fused kernel holds the k×k Gram in registers; k={k} > {MAX_K}")
    valid = valid.to(device=z.device, dtype=torch.int8).contiguous()
    out = torch.empty(b, dtype=torch.float32, device=z.device)
    if b == 0:
        return out
    bad = torch.empty(b, dtype=torch.int32, device=z.device)
    block_k = max(2, triton.next_power_of_2(k))
    block_d = max(1, min(triton.next_power_of_2(d), 4096 // (block_k * block_k), 64))
    _eigenscore_kernel[(b,)](out, bad, z, valid, k, d, z.stride(0), z.stride(1), z.stride(2), float(alpha),
                             1.0 / (d - 1) if scale == "cov" else 1.0, BLOCK_K=block_k, BLOCK_D=block_d)
    if bool(bad.any()):  # one host sync on [B], instead of a second pass over z
        raise ShapeError(NON_FINITE_Z)
    return out
