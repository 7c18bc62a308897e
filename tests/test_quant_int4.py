"""Weight-only int4 linear layers (fastgate.assets.quant, ``--weights int4``): products against the de-quantized
definition over awkward shapes, the GGUF Q4_1 / Q4_K blocks mapped onto groups of 32, the fused joins, and the tiny
model generating with them."""

from __future__ import annotations

import pytest
import torch
from bf16_rounding import assert_bf16_rounded

from fastgate.assets.quant import (
    GROUP,
    INT4_KERNEL_ROWS,
    Int4Linear,
    Int8Linear,
    canonical_weights,
    int4_dequantize,
    int4_reference,
    pack_nibbles,
    packed_rows_split,
    q4_1_codes,
    q4_k_codes,
    quantize_int4,
    quantize_model,
    quantized_layers,
    unpack_nibbles,
)
from fastgate.testing import assert_greedy_equals_hf_generate, random_linear

# (rows, K, N): one row, primes (N 7, 17, 31, 769; K 13 and 3 groups), N not a multiple of 16 (the packing pads it),
# rows beyond the kernel's (the de-quantized dense product)
SHAPES = [(1, 32, 1), (1, 416, 7), (3, 64, 769), (5, 96, 17), (2, 32, 31), (1, 576, 192), (16, 64, 128),
          (INT4_KERNEL_ROWS + 1, 96, 11), (7, 32, 769)]


def _layer(k: int, n: int, bias: bool = False, seed: int = 0) -> Int4Linear:
    lin = random_linear(k, n, bias, seed)
    return Int4Linear.from_linear(lin)


def _kernel_definition(q: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``aten._weight_int4pack_mm_for_cpu`` computes before rounding its output to bf16, without the bias: the rows
    in bf16 times the weight de-quantized in float32 from the bf16 scales and zeros it is packed with
    (``scale_zeros``), summed in float32. Against the float32 scales and zeros this is no per-output bound: a zero's
    rounding to bf16 (of ~8 scales) adds up over ``K`` while the output cancels (seen: 10x this bound)."""
    return int4_reference(x.to(torch.bfloat16), q.q, q.scale.to(torch.bfloat16), q.zero.to(torch.bfloat16))


def _assert_bias_added_to(y: torch.Tensor, product: torch.Tensor, bias: torch.Tensor, roundings: int) -> None:
    """``y`` is ``product + bias`` rounded to bf16 ``roundings`` times, relative to ``|product| + |bias|`` (the bias is
    added after the product is rounded). In bf16 that is 2: the product's rounding (of ``|product|``), the bias's
    (``|bias|``) and the sum's (``|product + bias|``) add up to at most two of ``|product| + |bias|``."""
    assert_bf16_rounded(y, product + bias, product.abs() + bias.abs(), roundings)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int4_product_equals_the_dequantized_reference_in_float32(m, k, n):
    q = _layer(k, n, bias=n % 2 == 1)
    q.bf16_products = False  # float32 rows stay float32: the de-quantized dense product
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(1))
    assert not q.uses_kernel(x)
    y = q(x)
    assert y.dtype is torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y, int4_reference(x, q.q, q.scale, q.zero, q.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_rows_are_the_reference_within_bf16_rounding(m, k, n, dtype):
    """Rows through the kernel (bf16 rows, bf16 scales and zeros) or, beyond its rows, the dense product: the output in
    the rows' dtype, the definition within bf16 rounding."""
    q = _layer(k, n, bias=True)
    q.bf16_products = True
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(2)).to(dtype)
    assert q.uses_kernel(x) == (m <= INT4_KERNEL_ROWS)
    y = q(x)
    assert y.dtype is dtype and y.shape == (m, n)
    bf16_rows = dtype is torch.bfloat16  # bf16 rows: the bias is added in bf16 (_assert_bias_added_to)
    if q.uses_kernel(x):  # the kernel's product rounded once to bf16 (float32 rows: the bias added in float32)
        _assert_bias_added_to(y, _kernel_definition(q, x), q.bias, 2 if bf16_rows else 1)
    else:  # the dense product of the weight de-quantized in the rows' dtype, summed in float32, rounded to it
        product = torch.nn.functional.linear(x.float(), q.dequantized(dtype).float())
        _assert_bias_added_to(y, product, q.bias, 2 if bf16_rows else 0)


