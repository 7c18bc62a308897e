"""The C++ weight-only products of float32 rows (csrc/ops.cpp ``int4_matmul_f32``, ``int8_matmul_f32``; AVX2 and FMA,
bound as ops int4_matmul / int8_matmul for float32 rows) against the definitions (fastgate.assets.quant.int4_reference,
int8_reference) in float64: awkward shapes (1 row, primes, 769, one to 48 groups, K not a multiple of 8), more input
rows than a tile, strided rows, views of joined layers, extreme inputs, the residual sum bitwise torch's, two threads;
what they do not take goes to the references; ``auto`` holds an embedded float32 model's weights as ``int4-dense``
only where these kernels run and only when ``auto`` chose float32."""

from __future__ import annotations

import pytest
import torch

from fastgate.assets.quant import (
    Int4Linear,
    Int8Linear,
    choose_weights,
    int4_dequantize,
    quantize_int4,
    quantize_int8,
)
from fastgate.ops.quant import (
    ext_int4_matmul,
    ext_int8_matmul,
    f32_tiles,
    int4_tiles,
    int8_tiles,
    torch_int4_matmul,
    torch_int8_matmul,
)
from fastgate.ops.registry import build_ops, import_ext


def _ext():
    ext = import_ext()
    if ext is None or not getattr(ext, "quant_f32_kernels_supported", lambda: False)():
        pytest.skip("needs the C++ extension on an x86-64 CPU with AVX2 and FMA")
    return ext


def _ops(ext):
    return ext_int4_matmul(ext, bf16=False, f32=True), ext_int8_matmul(ext, bf16=False, f32=True)


def _close(y: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``y`` (float32) is the float64 definition ``ref[0]`` up to float32 sums in another order: within 1e-5 of the
    sum of the terms' magnitudes ``ref[1]`` (a wrong code or scale is off by ~1/15 of its term)."""
    value, magnitude = ref
    assert y.dtype == torch.float32 and y.shape == value.shape
    tol = magnitude * 1e-5 + 1e-7
    bad = (y.double() - value).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} outputs off, worst {((y.double() - value).abs() - tol).max().item():.3g}"


def _int4(n: int, k: int, seed: int) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    q, scale, zero = quantize_int4(torch.randn((n, k), generator=gen) * 0.05)
    return Int4Linear(q, scale, zero)


def _ref4(x: torch.Tensor, layer: Int4Linear) -> tuple[torch.Tensor, torch.Tensor]:
    w = int4_dequantize(layer.q, layer.scale, layer.zero, torch.float64)  # [N, K]
    return x.double() @ w.T, x.double().abs() @ w.abs().T  # [M, N] each


def _ref8(x: torch.Tensor, layer: Int8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    w = layer.q.double() * layer.scale.double()[:, None]  # [N, K]
    return x.double() @ w.T, x.double().abs() @ w.abs().T  # [M, N] each


@pytest.mark.parametrize("n", [1, 7, 769, 1031])
@pytest.mark.parametrize("k", [32, 64, 96, 160, 576, 608, 1536])  # groups: 1, 2, 3, 5, 18, 19, 48
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 13, 16])  # tiles of up to 6 input rows: 6, 6 + 1, 6 + 6 + 4 too
def test_int4_f32_kernel_is_the_definition(n, k, m):
    op, _ = _ops(_ext())
    layer = _int4(n, k, seed=n * k + m)
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(m))
    _close(op(x, layer), _ref4(x, layer))


@pytest.mark.parametrize("m", [2, 4, 6, 7, 16, 17])
def test_int4_f32_kernel_rows_are_bitwise_alike_in_any_tile(m):
    """An output's arithmetic does not depend on the tile that computed it: each row of an m-row product (tiles of up
    to six input rows by one weight row) is bitwise that row's one-row product (tiles of eight and four weight rows),
    on one thread and on two."""
    op, _ = _ops(_ext())
    layer = _int4(203, 608, seed=m)
    x = torch.randn((m, 608), generator=torch.Generator().manual_seed(m))
    for threads in (1, 2):
        with torch.inference_mode():
            prev = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                y = op(x, layer)
                rows = [op(x[i:i + 1], layer) for i in range(m)]
            finally:
                torch.set_num_threads(prev)
        for i in range(m):
            assert torch.equal(y[i:i + 1], rows[i]), f"row {i} of {m} differs from its one-row product"


