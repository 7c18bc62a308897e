"""The fused pass's norm and rotary embedding in C++ (fastgate.ops.layer) against their torch references: awkward
shapes (1, primes, 769), strided rows (views of a wider buffer, as the fused pass hands them), extreme magnitudes;
float32 rows and more than MAX_ROWS rows go to the reference; and the bf16 engine's tokens through them equal the
references'."""

from __future__ import annotations

import pytest
import torch

from fastgate.ops import layer, reference
from fastgate.ops.registry import build_ops, ext_available

needs_ext = pytest.mark.skipif(not ext_available(), reason="the C++ extension is not built")


def _ops():
    ops = build_ops("ext", "cpu")
    assert ops.backends["rms_norm"] == ops.backends["rope"] == "ext"
    return ops


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 steps between ``a`` and ``b`` elementwise (same-sign values: their bit patterns' distance)."""
    return (a.view(torch.int16).to(torch.int32) - b.view(torch.int16).to(torch.int32)).abs()


@needs_ext
@pytest.mark.parametrize("rows,d", [(1, 1), (1, 576), (7, 13), (769, 64), (3, 896), (2, 769)])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_keeps_the_reference_s_roundings(rows, d, strided, monkeypatch):
    monkeypatch.setattr(layer, "MAX_ROWS", 1 << 30)  # the C++ loop at every row count
    g = torch.Generator().manual_seed(rows * 31 + d)
    base = (torch.randn(rows, d + 5 if strided else d, generator=g) * 4).to(torch.bfloat16)
    x = base[:, 2:2 + d] if strided else base  # [rows, d], rows d + 5 apart when strided
    w = torch.randn(d, generator=g).to(torch.bfloat16)
    got, ref = _ops().rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    steps = _ulps(got, ref)
    # the float32 sum of squares may add in another order than torch's: at most one bf16 step, rarely
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.02


@needs_ext
def test_rms_norm_of_tiny_and_huge_rows_and_a_zero_row():
    x = torch.tensor([[1e-30, -2e-30, 3e-30], [3e30, -1e30, 2e30], [0.0, 0.0, 0.0]]).to(torch.bfloat16)
    w = torch.tensor([1.0, -2.0, 0.5]).to(torch.bfloat16)
    got, ref = _ops().rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)
    assert torch.equal(got, ref)


@needs_ext
@pytest.mark.parametrize("t,h,d", [(1, 1, 2), (1, 12, 64), (7, 5, 6), (769, 3, 128), (2, 13, 130)])
def test_rope_is_the_reference_bitwise_on_a_strided_view(t, h, d, monkeypatch):
    """As the fused pass calls it: q and k heads, a view of the q/k/v product's rows (v's heads after them)."""
    monkeypatch.setattr(layer, "MAX_ROWS", 1 << 30)  # the C++ loop at every row count
    g = torch.Generator().manual_seed(t * 7 + h * d)
    qkv = (torch.randn(t, h + 3, d, generator=g) * 8).to(torch.bfloat16)  # [T, H + 3, D]
    x = qkv[:, :h]  # [T, H, D], tokens (H + 3) D apart
    pos = torch.randint(0, 4096, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = pos[:, None].float() * inv[None]  # [T, D / 2]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16)[:, None], emb.sin().to(torch.bfloat16)[:, None]  # [T, 1, D]
    got, ref = _ops().rope(x, cos, sin), reference.rope(x, cos, sin)
    assert got.shape == (t, h, d) and torch.equal(got, ref)


@needs_ext
def test_float32_rows_and_odd_head_dims_go_to_the_references():
    ops = _ops()
    x, w = torch.randn(5, 11), torch.randn(11)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    xr, c = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    assert torch.equal(ops.rope(xr, c, c), reference.rope(xr, c, c))
    xo, co = torch.randn(3, 2, 7).to(torch.bfloat16), torch.randn(3, 1, 7).to(torch.bfloat16)
    assert torch.equal(ops.rope(xo, co, co), reference.rope(xo, co, co))
    # more rows than the C++ loops pay for (a prefill chunk): torch's operations, the reference's bits exactly
    big, wb = (torch.randn(layer.MAX_ROWS + 1, 576) * 3).to(torch.bfloat16), torch.randn(576).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm(big, wb, 1e-5), reference.rms_norm(big, wb, 1e-5))


def test_the_torch_backend_binds_the_references():
    ops = build_ops("torch", "cpu")
    assert ops.rms_norm is reference.rms_norm and ops.rope is reference.rope
    assert ops.backends["rms_norm"] == ops.backends["rope"] == "torch"


@needs_ext
def test_bf16_engine_tokens_through_the_ext_ops_equal_the_references():
    """The tiny model in bf16: greedy tokens through the C++ norm and rotary embedding equal the torch backend's."""
    from fastgate.config import GenerationConfig
    from fastgate.engine.local import Engine
    from fastgate.testing import tiny_model

    prompts = ["Who wrote Hamlet?", "The capital of France is", "a b c d e f g h i j k l m n o p"]
    cfg = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    outs = []
    for backend in ("ext", "torch"):
        engine = Engine(tiny_model(dtype=torch.bfloat16), backend=backend)
        assert engine.runner.ops.backends["rope"] == backend
        outs.append([r.token_ids for r in engine.generate(prompts, cfg).sequences])
    assert outs[0] == outs[1]
