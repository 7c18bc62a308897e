"""The fused pass's float32 layer ops in C++ (AVX2 and FMA: ``rms_norm_f32``, ``rope_f32``,
``decode_attention_step_f32`` and the int4 product's norm) against their torch references: the norm and the rotary
embedding bitwise over awkward shapes and strided rows (each product rounded before its sum, as torch rounds it: an
FMA there changes bits), the attention's store writes bitwise and its output within float32 sums' reach; and which
float32 models take the decode-only path (quantized weights) and which keep torch's attention (float weights: the
golden arithmetic)."""

from __future__ import annotations

import pytest
import torch

from fastgate.errors import ShapeError
from fastgate.ops import layer, reference
from fastgate.ops.registry import build_ops, import_ext


def _f32_ext():
    ext = import_ext()
    if ext is None or not hasattr(ext, "rms_norm_f32") or not ext.quant_f32_kernels_supported():
        return None
    return ext


needs_f32 = pytest.mark.skipif(_f32_ext() is None, reason="no C++ extension with float32 layer ops, or no AVX2 + FMA")


@needs_f32
@pytest.mark.parametrize("rows,d", [(1, 8), (7, 13), (769, 64), (2048, 576), (2, 769), (64, 4160), (1, 20000),
                                    (3, 9)])
@pytest.mark.parametrize("strided", [False, True])
def test_float32_rms_norm_is_the_reference_bitwise(rows, d, strided):
    """Many rows: a sum of squares in another order, or a square fused into its sum, shows in some of them."""
    g = torch.Generator().manual_seed(rows * 37 + d)
    base = torch.randn(rows, d + 5 if strided else d, generator=g) * 4
    base[:, :4] *= 50  # a few large features, as hidden states have
    x = base[:, 2:2 + d] if strided else base  # [rows, d], rows d + 5 apart when strided
    w = torch.randn(d, generator=g)
    got = layer.ext_rms_norm(_f32_ext(), layer.UNLIMITED, f32=True)(x, w, 1e-5)
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, reference.rms_norm(x, w, 1e-5))


@needs_f32
@pytest.mark.parametrize("t,h,d", [(1, 1, 2), (1, 15, 64), (7, 5, 6), (769, 3, 128), (2, 13, 130), (5, 4, 48),
                                   (2, 3, 34)])
def test_float32_rope_is_the_reference_bitwise_on_a_strided_view(t, h, d):
    g = torch.Generator().manual_seed(t * 11 + h * d)
    qkv = torch.randn(t, h + 3, d, generator=g) * 8  # [T, H + 3, D]
    x = qkv[:, :h]  # [T, H, D], tokens (H + 3) D apart
    angles = torch.randint(0, 4096, (t, 1), generator=g).float() / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat((angles, angles), dim=-1)  # [T, D]
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [T, 1, D]
    got = layer.ext_rope(_f32_ext(), layer.UNLIMITED, f32=True)(x, cos, sin)
    assert got.dtype == torch.float32
    assert torch.equal(got, reference.rope(x, cos, sin))


@needs_f32
def test_the_registry_binds_float32_rows_to_the_loops():
    """The runner's ops (``auto``) take float32 rows in C++ (a recording stand-in would not tell a reference call from
    the loop's: both are bitwise; the kernel's own error for a bad stride does)."""
    ops = build_ops("auto", "cpu")
    assert getattr(ops.decode_attention_step, "float32", False) and hasattr(ops.decode_attention_step, "roped")
    ext = _f32_ext()
    with pytest.raises(ValueError, match="rms_norm_f32"):
        ext.rms_norm_f32(0, 0, 0, 1, 8, 4, 1e-5, 1)  # x_stride < d: the C++ check, so the entry point exists
    x, w = torch.randn(3, 576), torch.randn(576)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


# the last three: fewer (row, head) pairs than threads, enough columns: their columns split into parts, merged
SHAPES = [(1, 1, 1, 1, 2, 1), (3, 6, 2, 17, 14, 5), (16, 9, 3, 640, 64, 16), (7, 14, 2, 769, 128, 9),
          (2, 16, 1, 50, 64, 2), (1, 9, 3, 31, 64, 1), (1, 9, 3, 769, 64, 1), (2, 4, 1, 1501, 32, 3),
          (1, 2, 1, 4099, 13, 1)]