def test_int4_f32_kernel_of_strided_rows_of_a_view_of_joined_rows_and_extreme_inputs():
    op, _ = _ops(_ext())
    big = _int4(40, 576, seed=3)
    part = Int4Linear(big.q[16:37], big.scale[16:37], big.zero[16:37])  # contiguous views, ending before the tensor
    x = torch.randn((5, 700))[:, 50:626]  # [5, 576], rows 700 apart
    assert x.stride() == (700, 1)
    _close(op(x, part), _ref4(x, part))
    _close(op(x, big)[:, 16:37].contiguous(), _ref4(x, part))
    layer = _int4(33, 256, seed=9)
    layer.q[:8] = 0
    layer.q[8:16] = 0xFF
    x = torch.cat([torch.randn(1, 256) * 1e3, torch.randn(1, 256) * 1e-3, torch.randn(1, 256) + 5.0])
    _close(op(x, layer), _ref4(x, layer))


def test_int4_f32_residual_sum_and_bound_layer_are_torch_s_bits():
    """``bind(layer).added(x, h)`` is ``h + product(x)`` bitwise (one float32 addition, as torch adds them), and the
    bound product is the op's."""
    op, _ = _ops(_ext())
    layer = _int4(769, 576, seed=4)
    bound = op.bind(layer)
    assert not hasattr(bound, "normed")  # the fused norm is bf16's
    for m in (1, 2, 3):
        x, h = torch.randn((m, 576)), torch.randn((m, 769))
        y = bound(x)
        assert torch.equal(y, op(x, layer))
        assert torch.equal(bound.added(x, h), h + y)
    bf = torch.randn((2, 576)).to(torch.bfloat16)  # no bf16 kernel bound: torch's
    assert torch.equal(bound(bf), torch_int4_matmul(bf, layer))


@pytest.mark.parametrize("n", [1, 7, 769])
@pytest.mark.parametrize("k", [1, 7, 8, 13, 97, 576])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_int8_f32_kernel_is_the_definition(n, k, m):
    _, op = _ops(_ext())
    gen = torch.Generator().manual_seed(n + k + m)
    layer = Int8Linear(*quantize_int8(torch.randn((n, k), generator=gen)))
    x = torch.randn((m, k), generator=gen)
    _close(op(x, layer), _ref8(x, layer))
    wide = torch.randn((m, k + 9), generator=gen)[:, 4:4 + k]  # strided rows
    _close(op(wide, layer), _ref8(wide, layer))


def test_f32_kernels_two_threads_give_one_thread_s_bits():
    """Also where the threads' runs of 8-row units split a 64-row block (200 rows: 25 units, 12 : 13, row 96)."""
    ext = _ext()
    layers = [_int4(2048, 576, seed=1), _int4(200, 576, seed=2)]
    heads = [Int8Linear(*quantize_int8(torch.randn(n, 576))) for n in (4099, 203)]
    x = torch.randn((3, 576))
    for name, lay, args in ([("int4_matmul_f32", lay, f32_tiles(lay)) for lay in layers]
                            + [("int8_matmul_f32", head, (*f32_tiles(head), head.scale)) for head in heads]):
        outs = []
        for threads in (1, 2):
            out = torch.empty((3, lay.out_features))
            getattr(ext, name)(x.data_ptr(), x.stride(0), *(t.data_ptr() for t in args), out.data_ptr(), 3,
                               lay.out_features, lay.in_features, threads)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), name


