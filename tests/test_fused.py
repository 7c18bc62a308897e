"""The fused packed pass (fastgate.engine.fused) against HF's module tree: the same tokens, log-probs and taps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastgate.assets.quant import FLOAT32_VIA_BF16, Int4Linear, Int8Linear, quantize_model
from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.fused import FusedForward, fusable, fused_forward
from fastgate.engine.model_runner import ModelRunner
from fastgate.engine.packed import PackedLoop
from fastgate.errors import InputError
from fastgate.ops.registry import import_ext
from fastgate.testing import tiny_model

PROMPTS = ["Q: What is the capital of France?\nA:", "Who wrote Hamlet?", "a", "The river rises in the hills"]


def _run(lm, forward: str, specs, budget=None, backend="auto"):
    runner = ModelRunner(lm, backend=backend, prefix_cache=0, step="eager", forward=forward)
    assert (runner.fused is not None) == (forward == "fused")
    loop = PackedLoop(runner, mid=2)
    tickets = loop.admit(specs)
    while loop.busy:
        loop.step(budget)
    out = []
    for t in tickets:
        r = t.result
        out.append([(list(s.token_ids), list(s.token_logprobs)) for s in r.sequences] + [r.running_sum])
    return out


def _specs(n=8):
    cfg = GenerationConfig(max_new_tokens=n, stop_at_eos=False)
    return [(p, cfg, TapSpec(layers=(0, 1, 2, 4)), 1, None) for p in PROMPTS]


def _joins_bitwise(lm, rows=range(1, 33)) -> bool:
    """Whether this machine's BLAS computes a concatenated product's columns bitwise like the parts' products (each
    column is its own dot product; true of the EPYCs here, not of a 16-thread Xeon's MKL at some row counts), for the
    two joins the fused pass makes (q / k / v and gate / up) at every row count a pass of these tests multiplies."""
    layer = lm.model.model.layers[0]
    joins = ([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight],
             [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
    for parts in joins:
        joined = torch.cat(parts)  # [sum N, H]
        for n in rows:
            x = torch.randn(n, joined.shape[1], generator=torch.Generator().manual_seed(n))  # [n, H]
            if not torch.equal(x @ joined.T, torch.cat([x @ w.T for w in parts], dim=1)):
                return False
    return True


@pytest.mark.parametrize("budget", [None, 3, 7])
def test_fused_pass_equals_hf_modules_bitwise_in_float32(budget):
    """Decode rows and prompt chunks of awkward sizes (a budget of 3 or 7 tokens splits prompts across passes beside
    the rows): tokens, log-probs and the taps' running sums identical to HF's forward with hooks where the BLAS joins
    products bitwise; elsewhere the same tokens and values within float32 rounding."""
    lm = tiny_model()
    bitwise = _joins_bitwise(lm)
    a, b = _run(lm, "hf", _specs(), budget), _run(lm, "fused", _specs(), budget)
    for x, y in zip(a, b):
        if bitwise:
            assert x[:-1] == y[:-1]
            assert torch.equal(x[-1], y[-1])
        else:
            assert [t for t, _ in x[:-1]] == [t for t, _ in y[:-1]]
            torch.testing.assert_close(torch.tensor([v for _, v in x[:-1]]), torch.tensor([v for _, v in y[:-1]]),
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x[-1], y[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_pass_with_quantized_weights_equals_hf_modules(dtype, weights):
    """With torch's quantized products (the layers' own kernels: the ``torch`` backend) the fused pass is HF's
    modules bitwise. With the C++ ones (bf16 rows where the CPU has AVX512-BF16, float32 rows where it has AVX2: ops
    int4_matmul, int8_matmul) its products sum in another order with float32 scales: the same tokens, log-probs
    within bf16's reach (float32: within float32 sums' reach of the modules' dense product)."""
    lm = tiny_model(dtype=dtype)
    quantize_model(lm.model, weights)
    a, b = _run(lm, "hf", _specs(6), backend="torch"), _run(lm, "fused", _specs(6), backend="torch")
    for x, y in zip(a, b):
        assert x[:-1] == y[:-1]
        assert torch.equal(x[-1], y[-1])
    runner = ModelRunner(lm, prefix_cache=0, step="eager")
    ext = import_ext()
    bf16_kernels = ext is not None and ext.quant_kernels_supported() and dtype is torch.bfloat16
    f32_kernels = dtype is torch.float32 and getattr(runner.ops.int4_matmul, "float32", False)
    if runner.ops.backends["int4_matmul"] != "ext" or not (bf16_kernels or f32_kernels):
        pytest.skip(f"the C++ int4 kernels are not bound for {dtype} rows on this CPU (AVX512-BF16 for bf16, AVX2 and "
                    "FMA for float32): the HF and torch-kernel comparison above ran, the C++ one cannot")
    # float32 rows: float32 kernels against the modules' dense product. Where torch runs AVX-512 the modules round
    # float32 rows to bf16 for torch's kernel (FLOAT32_VIA_BF16): another arithmetic, whose tokens part from the
    # kernels' on a random tiny model's flat log-probs, so the reference then multiplies their dense float32 copy
    if f32_kernels and FLOAT32_VIA_BF16:
        for module in lm.model.modules():
            if isinstance(module, (Int4Linear, Int8Linear)):
                module.bf16_products = False
        a = _run(lm, "hf", _specs(6), backend="torch")
    tol = 1e-3 if f32_kernels else 0.15  # bf16: a random tiny model's flat log-probs
    c = _run(lm, "fused", _specs(6))
    for x, y in zip(a, c):
        assert [ids for ids, _ in x[:-1]] == [ids for ids, _ in y[:-1]]
        for (_, lp_x), (_, lp_y) in zip(x[:-1], y[:-1]):
            assert max(abs(p - q) for p, q in zip(lp_x, lp_y)) < tol