def test_int4_product_of_non_contiguous_and_3d_inputs():
    q = _layer(64, 769, bias=True)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn((4, 128), generator=gen)
    for x in (wide[:, ::2], torch.randn((64, 4), generator=gen).T, torch.randn((2, 3, 64), generator=gen)):
        for via_bf16 in (False, True):
            q.bf16_products = via_bf16
            y = q(x)
            assert y.dtype is torch.float32 and y.shape == (*x.shape[:-1], 769)
            if via_bf16:  # the kernel's product rounded once to bf16, the bias added in float32
                _assert_bias_added_to(y, _kernel_definition(q, x), q.bias, 1)
            else:
                torch.testing.assert_close(y, int4_reference(x, q.q, q.scale, q.zero, q.bias), rtol=1e-5, atol=1e-5)
        y = q(x.to(torch.bfloat16))
        assert y.dtype is torch.bfloat16 and y.shape == (*x.shape[:-1], 769)
        _assert_bias_added_to(y, _kernel_definition(q, x), q.bias, 2)


def test_int4_quantization_error_is_bounded_by_half_a_step():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn((769, 96), generator=gen)
    w[5] = 0.0  # constant groups keep scale 1 and reproduce exactly
    w[6, 3] = 1e3  # an outlier costs its own group only
    q, scale, zero = quantize_int4(w)
    assert q.shape == (769, 48) and q.dtype is torch.uint8 and scale.shape == zero.shape == (769, 3)
    deq = int4_dequantize(q, scale, zero)
    err = (w - deq).abs().view(769, 3, GROUP)
    assert bool((err <= scale[..., None] / 2 + 1e-5).all())
    assert torch.equal(deq[5], w[5]) and bool((err[6, 1:] <= scale[6, 1:, None] / 2 + 1e-5).all())
    assert torch.equal(unpack_nibbles(pack_nibbles(torch.arange(32).remainder(16)[None])), torch.arange(32)[None] % 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 48))


def _q4_1_block(d: float, m: float, codes: list[int]) -> bytes:
    """One Q4_1 block as llama.cpp writes it: d, m (float16), value j in byte j's low nibble, j + 16 in its high."""
    import numpy as np

    qs = bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
    return np.array([d, m], dtype=np.float16).tobytes() + qs


