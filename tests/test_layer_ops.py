"""The fused pass's norm, rotary embedding and SwiGLU activation in C++ (fastgate.ops.layer) against their torch
references, at both vector widths of the loops (16 floats with AVX-512, 8 without; the extension's test hook runs
the 8-wide loops on an AVX-512 CPU too): awkward shapes (1, primes, 769), strided rows (views of a wider buffer, as
the fused pass hands them), extreme magnitudes; float32 rows and more rows than an op's limit go to the reference;
and the bf16 engine's tokens through them equal the references'."""

from __future__ import annotations

import pytest
import torch

from fastgate.ops import layer, reference
from fastgate.ops.registry import build_ops, ext_available

needs_ext = pytest.mark.skipif(not ext_available(), reason="the C++ extension is not built")
UNLIMITED = 1 << 62


@pytest.fixture(params=[8, 16])
def width(request):
    """The loops' vector width for one test (16 only where the CPU has AVX-512), restored after it."""
    from fastgate.ops.registry import import_ext

    ext = import_ext()
    if request.param == 16 and not ext.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512: the loops run 8 wide")
    ext.set_max_vector_width(request.param)
    yield request.param
    ext.set_max_vector_width(16)


def _ext():
    from fastgate.ops.registry import import_ext

    return import_ext()