def test_fusing_keeps_one_copy_of_each_weight_and_hf_modules_still_compute_the_same():
    lm = tiny_model(n_layers=2)
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.no_grad():
        before = lm.model(ids).logits
    fused = fused_forward(lm.model)
    assert fused_forward(lm.model) is fused  # built once per model
    attn = lm.model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.layers[0].qkv.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, before)


def test_fused_int8_layers_share_the_quantized_weights():
    lm = tiny_model(n_layers=2)
    quantize_model(lm.model, "int8")
    fused = fused_forward(lm.model)
    qkv = fused.layers[0].qkv
    assert isinstance(qkv, Int8Linear)
    attn = lm.model.model.layers[0].self_attn
    n = attn.q_proj.out_features
    assert attn.q_proj.q.data_ptr() == qkv.q.data_ptr()
    assert torch.equal(attn.k_proj.scale, qkv.scale[n:n + attn.k_proj.out_features])
    assert torch.equal(attn.q_proj.scale_bf16, attn.q_proj.scale.to(torch.bfloat16))


def test_auto_is_fused_where_covered_and_hf_elsewhere():
    from fastgate.testing import tiny_gemma3

    lm = tiny_model(n_layers=2)
    assert fusable(lm.model) and ModelRunner(lm, forward="auto").fused is not None
    assert ModelRunner(lm, forward="hf").fused is None
    gemma = tiny_gemma3(n_layers=2)
    assert not fusable(gemma.model)
    assert ModelRunner(gemma, forward="auto").fused is None
    with pytest.raises(InputError, match="is not covered by fastgate.engine.fused"):
        ModelRunner(gemma, forward="fused")
    with pytest.raises(ValueError):
        FusedForward(gemma.model)


def test_a_model_with_another_linear_type_is_not_fusable():
    lm = tiny_model(n_layers=2)
    lm.model.model.layers[1].mlp.up_proj = nn.Sequential(lm.model.model.layers[1].mlp.up_proj)
    assert not fusable(lm.model)


def test_rope_table_rows_equal_the_rotary_module():
    lm = tiny_model(n_layers=2)
    fused = fused_forward(lm.model)
    h = torch.zeros((1, 8))
    pos = torch.tensor([0, 1, 300, 7, 299])  # past the first table's 256 rows: it grows
    cos, sin = fused.rope(pos, h)
    c, s = lm.model.model.rotary_emb(h, pos[None])
    assert torch.equal(cos, c[0]) and torch.equal(sin, s[0])