def test_a_hand_made_q4_1_block_maps_exactly_onto_a_group():
    codes = [0, 15, 8, 7, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    raw = torch.frombuffer(bytearray(_q4_1_block(0.5, -1.25, codes) + _q4_1_block(0.25, 2.0, codes[::-1])),
                           dtype=torch.uint8).reshape(1, 40)  # one row of two blocks: K = 64
    q, scale, zero = q4_1_codes(raw, 64)
    assert torch.equal(unpack_nibbles(q)[0], torch.tensor(codes + codes[::-1], dtype=torch.uint8))
    assert scale.tolist() == [[0.5, 0.25]] and zero.tolist() == [[-1.25 + 4.0, 2.0 + 2.0]]
    expected = [c * 0.5 - 1.25 for c in codes] + [c * 0.25 + 2.0 for c in codes[::-1]]  # w = q d + m
    assert int4_dequantize(q, scale, zero)[0].tolist() == expected  # exact: binary fractions


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_gguf_blocks_map_onto_groups_as_gguf_dequantizes_them(kind):
    """Random blocks (finite float16 scales) against gguf-py's own de-quantization, the one the conversion used."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n, k = 5, 512
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // block_values, block_bytes), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.1, size=(n, k // block_values, 2)).astype(np.float16)
    halves[..., 1] *= -1 if kind == "Q4_1" else 1  # Q4_1's m is a minimum, Q4_K's dmin a positive scale
    raw[..., 0:4] = halves.view(np.uint8).reshape(n, k // block_values, 4)
    raw = raw.reshape(n, -1)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(n, k)
    decode = q4_1_codes if kind == "Q4_1" else q4_k_codes
    q, scale, zero = decode(torch.from_numpy(raw), k)
    assert scale.shape == (n, k // GROUP)
    torch.testing.assert_close(int4_dequantize(q, scale, zero), expected, rtol=0, atol=1e-6)


def test_llama_rows_undo_llama_cpp_s_q_k_permutation():
    from fastgate.assets.models import _llama_rows

    heads, dim, k = 3, 8, 4
    w = torch.arange(heads * dim * k).reshape(heads * dim, k)
    permuted = w.reshape(heads, 2, dim // 2, k).transpose(1, 2).reshape(w.shape)  # convert_hf_to_gguf's permute
    assert torch.equal(_llama_rows(permuted, heads), w)


def test_quantize_model_int4_swaps_blocks_and_head_and_falls_back_to_int8(tiny):
    from fastgate.testing import tiny_model

    assert canonical_weights("INT4") == "int4"
    lm = tiny_model()
    n = quantize_model(lm.model, "int4")
    assert n == lm.n_layers * 7 + 1 == quantized_layers(lm.model)
    assert all(isinstance(m, Int4Linear) and m.source == "quantized" for m in lm.model.modules()
               if isinstance(m, (Int4Linear, Int8Linear)))
    assert torch.equal(lm.model.lm_head.q, quantize_int4(tiny.model.lm_head.weight)[0])
    # the logits of the float model holding the de-quantized weights (bf16 products: a relative 2^-9 a product)
    ref = tiny_model()
    with torch.no_grad():
        for name, module in lm.model.named_modules():
            if isinstance(module, Int4Linear):
                ref.model.get_submodule(name).weight.copy_(module.dequantized())
    ids = lm.tokenizer("Who wrote Hamlet?", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = ref.model(ids).logits, lm.model(ids).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 0.03

    # codes for some layers only (a GGUF with other types): the rest int8, and q/k/v, gate/up alike
    lm = tiny_model(n_layers=2)
    codes = {f"model.layers.0.self_attn.{p}_proj": quantize_int4(getattr(lm.model.model.layers[0].self_attn,
                                                                         f"{p}_proj").weight) for p in "qko"}
    quantize_model(lm.model, "int4", codes=codes)
    attn = lm.model.model.layers[0].self_attn
    assert isinstance(attn.o_proj, Int4Linear) and attn.o_proj.source == "gguf"
    assert all(isinstance(getattr(attn, f"{p}_proj"), Int8Linear) for p in "qkv")  # v had none: q, k follow it
    assert isinstance(lm.model.lm_head, Int8Linear)

    # a K that is not a multiple of 32 stays int8
    lm = tiny_model(n_layers=1, hidden=48)
    quantize_model(lm.model, "int4")
    mlp = lm.model.model.layers[0].mlp
    assert isinstance(mlp.gate_proj, Int8Linear) and isinstance(mlp.down_proj, Int4Linear)  # K 48 and 96


@pytest.mark.parametrize("hidden", [64, 128])
def test_fused_joins_of_int4_parts(hidden):
    """The fused q/k/v and gate/up products: the plain codes joined and packed once, the parts' codes views of the
    join, and their packed weights views of the joined packed one where every part is a multiple of 64 rows
    (hidden 128: q 128, k and v 64, gate and up 256) or their own packing (hidden 64: k and v of 32 rows)."""
    from fastgate.engine.fused import fused_forward
    from fastgate.testing import tiny_model

    lm = tiny_model(n_layers=1, hidden=hidden)
    quantize_model(lm.model, "int4")
    attn = lm.model.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn((3, hidden), generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    before = [p(x) for p in parts]
    layer = fused_forward(lm.model).layers[0]
    fused = layer.qkv
    assert isinstance(fused, Int4Linear) and fused.out_features == sum(p.out_features for p in parts)
    assert all(p.q.untyped_storage().data_ptr() == fused.q.untyped_storage().data_ptr() for p in parts)
    shares = [p.packed.untyped_storage().data_ptr() == fused.packed.untyped_storage().data_ptr() for p in parts]
    assert all(shares) == (hidden % 128 == 0 and packed_rows_split())
    joined = fused(x)
    assert torch.equal(torch.cat([p(x) for p in parts], dim=1), joined)  # each column its own dot product
    assert all(torch.equal(a, b) for a, b in zip(before, [p(x) for p in parts]))
    mlp = lm.model.model.layers[0].mlp
    gu = layer.gate_up(x)
    assert torch.equal(gu, torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=1))


def _int4_engine(dtype: torch.dtype = torch.float32):
    from fastgate.engine.local import Engine
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=dtype)
    quantize_model(lm.model, "int4")
    lm.weights = "int4"
    return Engine(lm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_generation_with_int4_weights_equals_hf_generate(dtype):
    """The engine (the fused packed pass) against HF's own generate over the same int4 modules."""
    assert_greedy_equals_hf_generate(_int4_engine(dtype))


def test_eval_records_name_int4_and_refuse_a_resume_under_int8(small_index, tmp_path):
    from fastgate.errors import InputError
    from fastgate.eval.datasets import QAExample
    from fastgate.eval.runner import ResultsStore, RunSpec, evaluate
    from fastgate.serving.runtime import Runtime

    examples = [QAExample("q1", "What is the capital of France?", ("Paris",)),
                QAExample("q2", "Who wrote Hamlet?", ("Shakespeare",))]
    run = RunSpec("never", None)
    store = ResultsStore(tmp_path / "results.jsonl")
    int4 = Runtime("tiny", index=str(small_index), engine=_int4_engine())
    assert int4.weights_name == "int4" and Runtime("tiny", weights="int4").weights_name == "int4"
    evaluate(int4, [run], examples[:1], store, progress=False)
    assert [(r["weights"], r["dtype"]) for r in store.records.values()] == [("int4", "float32")]
    int8 = _int4_engine()
    int8.lm.weights = "int8"
    with pytest.raises(InputError, match="int4 weights, but this run would use int8"):
        evaluate(Runtime("tiny", index=str(small_index), engine=int8), [run], examples, ResultsStore(store.path),
                 progress=False)


@pytest.mark.parametrize("hidden", [64, 128])
def test_int4_dense_equals_int4_at_its_kernel_rows_and_keeps_one_copy(hidden):
    """``int4-dense``: the int4 kernel up to DENSE_KERNEL_ROWS rows and the kept de-quantized copy beyond, so its
    products equal ``int4``'s with the same bound bitwise (the copy is what ``int4`` de-quantizes every call); the
    fused q/k/v and gate/up layers keep the copy, their parts views of it (one copy a weight)."""
    from fastgate.assets.quant import DENSE_KERNEL_ROWS
    from fastgate.engine.fused import fused_forward
    from fastgate.testing import tiny_model

    dense, plain = tiny_model(n_layers=1, hidden=hidden, dtype=torch.bfloat16), tiny_model(
        n_layers=1, hidden=hidden, dtype=torch.bfloat16)
    quantize_model(dense.model, "int4-dense")
    quantize_model(plain.model, "int4", kernel_rows=DENSE_KERNEL_ROWS)
    layers = [m for m in dense.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert layers and all(m.dense is not None and m.dense.dtype == torch.bfloat16 for m in layers)
    assert all(m.kernel_rows == DENSE_KERNEL_ROWS for m in layers)
    assert not any(key.endswith(".dense") for key in dense.model.state_dict())  # not saved: derived from the codes
    gen = torch.Generator().manual_seed(3)
    for rows in (1, DENSE_KERNEL_ROWS, DENSE_KERNEL_ROWS + 1, 7, 33):
        x = torch.randn((rows, hidden), generator=gen).to(torch.bfloat16)
        for name, m in dense.model.named_modules():
            if isinstance(m, (Int4Linear, Int8Linear)) and m.in_features == hidden:
                assert torch.equal(m(x), plain.model.get_submodule(name)(x)), (name, rows)
    layer = fused_forward(dense.model).layers[0]
    attn, mlp = dense.model.model.layers[0].self_attn, dense.model.model.layers[0].mlp
    for fused, parts in ((layer.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)), (layer.gate_up, (mlp.gate_proj,
                                                                                                  mlp.up_proj))):
        assert all(p.dense.untyped_storage().data_ptr() == fused.dense.untyped_storage().data_ptr() for p in parts)
        x = torch.randn((9, hidden), generator=gen).to(torch.bfloat16)  # beyond the kernel: the copy
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))