def _ops():
    ops = build_ops("ext", "cpu")
    assert ops.backends["rms_norm"] == ops.backends["rope"] == ops.backends["silu_mul"] == "ext"
    return ops


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 steps between ``a`` and ``b`` elementwise (same-sign values: their bit patterns' distance)."""
    return (a.view(torch.int16).to(torch.int32) - b.view(torch.int16).to(torch.int32)).abs()


@needs_ext
@pytest.mark.parametrize("rows,d", [(1, 1), (1, 576), (7, 13), (769, 64), (3, 896), (2, 769)])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_keeps_the_reference_s_roundings(rows, d, strided, width):
    g = torch.Generator().manual_seed(rows * 31 + d)
    base = (torch.randn(rows, d + 5 if strided else d, generator=g) * 4).to(torch.bfloat16)
    x = base[:, 2:2 + d] if strided else base  # [rows, d], rows d + 5 apart when strided
    w = torch.randn(d, generator=g).to(torch.bfloat16)
    got, ref = layer.ext_rms_norm(_ext(), UNLIMITED)(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    steps = _ulps(got, ref)
    # the float32 sum of squares may add in another order than torch's: at most one bf16 step, rarely
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.02


@needs_ext
def test_rms_norm_of_tiny_and_huge_rows_and_a_zero_row(width):
    x = torch.tensor([[1e-30, -2e-30, 3e-30], [3e30, -1e30, 2e30], [0.0, 0.0, 0.0]]).to(torch.bfloat16)
    w = torch.tensor([1.0, -2.0, 0.5]).to(torch.bfloat16)
    got, ref = _ops().rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)
    assert torch.equal(got, ref)


@needs_ext
# halves of 1, 32, 3, 64, 65, and 16, 24 (16 + 8), 17: every vector width's full vectors and tails
@pytest.mark.parametrize("t,h,d", [(1, 1, 2), (1, 12, 64), (7, 5, 6), (769, 3, 128), (2, 13, 130), (3, 2, 32),
                                   (5, 4, 48), (2, 3, 34)])
def test_rope_is_the_reference_bitwise_on_a_strided_view(t, h, d, width):
    """As the fused pass calls it: q and k heads, a view of the q/k/v product's rows (v's heads after them)."""
    g = torch.Generator().manual_seed(t * 7 + h * d)
    qkv = (torch.randn(t, h + 3, d, generator=g) * 8).to(torch.bfloat16)  # [T, H + 3, D]
    x = qkv[:, :h]  # [T, H, D], tokens (H + 3) D apart
    pos = torch.randint(0, 4096, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = pos[:, None].float() * inv[None]  # [T, D / 2]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16)[:, None], emb.sin().to(torch.bfloat16)[:, None]  # [T, 1, D]
    got, ref = layer.ext_rope(_ext(), UNLIMITED)(x, cos, sin), reference.rope(x, cos, sin)
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
    xs = (torch.randn(3, 10) * 3).to(torch.bfloat16)
    assert torch.equal(ops.silu_mul(xs.float()), reference.silu_mul(xs.float()))  # float32: the reference
    xw = (torch.randn(3, 24) * 3).to(torch.bfloat16)[:, ::2]  # [3, 12], a strided last dimension
    assert torch.equal(ops.silu_mul(xw), reference.silu_mul(xw))


def test_row_limits_send_more_rows_to_torch(monkeypatch):
    """More rows than an op's limit (where torch's operations win) run the reference, the reference's bits exactly;
    up to it the C++ loop (counted through a recording stand-in for the extension)."""
    calls = []

    class Ext:
        def silu_mul_bf16(self, *args):
            calls.append(args[2])  # the rows

    gu = (torch.randn(9, 16) * 3).to(torch.bfloat16)
    op = layer.ext_silu_mul(Ext(), 8)
    assert torch.equal(op(gu), reference.silu_mul(gu)) and calls == []  # 9 rows > 8: torch's operations
    op(gu[:8])
    assert calls == [8]
    assert layer.row_limits(True)["rope"] > layer.row_limits(False)["rope"] >= 1
    assert all(v >= 1 for v in layer.row_limits(False).values())


@needs_ext
@pytest.mark.parametrize("rows,inter", [(1, 1), (1, 1536), (7, 13), (769, 64), (3, 17), (2, 769)])
@pytest.mark.parametrize("strided", [False, True])
def test_silu_mul_keeps_the_reference_s_roundings(rows, inter, strided, width):
    """silu(gate) * up against torch's, over the fused product's rows (gate then up; strided: rows of a wider
    buffer): at most 1 in 1,000 elements moved (a polynomial exp against Sleef's: ~1 in 10^5 measured), by at most
    two bf16 steps (silu one step off, then rounded again in the product)."""
    g = torch.Generator().manual_seed(rows * 17 + inter)
    base = (torch.randn(rows, 2 * inter + (6 if strided else 0), generator=g) * 4).to(torch.bfloat16)
    gu = base[:, 3:3 + 2 * inter] if strided else base  # [rows, 2 I]
    got, ref = layer.ext_silu_mul(_ext(), UNLIMITED)(gu), reference.silu_mul(gu)
    assert got.shape == ref.shape == (rows, inter) and got.dtype == torch.bfloat16 and got.is_contiguous()
    steps = _ulps(got, ref)
    assert int(steps.max()) <= 2 and float((steps > 0).float().mean()) < 1e-3


@needs_ext
def test_silu_mul_of_extreme_gates(width):
    """Gates far past exp's range (-100: silu is -0, as torch's; +100: the gate itself), zeros, NaN and infinities
    give torch's values, a lane of 16 and the scalar tail alike."""
    gates = [-100.0, -89.0, -88.5, -20.0, -1e-30, 0.0, 1e-30, 3.0, 88.5, 100.0, 3e38, float("nan"), float("inf"),
             float("-inf"), -0.0, 1.0, 2.0]  # 17: one vector of 16 and a tail of 1
    gate = torch.tensor(gates).to(torch.bfloat16)
    up = torch.linspace(-2, 2, len(gates)).to(torch.bfloat16)
    gu = torch.cat([gate, up])[None]  # [1, 2 I]
    got, ref = layer.ext_silu_mul(_ext(), UNLIMITED)(gu), reference.silu_mul(gu)
    same = (got == ref) | (got.isnan() & ref.isnan())
    assert bool(same.all()), (got, ref)


def test_the_torch_backend_binds_the_references():
    ops = build_ops("torch", "cpu")
    assert ops.rms_norm is reference.rms_norm and ops.rope is reference.rope and ops.silu_mul is reference.silu_mul
    assert ops.backends["rms_norm"] == ops.backends["rope"] == ops.backends["silu_mul"] == "torch"


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
