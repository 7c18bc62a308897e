"""The C++ weight-only products (fastgate.ops.quant: ops int4_matmul, int8_matmul) against the float32 definitions
(fastgate.assets.quant.int4_reference, int8_reference): awkward shapes (1 row, primes, 769, groups that leave one,
two or three of a block of four), more input rows than a tile, strided input rows, two threads; the inputs they do
not take go to torch's kernels; the registry binds them only where the CPU has AVX512-BF16."""

from __future__ import annotations

import pytest
import torch
from bf16_rounding import assert_bf16_rounded

from fastgate.assets.quant import Int4Linear, Int8Linear, int4_reference, int8_reference, quantize_int4, quantize_int8
from fastgate.ops.quant import (
    INT4_FLOAT,
    INT4_HALF,
    bf16_tiles,
    ext_int4_matmul,
    ext_int8_matmul,
    int4_bf16_form,
    int4_bf16_tiles,
    int8_bf16_tiles,
    torch_int4_matmul,
    torch_int8_matmul,
)
from fastgate.ops.registry import build_ops, import_ext


def _ext():
    ext = import_ext()
    if ext is None or not getattr(ext, "quant_kernels_supported", lambda: False)():
        pytest.skip("needs the C++ extension on a CPU with AVX512-BF16")
    return ext


def _close_to_definition(y: torch.Tensor, ref: torch.Tensor) -> None:
    """``y`` (bf16) is the float32 definition ``ref`` rounded once: within a bf16 step of each output, plus a sliver
    of the row's scale for outputs that cancel to near zero (the float32 sums run in another order)."""
    assert y.dtype == torch.bfloat16
    assert_bf16_rounded(y, ref)


def _int4(n: int, k: int, seed: int) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    q, scale, zero = quantize_int4(torch.randn((n, k), generator=gen) * 0.05)
    return Int4Linear(q, scale, zero)


@pytest.mark.parametrize("n", [1, 7, 769, 1031])
@pytest.mark.parametrize("k", [32, 64, 96, 160, 576, 608, 1536])  # groups: 1, 2, 3, 5, 18, 19, 48
@pytest.mark.parametrize("m", [1, 4, 9])
def test_int4_kernel_is_the_definition_rounded_once(n, k, m):
    op = ext_int4_matmul(_ext())
    layer = _int4(n, k, seed=n * k + m)
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    _close_to_definition(op(x, layer), int4_reference(x, layer.q, layer.scale, layer.zero))


def test_int4_kernel_of_strided_rows_and_of_a_view_of_joined_rows():
    """Rows of a wider buffer (the row stride is the kernel's), and a layer whose codes are rows of a larger tensor
    (a fused layer's part): the kernel reads no further than its own rows."""
    op = ext_int4_matmul(_ext())
    big = _int4(40, 576, seed=3)
    part = Int4Linear(big.q[16:37], big.scale[16:37], big.zero[16:37])  # contiguous views, ending before the tensor
    wide = torch.randn((5, 700)).to(torch.bfloat16)
    x = wide[:, 50:626]  # [5, 576], rows 700 apart
    assert x.stride() == (700, 1)
    _close_to_definition(op(x, part), int4_reference(x, part.q, part.scale, part.zero))
    _close_to_definition(op(x, big)[:, 16:37], int4_reference(x, part.q, part.scale, part.zero))


def test_int4_kernel_extreme_inputs_and_constant_groups():
    """Large and tiny magnitudes (the offsets' correction cancels ~16x the codes' part), and groups whose codes are
    all 0 or all 15."""
    op = ext_int4_matmul(_ext())
    layer = _int4(33, 256, seed=9)
    layer.q[:8] = 0
    layer.q[8:16] = 0xFF
    x = torch.cat([torch.randn(1, 256) * 1e3, torch.randn(1, 256) * 1e-3, torch.randn(1, 256) + 5.0])
    x = x.to(torch.bfloat16)
    _close_to_definition(op(x, layer), int4_reference(x, layer.q, layer.scale, layer.zero))