def test_greedy_generation_with_int4_dense_weights_equals_hf_generate():
    from fastgate.engine.local import Engine
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=torch.bfloat16)
    quantize_model(lm.model, "int4-dense")
    lm.weights = "int4-dense"
    assert_greedy_equals_hf_generate(Engine(lm))


def test_auto_weights_are_int4_dense_only_where_they_pay():
    from fastgate.assets.quant import WeightsChoice, choose_weights

    cpu = torch.device("cpu")
    pick = choose_weights("auto", cpu, torch.bfloat16, gguf_blocks=True, capability="AVX512")
    assert pick.weights == "int4-dense" and "4-bit decode" in pick.reason
    assert choose_weights("int4", cpu, torch.float32, gguf_blocks=False) == WeightsChoice("int4", "asked")
    others = [choose_weights("auto", cpu, torch.float32, gguf_blocks=True, capability="AVX512"),
              choose_weights("auto", cpu, torch.bfloat16, gguf_blocks=False, capability="AVX512"),
              choose_weights("auto", cpu, torch.bfloat16, gguf_blocks=True, capability="AVX2"),
              choose_weights("auto", torch.device("cuda"), torch.bfloat16, gguf_blocks=True, capability="AVX512")]
    assert [c.weights for c in others] == ["float"] * 4
    assert ["float32" in others[0].reason, "GGUF" in others[1].reason, "AVX2" in others[2].reason,
            "cuda" in others[3].reason] == [True] * 4
    with pytest.raises(ValueError, match="resolve it first"):
        quantize_model(torch.nn.Module(), "auto")


