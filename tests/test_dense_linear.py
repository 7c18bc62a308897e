"""The op ``dense_linear`` (fastgate.ops.dense): a bf16 weight reordered once into oneDNN's layout multiplies rows
with ``F.linear``'s bits, and a fused pass through it gives the same tokens, log-probs and taps as through the
reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fastgate.assets.quant import quantize_model
from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.model_runner import ModelRunner
from fastgate.engine.packed import PackedLoop
from fastgate.ops import dense
from fastgate.ops.dense import ReorderedLinear, onednn_agrees, onednn_dense_linear, torch_dense_linear
from fastgate.ops.registry import build_ops
from fastgate.testing import tiny_model

ONEDNN = onednn_agrees()
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="no oneDNN bf16 product here")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn((n, k), generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)  # [N, K]


@needs_onednn
@pytest.mark.parametrize("n, k", [(1, 1), (5, 3), (13, 31), (96, 576), (769, 64), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_reordered_product_is_f_linear_bitwise(n, k, bias):
    weight = _weight(n, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) if bias else None
    product = onednn_dense_linear(weight, b)
    assert isinstance(product, ReorderedLinear)
    for m in (1, 2, 7, 32, 33, 97, 769):
        x = torch.randn((m, k + 5), generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)  # [M, K + 5]
        for rows in (x[:, :k].contiguous(), x[:, 5:]):  # contiguous, and rows with a stride
            assert torch.equal(product(rows), F.linear(rows, weight, b)), (m, rows.is_contiguous())
    if dense._shape_agrees.get((n, k, bias), True):
        assert product.reordered is not None  # made once, at the first product


def test_other_inputs_take_the_plain_weight():
    weight = _weight(24, 40)
    product = onednn_dense_linear(weight)
    assert product.reordered is None  # nothing made before a bf16 product asks
    x = torch.randn(3, 2, 40).to(torch.bfloat16)  # [3, 2, K]: not 2-D
    assert torch.equal(product(x), F.linear(x, weight))
    assert product.reordered is None
    f32 = _weight(24, 40).float()
    assert onednn_dense_linear(f32).__class__ is not ReorderedLinear  # float32 weights: the reference
    with pytest.raises(RuntimeError):  # float32 rows against a bf16 weight: F.linear's own error
        product(torch.randn(3, 40))
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        ReorderedLinear(weight, torch.zeros(7, dtype=torch.bfloat16))


def test_a_shape_whose_probe_disagrees_keeps_f_linear(monkeypatch):
    monkeypatch.setattr(dense, "_shape_agrees", {})
    monkeypatch.setattr(dense, "_agrees", lambda *a: False)
    weight = _weight(16, 32)
    product = ReorderedLinear(weight)
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert torch.equal(product(x), F.linear(x, weight))
    assert product.reordered is None and not product._ok
    assert dense._shape_agrees == {(16, 32, False): False}


def test_registry_binds_the_reordered_product_where_it_agrees():
    assert build_ops("auto", "cpu").backends["dense_linear"] == ("onednn" if ONEDNN else "torch")
    assert build_ops("torch", "cpu").dense_linear is torch_dense_linear


def test_each_product_first_sends_the_pools_workers_to_rest():
    calls = []
    weight = _weight(24, 40)
    product = ReorderedLinear(weight, rest=lambda: calls.append(1))
    x = torch.randn(5, 40).to(torch.bfloat16)
    assert torch.equal(product(x), F.linear(x, weight))
    assert torch.equal(product(x.float()[None].to(torch.bfloat16)), F.linear(x[None], weight))  # the plain path too
    assert len(calls) == 2


@pytest.mark.skipif(not ONEDNN, reason="no oneDNN bf16 product here")
def test_float32_weights_rest_before_f_linear_too():
    from fastgate.ops.dense import resting_dense_linear

    calls = []
    weight = _weight(24, 40).float()
    x = torch.randn(5, 40)
    for product in (onednn_dense_linear(weight, rest=lambda: calls.append(1)),
                    resting_dense_linear(weight, rest=lambda: calls.append(1))):
        assert torch.equal(product(x), F.linear(x, weight))
    assert len(calls) == 2
    assert torch.equal(resting_dense_linear(weight)(x), F.linear(x, weight))  # no rest given: the reference alone
    assert len(calls) == 2


def test_registry_binds_the_extensions_rest_where_it_is_built():
    from fastgate.ops.registry import ext_available, import_ext

    product = build_ops("auto", "cpu").dense_linear(_weight(8, 16))
    if ext_available() and hasattr(import_ext(), "pool_rest"):
        assert product.rest is import_ext().pool_rest
    else:
        assert product.rest is None


def test_pooled_calls_while_resting_give_the_same_bits():
    """The pool's workers sleep between calls from ``pool_rest`` until a quantized product (``pool_spin``): the
    threads' waits change, not the split of the work."""
    from fastgate.ops.registry import ext_available, import_ext

    if not ext_available() or not hasattr(import_ext(), "pool_rest"):
        pytest.skip("the C++ extension is not built")
    ext = import_ext()
    ops = build_ops("ext", "cpu")
    x = torch.randn(769, 576).to(torch.bfloat16)  # [T, d]: enough rows for both threads
    w = torch.rand(576).to(torch.bfloat16)
    spinning = ops.rms_norm(x, w, 1e-5)
    ext.pool_rest()
    resting = [ops.rms_norm(x, w, 1e-5) for _ in range(3)]
    ext.pool_spin()
    assert all(torch.equal(r, spinning) for r in resting)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), spinning)


def _generate(lm, dense_linear=None, budget=None):
    runner = ModelRunner(lm, prefix_cache=0, step="eager")
    if dense_linear is not None:
        runner.ops = dataclasses.replace(runner.ops, dense_linear=dense_linear)
    cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    prompts = ["Q: What is the capital of France?\nA:" * 4, "Who wrote Hamlet? " * 9, "a", "The river rises " * 12]
    loop = PackedLoop(runner, mid=2)
    tickets = loop.admit([(p, cfg, TapSpec(layers=(0, 2, 4)), 1, None) for p in prompts])
    while loop.busy:
        loop.step(budget)
    return [([list(s.token_ids) for s in t.result.sequences], [list(s.token_logprobs) for s in t.result.sequences],
             t.result.running_sum) for t in tickets]


@needs_onednn
@pytest.mark.parametrize("weights", ["float", "int4-dense"])
@pytest.mark.parametrize("budget", [None, 45])
def test_fused_pass_through_the_reordered_weights_is_bitwise_the_reference(weights, budget):
    """A bf16 model's own weights (every product dense) and int4-dense's kept copies (prompt chunks past the kernels'
    rows): the same tokens, log-probs and taps' running sums as through F.linear, whole prompts and chunks of 45."""
    lm = tiny_model(dtype=torch.bfloat16)
    quantize_model(lm.model, weights)
    runner = ModelRunner(lm, prefix_cache=0, step="eager")
    assert runner.fused is not None and runner.ops.backends["dense_linear"] == "onednn"
    bound = []

    def counting(weight, bias=None):
        bound.append(onednn_dense_linear(weight, bias))
        return bound[-1]

    reordered = _generate(lm, counting, budget)
    assert any(getattr(p, "reordered", None) is not None for p in bound)  # the pass multiplied reordered weights
    plain = _generate(lm, torch_dense_linear, budget)
    for (ids_a, lp_a, sum_a), (ids_b, lp_b, sum_b) in zip(reordered, plain):
        assert ids_a == ids_b and lp_a == lp_b
        assert torch.equal(sum_a, sum_b)
