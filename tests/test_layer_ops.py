"""The fused pass's norm and rotary embedding in C++ (fastgate.ops.layer) against their torch references, at both
vector widths of the loops (16 floats with AVX-512, 8 without; the extension's test hook runs the 8-wide loops on an
AVX-512 CPU too): awkward shapes (1, primes, 769, past the sum's 16-step cascade), strided rows (views of a wider
buffer, as the fused pass hands them), extreme magnitudes; float32 rows and more rows than an op's limit go to the
reference; and the bf16 engine's tokens through them equal the references'."""

from __future__ import annotations

import pytest
import torch

from fastgate.ops import layer, reference
from fastgate.ops.registry import build_ops, ext_available

needs_ext = pytest.mark.skipif(not ext_available(), reason="the C++ extension is not built")
UNLIMITED = layer.UNLIMITED


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
    assert ops.backends["rms_norm"] == ops.backends["rope"] == "ext"
    return ops


@needs_ext
@pytest.mark.parametrize("rows,d", [(1, 1), (7, 13), (769, 64), (2048, 576), (2048, 896), (2, 769), (64, 4160),
                                    (1, 20000)])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_keeps_the_reference_s_roundings(rows, d, strided, width):
    """Bitwise the reference at both widths (the sum of squares in torch's order, 8-float vectors; 4,160 and 20,000
    wide pass the cascade's 16-step levels). Where the order were another, 2,048 rows of 576 showed 23 elements a bf16
    step apart: too few rows here could not tell, so the rows are many."""
    g = torch.Generator().manual_seed(rows * 31 + d)
    base = (torch.randn(rows, d + 5 if strided else d, generator=g) * 4).to(torch.bfloat16)
    base[:, :4] *= 50  # a few large features, as hidden states have
    x = base[:, 2:2 + d] if strided else base  # [rows, d], rows d + 5 apart when strided
    w = torch.randn(d, generator=g).to(torch.bfloat16)
    got, ref = layer.ext_rms_norm(_ext(), UNLIMITED)(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got, ref)


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
    xw = (torch.randn(3, 24) * 3).to(torch.bfloat16)[:, ::2]  # [3, 12], a strided last dimension
    assert torch.equal(ops.rms_norm(xw, xw[0], 1e-5), reference.rms_norm(xw, xw[0], 1e-5))


def test_row_limits_send_more_rows_to_torch():
    """More rows than an op's limit (where torch's operations win) run the reference, the reference's bits exactly;
    up to it the C++ loop (counted through a recording stand-in for the extension)."""
    calls = []

    class Ext:
        def rope_bf16(self, *args):
            calls.append(args[4])  # the tokens

    x = (torch.randn(9, 2, 8) * 3).to(torch.bfloat16)
    cos = sin = torch.randn(9, 1, 8).to(torch.bfloat16)
    op = layer.ext_rope(Ext(), 8)
    assert torch.equal(op(x, cos, sin), reference.rope(x, cos, sin)) and calls == []  # 9 rows > 8: torch's operations
    op(x[:8], cos[:8], sin[:8])
    assert calls == [8]
    assert layer.row_limits(True)["rope"] > layer.row_limits(False)["rope"] >= 1
    assert all(v >= 1 for v in layer.row_limits(False).values())


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


def _swiglu_bound() -> bool:
    return ext_available() and build_ops("ext", "cpu").backends["swiglu"] == "ext"


@pytest.mark.skipif(not _swiglu_bound(), reason="no C++ bf16 SwiGLU here (AVX512-BF16 and torch's exp)")
@pytest.mark.parametrize("rows,inter", [(1, 1), (1, 31), (3, 64), (13, 65), (34, 1536), (97, 769), (256, 1537),
                                        (2, 4864)])
def test_swiglu_is_torch_s_silu_times_up_bitwise(rows, inter, width):
    """Both vector widths (the 16-wide exp where the CPU has AVX-512), rows past torch's blocks (scalar tails), values
    over silu's range and beyond exp's (|x| > 88), and enough rows for both threads."""
    op = build_ops("ext", "cpu").swiglu
    gen = torch.Generator().manual_seed(rows * 7919 + inter)
    gu = (torch.randn((rows, 2 * inter), generator=gen) * 8).to(torch.bfloat16)  # [T, 2I]
    gu[0, : min(inter, 4)] = torch.tensor([-100.0, 100.0, 0.0, -0.0])[: min(inter, 4)].to(torch.bfloat16)
    assert torch.equal(op(gu), reference.swiglu(gu))


@pytest.mark.skipif(not _swiglu_bound(), reason="no C++ bf16 SwiGLU here (AVX512-BF16 and torch's exp)")
def test_swiglu_inputs_the_loop_does_not_take_go_to_the_reference():
    calls = []

    class Ext:
        def silu_mul_bf16(self, gu, out, rows, inter, threads):
            calls.append(rows)

    op = layer.ext_swiglu(Ext(), max_rows=8)
    gu = torch.randn(9, 20).to(torch.bfloat16)
    for x in (gu, gu.float()[:4], gu[:4, ::2], gu[:0]):  # too many rows, float32, strided, empty
        assert torch.equal(op(x), reference.swiglu(x))
    with pytest.raises(RuntimeError):  # an odd width: the reference's own error
        op(gu[:4, :19])
    assert calls == []
    op(gu[:8])
    assert calls == [8]
    assert build_ops("torch", "cpu").swiglu is reference.swiglu