def test_a_runtime_names_its_auto_weights_before_loading():
    """A resumed evaluation checks its records' weights without loading the model: ``auto`` resolves as at load
    (a local or test model: float; float32 weights: float)."""
    from fastgate.serving.runtime import Runtime

    assert Runtime("tiny", dtype="float32").weights_name == "float"
    assert Runtime("smollm2-135m", dtype="float32").weights_name == "float"
    assert Runtime("smollm2-135m", dtype="float32", weights="int8").weights_name == "int8"
    assert Runtime("smollm2-135m", dtype="float16").weights_name == "float"  # a dtype DTYPES does not name


@pytest.mark.parametrize("weights", ["int4-dense", "int8"])
def test_bf16_decode_passes_of_any_rows_take_the_bare_products_with_the_layers_results(weights):
    """The fused pass's decode-only path with quantized layers (a Qwen-like model: q/k/v biases): batches below and
    above the kernels' rows give the general path's tokens, log-probs and taps bitwise."""
    from decode_paths import decode_path_runs

    from fastgate.config import GenerationConfig
    from fastgate.ops.registry import ext_available
    from fastgate.testing import tiny_model

    if not ext_available():
        pytest.skip("the C++ extension is not built")
    lm = tiny_model(dtype=torch.bfloat16, attention_bias=True)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in lm.model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:  # HF starts them at zero
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
    quantize_model(lm.model, weights)
    prompts = [f"Question {i}: who wrote Hamlet" + " and" * i for i in range(7)]  # 7 rows: beyond int4-dense's 4
    cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    out, calls = decode_path_runs(lm, [prompts[:2], prompts], cfg, layers=(0, 1), mid=1)
    assert 7 in calls and min(calls) <= 2  # both sides of the kernels' rows went through the bare path
    for i in (0, 1):  # 2 rows, then 7
        for a, b in zip(out[True][i], out[False][i]):
            assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