@needs_f32
@pytest.mark.parametrize("m,H,Hkv,C,D,R", SHAPES)
def test_float32_step_writes_the_store_bitwise_and_attends_as_the_reference(m, H, Hkv, C, D, R):
    step = build_ops("auto", "cpu").decode_attention_step
    g = torch.Generator().manual_seed(m * 13 + D)
    keys = (3 * torch.randn(R, Hkv, C + 2, D, generator=g))[:, :, 1:C + 1]  # a view of a wider store
    values = torch.randn(R, Hkv, C + 2, D, generator=g)[:, :, 1:C + 1]
    qkv = torch.randn(m, H + 2 * Hkv, D, generator=g)  # the q, k, v heads of one product
    q, k_new, v_new = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
    pos = torch.randint(0, C, (m,), generator=g)
    pos[0] = C - 1
    k2, v2 = keys.clone(), values.clone()
    got = step(q, k_new, v_new, keys, values, pos, 0.3)
    want = reference.decode_attention_step(q, k_new, v_new, k2, v2, pos, 0.3)
    assert torch.equal(keys, k2) and torch.equal(values, v2)
    assert got.dtype == torch.float32 and got.shape == (m, H, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # with the rotary embedding in the call: bitwise the two calls (the same loops)
    cos, sin = torch.randn(m, 1, D, generator=g), torch.randn(m, 1, D, generator=g)
    k3, v3, k4, v4 = keys.clone(), values.clone(), keys.clone(), values.clone()
    rope = build_ops("auto", "cpu").rope
    fused = step.roped(qkv, H, cos, sin, k3, v3, pos, 0.3, rope)
    apart = step(rope(q, cos, sin), rope(k_new, cos, sin), v_new, k4, v4, pos, 0.3)
    assert torch.equal(fused, apart) and torch.equal(k3, k4) and torch.equal(v3, v4)


@needs_f32
def test_float32_step_bad_positions_are_shape_errors_and_other_dtypes_the_reference():
    step = build_ops("auto", "cpu").decode_attention_step
    keys, values = torch.zeros(2, 1, 5, 8), torch.zeros(2, 1, 5, 8)
    q, kv = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(ShapeError, match="positions"):
        step(q, kv, kv, keys, values, torch.tensor([0, 5]))
    k16, v16 = keys.to(torch.float16), values.to(torch.float16)
    out = step(q.half(), kv.half(), kv.half(), k16, v16, torch.tensor([1, 2]))
    assert out.dtype == torch.float16  # the reference's


@needs_f32
def test_float32_int4_product_norms_its_rows_bitwise():
    """``normed``: the product of the C++ norm of the rows, bitwise the two calls; ``added``: the residual sum."""
    from fastgate.assets.quant import Int4Linear, quantize_int4

    ops = build_ops("auto", "cpu")
    gen = torch.Generator().manual_seed(3)
    q = Int4Linear(*quantize_int4(torch.randn((40, 96), generator=gen) * 0.05))
    product = ops.int4_matmul.bind(q)
    x, w = torch.randn(3, 96) * 2, torch.randn(96)
    assert torch.equal(product.normed(x, w, 1e-6, ops.rms_norm), product(ops.rms_norm(x, w, 1e-6)))
    res = torch.randn(3, 40)
    assert torch.equal(product.added(x, res), res + product(x))


@needs_f32
@pytest.mark.parametrize("weights", ["int4", None])
def test_float32_decode_path_for_quantized_weights_only(weights):
    """A float32 model of int4 weights runs its decode-only passes through the C++ step op (its attention sums in
    another order than SDPA: the same tokens, log-probs within float32 sums' reach); one of float weights never does
    (torch's attention, the arithmetic of the float32 records)."""
    from decode_paths import decode_path_runs

    from fastgate.assets.quant import quantize_model
    from fastgate.config import GenerationConfig
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=torch.float32)
    if weights:
        quantize_model(lm.model, weights)
    prompts = ["Q: What is the capital of France?\nA:", "Who wrote Hamlet?", "a", "The river rises in the hills"]
    cfg = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    out, calls = decode_path_runs(lm, [prompts], cfg, layers=(0, 2), mid=2, budget=7)
    assert bool(calls) == bool(weights)
    for a, b in zip(out[True][0], out[False][0]):
        assert a[0] == b[0]
        assert max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-4
        torch.testing.assert_close(a[2], b[2], rtol=1e-4, atol=1e-4)