def test_the_tiles_hold_each_row_s_codes_where_the_kernels_read_them():
    """Tile t, group g, slot r of the int4 tiles is row 8 t + r's group g (codes, scale, zero - 8 scale); the int8 tiles
    likewise by 8 columns; rows past N and columns past K are zero."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (13, 48), generator=gen, dtype=torch.uint8)  # N = 13, K = 96
    scale, zero = torch.rand((13, 3), generator=gen), torch.randn((13, 3), generator=gen)
    qt, st, ot = int4_tiles(q, scale, zero)
    assert qt.shape == (2, 3, 8, 16) and st.shape == ot.shape == (2, 3, 8)
    for n in range(16):
        for g in range(3):
            want = q[n, 16 * g:16 * g + 16] if n < 13 else torch.zeros(16, dtype=torch.uint8)
            assert torch.equal(qt[n // 8, g, n % 8], want)
            assert st[n // 8, g, n % 8] == (scale[n, g] if n < 13 else 0)
            assert ot[n // 8, g, n % 8] == (zero[n, g] - 8 * scale[n, g] if n < 13 else 0)
    q8 = torch.randint(-127, 128, (9, 13), generator=gen, dtype=torch.int8)  # K = 13: padded to 16
    t8 = int8_tiles(q8)
    assert t8.shape == (2, 2, 8, 8)
    padded = torch.zeros((16, 16), dtype=torch.int8)
    padded[:9, :13] = q8
    assert torch.equal(t8.permute(0, 2, 1, 3).reshape(16, 16), padded)


def test_a_layer_s_tiles_are_made_once_and_again_for_new_codes():
    layer = _int4(24, 64, seed=4)
    tiles = f32_tiles(layer)
    assert f32_tiles(layer) is tiles
    q, scale, zero = quantize_int4(torch.randn((24, 64)))
    layer.q, layer.scale, layer.zero = q, scale, zero
    layer.refresh()
    again = f32_tiles(layer)
    assert again is not tiles and torch.equal(again[0], int4_tiles(q, scale, zero)[0])


def test_a_row_s_product_does_not_depend_on_the_rows_beside_it():
    """The kernels' tiles differ with the rows a call has (one input row: eight weight rows a tile, their offsets
    summed at once; more: one weight row at a time): a row's output is the same bits either way."""
    ext = _ext()
    int4_op, int8_op = _ops(ext)
    gen = torch.Generator().manual_seed(6)
    for n, k in ((13, 64), (129, 160), (769, 576)):
        layer = _int4(n, k, seed=n)
        head = Int8Linear(*quantize_int8(torch.randn((n, k + 3), generator=gen)))
        for op, lay, width in ((int4_op, layer, k), (int8_op, head, k + 3)):
            x = torch.randn((7, width), generator=gen)
            whole = op(x, lay)
            for m in (1, 2, 5):
                assert torch.equal(op(x[:m], lay), whole[:m]), (n, k, m)
            assert torch.equal(op(x[3:4], lay), whole[3:4])


def test_f32_kernels_refuse_bad_shapes():
    ext = _ext()
    x, out = torch.randn(1, 48), torch.empty(1, 4)
    q, s = torch.zeros(4, 24, dtype=torch.uint8), torch.ones(4, 1)
    with pytest.raises(ValueError, match="multiple of 32"):  # K = 48
        ext.int4_matmul_f32(x.data_ptr(), 48, q.data_ptr(), s.data_ptr(), s.data_ptr(), out.data_ptr(), 1, 4, 48)
    with pytest.raises(ValueError, match="bad shape"):
        ext.int8_matmul_f32(x.data_ptr(), 10, q.data_ptr(), s.data_ptr(), out.data_ptr(), 1, 4, 48)


def test_the_references_of_float32_rows_are_the_dense_definitions():
    """Without the kernels (another CPU, the ``torch`` backend) float32 rows multiply the de-quantized weight (the
    kept copy where the layer has one): torch's own kernel runs a scalar loop on float32 rows."""
    layer = _int4(37, 96, seed=5)
    x = torch.randn(3, 96)
    _close(torch_int4_matmul(x, layer), _ref4(x, layer))
    layer.keep_dense(torch.float32)
    assert torch.equal(torch_int4_matmul(x, layer), torch.nn.functional.linear(x, layer.dense))
    head = Int8Linear(*quantize_int8(torch.randn(11, 96)))
    _close(torch_int8_matmul(x, head), _ref8(x, head))