@pytest.mark.parametrize("n, groups", [(1, 1), (4, 2), (5, 3), (7, 18), (9, 19), (8, 48)])
def test_int4_bf16_tiles_hold_each_row_s_codes_scales_and_corrections(n, groups):
    """The tiles read back: tile t, block b of gb groups (four, or the last two where G % 4 == 2; G padded with zero
    groups to four otherwise) is its four rows' codes [4, 16 gb], scales [4, gb], zero - 24 scale [4, gb]; rows past N
    and groups past G are zero."""
    gen = torch.Generator().manual_seed(n * groups)
    q = torch.randint(0, 256, (n, groups * 16), dtype=torch.uint8, generator=gen)
    scale, zero = torch.rand((n, groups), generator=gen), torch.randn((n, groups), generator=gen)
    tiles, form = int4_bf16_tiles(q, scale, zero, half=False)
    assert form == INT4_FLOAT
    tg = groups if groups % 4 == 2 else -(-groups // 4) * 4
    assert tiles.dtype == torch.uint8 and tiles.shape == (-(-n // 4), 96 * tg) and tiles.is_contiguous()
    corr = (zero.double() - 24 * scale.double()).float()
    for row in range(-(-n // 4) * 4):
        t, r = divmod(row, 4)
        for g0 in range(0, tg, 4):
            gb = min(4, tg - g0)
            block = tiles[t, 96 * g0:96 * (g0 + gb)]
            codes = block[16 * gb * r:16 * gb * (r + 1)]
            floats = block[64 * gb:].view(torch.float32).reshape(2, 4, gb)[:, r]  # [scales, corrections], gb each
            for g in range(gb):
                real = row < n and g0 + g < groups
                want = q[row, 16 * (g0 + g):16 * (g0 + g + 1)] if real else torch.zeros(16, dtype=torch.uint8)
                assert torch.equal(codes[16 * g:16 * (g + 1)], want)
                assert floats[0, g].item() == (scale[row, g0 + g].item() if real else 0.0)
                assert floats[1, g].item() == (corr[row, g0 + g].item() if real else 0.0)


@pytest.mark.parametrize("n, k", [(1, 1), (4, 16), (5, 17), (9, 576)])
def test_int8_bf16_tiles_hold_each_row_s_next_16_codes(n, k):
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    tiles = int8_bf16_tiles(q)
    k16 = -(-k // 16) * 16
    assert tiles.shape == (-(-n // 4), k16 // 16, 4, 16) and tiles.is_contiguous()
    padded = torch.zeros((-(-n // 4) * 4, k16), dtype=torch.int8)
    padded[:n, :k] = q
    for row in range(padded.shape[0]):
        for c in range(k16 // 16):
            assert torch.equal(tiles[row // 4, c, row % 4], padded[row, 16 * c:16 * (c + 1)])


def _q4_1(n: int, k: int, seed: int) -> Int4Linear:
    """An Int4Linear as a Q4_1 file gives it (fastgate.assets.quant.q4_1_codes): scale = d, zero = m + 8 d, d and m
    float16."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand((n, k // 32), generator=gen) * 0.02 + 1e-4).to(torch.float16).float()
    m = (torch.randn((n, k // 32), generator=gen) * 0.05).to(torch.float16).float()
    return Int4Linear(q, d, m + 8.0 * d)


@pytest.mark.parametrize("n", [1, 7, 769])
@pytest.mark.parametrize("k", [32, 96, 160, 576, 1536])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_int4_half_tiles_give_the_float_tiles_bits(n, k, m):
    """A Q4_1 layer's tiles hold its float16 d and m (80 bytes a row-group's block, not 96): the kernel makes the
    float32 scale and correction the float form holds, so every output is the same bits, with a residual too."""
    ext = _ext()
    layer = _q4_1(n, k, seed=n + k + m)
    half, form = int4_bf16_tiles(layer.q, layer.scale, layer.zero)
    full, form32 = int4_bf16_tiles(layer.q, layer.scale, layer.zero, half=False)
    assert (form, form32) == (INT4_HALF, INT4_FLOAT) and half.shape[1] * 96 == full.shape[1] * 80
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    res = torch.randn((m, n)).to(torch.bfloat16)
    outs = []
    for tiles, f in ((half, form), (full, form32)):
        for residual in (0, res.data_ptr()):
            out = torch.empty((m, n), dtype=torch.bfloat16)
            ext.int4_matmul_bf16(x.data_ptr(), k, tiles.data_ptr(), f, out.data_ptr(), m, n, k, 2, 0, 1e-6, residual)
            outs.append(out)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    _close_to_definition(outs[0], int4_reference(x, layer.q, layer.scale, layer.zero))


def test_int4_tiles_take_the_float_form_where_the_floats_are_not_a_q4_1_file_s():
    layer = _int4(8, 64, seed=1)  # quantize_int4 of float weights: float32 scales
    assert int4_bf16_tiles(layer.q, layer.scale, layer.zero)[1] == INT4_FLOAT
    with pytest.raises(ValueError, match="Q4_1"):
        int4_bf16_tiles(layer.q, layer.scale, layer.zero, half=True)
    assert int4_bf16_form(layer.scale, layer.zero) == INT4_FLOAT
    q41 = _q4_1(8, 64, seed=1)
    assert int4_bf16_tiles(q41.q, q41.scale, q41.zero)[1] == INT4_HALF == int4_bf16_form(q41.scale, q41.zero)
    assert bf16_tiles(q41)[1] == INT4_HALF


def test_bf16_tiles_are_made_once_and_again_for_new_codes():
    layer = _int4(12, 64, seed=4)
    tiles = bf16_tiles(layer)
    assert bf16_tiles(layer) is tiles
    layer.q = layer.q.clone()  # replaced codes (a refresh, a join)
    again = bf16_tiles(layer)
    assert again is not tiles and torch.equal(again[0], tiles[0]) and again[1] == tiles[1]


@pytest.mark.parametrize("n", [1, 7, 769])
@pytest.mark.parametrize("k", [1, 15, 16, 17, 97, 576])
@pytest.mark.parametrize("m", [1, 5])
def test_int8_kernel_is_the_definition_rounded_once(n, k, m):
    op = ext_int8_matmul(_ext())
    gen = torch.Generator().manual_seed(n + k + m)
    layer = Int8Linear(*quantize_int8(torch.randn((n, k), generator=gen)))
    x = torch.randn((m, k), generator=gen).to(torch.bfloat16)
    _close_to_definition(op(x, layer), int8_reference(x, layer.q, layer.scale))
    wide = torch.randn((m, k + 9), generator=gen).to(torch.bfloat16)[:, 4:4 + k]  # strided rows
    _close_to_definition(op(wide, layer), int8_reference(wide, layer.q, layer.scale))


def test_two_threads_give_one_thread_s_bits():
    """Enough work for the kernels to start a second thread (each thread its own blocks of 64 weight rows)."""
    ext = _ext()
    layer = _int4(2048, 576, seed=1)
    head = Int8Linear(*quantize_int8(torch.randn(4099, 576)))
    x = torch.randn((4, 576)).to(torch.bfloat16)
    tiles4, form = bf16_tiles(layer)
    (tiles8,) = bf16_tiles(head)
    for name, lay, args in (("int4_matmul_bf16", layer, (tiles4.data_ptr(), form)),
                            ("int8_matmul_bf16", head, (tiles8.data_ptr(), head.scale.data_ptr()))):
        outs = []
        for threads in (1, 2):
            out = torch.empty((4, lay.out_features), dtype=torch.bfloat16)
            getattr(ext, name)(x.data_ptr(), x.stride(0), *args, out.data_ptr(), 4,
                               lay.out_features, lay.in_features, threads)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), name


def test_inputs_the_kernels_do_not_take_go_to_torch_s_kernels():
    """Rows without a unit stride along K: torch's kernels (a stand-in extension records its calls)."""
    calls = []

    class Ext:
        def int4_matmul_bf16(self, *args):
            calls.append("int4")

        def int8_matmul_bf16(self, *args):
            calls.append("int8")

    layer4, layer8 = _int4(16, 64, seed=2), Int8Linear(*quantize_int8(torch.randn(16, 64)))
    op4, op8 = ext_int4_matmul(Ext()), ext_int8_matmul(Ext())
    transposed = torch.randn(64, 3).to(torch.bfloat16).T  # [3, 64], stride 1 along the rows
    assert torch.equal(op4(transposed, layer4), torch_int4_matmul(transposed, layer4))
    assert torch.equal(op8(transposed, layer8), torch_int8_matmul(transposed, layer8))
    assert calls == []
    op4(transposed.contiguous(), layer4)
    op8(transposed.contiguous(), layer8)
    assert calls == ["int4", "int8"]


@pytest.mark.parametrize("k", [7, 17, 769])
def test_torch_s_int8_product_of_a_k_its_kernel_does_not_take_is_the_dense_one(k):
    """bf16 rows of a K that is not a multiple of 16: aten._weight_int8pack_mm crashed the process; the torch op (and
    the C++ op's fallback, which calls it) multiply the de-quantized weight instead."""
    layer = Int8Linear(*quantize_int8(torch.randn(11, k, generator=torch.Generator().manual_seed(k))))
    for rows in (torch.randn(2, k, dtype=torch.bfloat16), torch.randn(k, 3, dtype=torch.bfloat16).T):  # [M, K], a view
        ref = int8_reference(rows, layer.q, layer.scale)
        _close_to_definition(torch_int8_matmul(rows, layer), ref)
        _close_to_definition(build_ops("auto", torch.device("cpu")).int8_matmul(rows, layer), ref)


def test_a_bound_int4_product_sends_rows_its_kernel_does_not_take_to_the_op():
    """Rows whose row stride is below K (an expanded row, a transposed [1, K] view): the bound product's check is the
    op's, so they take the op's fallback instead of reaching the kernel (which refused them)."""
    op = ext_int4_matmul(_ext())
    layer = _int4(7, 64, seed=3)
    bound = op.bind(layer)
    for x in (torch.randn(1, 64, dtype=torch.bfloat16).expand(3, 64), torch.randn(64, 1, dtype=torch.bfloat16).T):
        assert x.stride(0) < 64
        assert torch.equal(bound(x), op(x, layer)) and torch.equal(bound(x), torch_int4_matmul(x, layer))


def test_the_registry_binds_the_kernels_where_the_cpu_has_avx512_bf16_or_avx2():
    """bf16 rows' kernels where the CPU has AVX512-BF16, float32 rows' where it has AVX2 and FMA: either binds the
    ops to the extension (tests/test_quant_f32_kernels.py has the float32 side)."""
    torch_ops = build_ops("torch", "cpu")
    assert torch_ops.int4_matmul is torch_int4_matmul and torch_ops.int8_matmul is torch_int8_matmul
    assert torch_ops.backends["int4_matmul"] == "torch"
    ext = import_ext()
    auto = build_ops("auto", "cpu")
    expected = "ext" if ext is not None and (ext.quant_kernels_supported() or ext.quant_f32_kernels_supported()) \
        else "torch"
    assert auto.backends["int4_matmul"] == auto.backends["int8_matmul"] == expected
