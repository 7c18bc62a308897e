"""A per-element bound for products whose float32 definition is rounded to bf16 (the quantized layers' kernels and
their dense bf16 paths): shared by tests/test_quant.py, tests/test_quant_int4.py and tests/test_quant_kernels.py."""

from __future__ import annotations

import torch

# the largest relative error of one rounding to bf16: 8 significant bits, half a step of 2^-7 just above a power of 2
BF16_ROUNDING = 2.0**-8


def assert_bf16_rounded(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor | None = None,
                        roundings: int = 1) -> None:
    """``y`` is the float32 definition ``ref`` rounded to bf16 ``roundings`` times: each output within ``roundings``
    bf16 roundings of its ``magnitude`` (``|ref|``; ``|product| + |bias|`` where a bias is added after the product was
    rounded), plus a sliver of its row's scale for outputs that cancel to near zero (the float32 sums run in another
    order). A bound of the whole matrix's largest output would let a 1.5% error through."""
    assert y.shape == ref.shape, (y.shape, ref.shape)
    mag = ref.abs() if magnitude is None else magnitude
    tol = mag * (roundings * BF16_ROUNDING) + ref.abs().amax(dim=-1, keepdim=True) * 1e-4 + 1e-6
    err = (y.float() - ref).abs()
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs off, worst by {(err - tol).max().item():.3g}"