def test_ops_without_float32_kernels_hand_float32_rows_to_the_references():
    calls = []

    class Ext:
        def int4_matmul_bf16(self, *args):
            calls.append("bf16")

        def int4_matmul_f32(self, *args):
            calls.append("f32")

    layer = _int4(16, 64, seed=2)
    x = torch.randn(2, 64)
    op = ext_int4_matmul(Ext())  # bf16 only: the registry on a CPU with AVX512-BF16 and no float32 kernels
    assert op.float32 is False
    assert torch.equal(op(x, layer), torch_int4_matmul(x, layer)) and calls == []
    assert torch.equal(op.bind(layer)(x), torch_int4_matmul(x, layer)) and calls == []
    ext_int4_matmul(Ext(), bf16=False, f32=True)(x, layer)
    assert calls == ["f32"]


def test_the_registry_binds_float32_kernels_where_the_cpu_has_avx2_and_fma():
    ext = import_ext()
    auto = build_ops("auto", "cpu")
    has = ext is not None and getattr(ext, "quant_f32_kernels_supported", lambda: False)()
    assert getattr(auto.int4_matmul, "float32", False) is has
    assert getattr(auto.int8_matmul, "float32", False) is has
    if has:
        assert auto.backends["int4_matmul"] == auto.backends["int8_matmul"] == "ext"
    assert not getattr(build_ops("torch", "cpu").int4_matmul, "float32", False)


def test_auto_weights_of_a_float32_model_follow_the_kernels_and_who_chose_float32():
    cpu = torch.device("cpu")
    pick = choose_weights("auto", cpu, torch.float32, gguf_blocks=True, capability="AVX2", dtype_auto=True,
                          f32_kernels=True)
    assert pick.weights == "int4-dense" and "float32 by auto" in pick.reason
    for kwargs in ({"dtype_auto": False, "f32_kernels": True},  # float32 asked: the reference dtype stays float
                   {"dtype_auto": True, "f32_kernels": False}):  # no kernels here
        assert choose_weights("auto", cpu, torch.float32, gguf_blocks=True, capability="AVX2", **kwargs).weights \
            == "float"
    assert choose_weights("auto", cpu, torch.float32, gguf_blocks=False, dtype_auto=True,
                          f32_kernels=True).weights == "float"  # a local model: not re-quantized unasked
    assert choose_weights("int4", cpu, torch.float32, gguf_blocks=False).weights == "int4"


def test_the_fused_head_takes_float32_rows_through_the_int8_kernel_up_to_its_rows():
    """An int4-dense float32 model's int8 head multiplies up to ``float32_rows`` (64) float32 rows through the op's
    kernel, not its kept float32 copy (whose 4-row crossover is bf16's): at 16 rows the copy cost a batch-16 step of
    SmolLM2 28 of its 106 ms. bf16 rows, and an op without float32 kernels, keep the head's own rows."""
    from fastgate.assets.quant import quantize_model
    from fastgate.engine.fused import _op_rows, fused_forward
    from fastgate.ops.quant import F32_INT8_ROWS
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=torch.float32, n_layers=2)
    quantize_model(lm.model, "int4-dense", codes={})  # no 4-bit codes named: every layer int8 (SmolLM2's head is)
    fused = fused_forward(lm.model)
    head = fused.head
    assert isinstance(head, Int8Linear) and head._kept(torch.float32) is not None
    assert head.kernel_rows < F32_INT8_ROWS
    _, int8 = _ops(_ext())
    assert _op_rows(head, int8, torch.float32) == F32_INT8_ROWS
    assert _op_rows(head, int8, torch.bfloat16) == head.kernel_rows
    assert _op_rows(head, ext_int8_matmul(_ext(), bf16=True, f32=False), torch.float32) == head.kernel_rows
    x = torch.randn((F32_INT8_ROWS, head.in_features))
    _close(int8(x, head), _ref8(x, head))
