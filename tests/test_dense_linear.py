"""The op ``dense_linear`` (fastgate.ops.dense): a bf16 weight reordered once into oneDNN's layout multiplies rows
with ``F.linear``'s bits, and a fused pass through it gives the same tokens, log-probs and taps as through the
reference."""

from __future__ import annotations

import dataclasses
import gc
import weakref

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
    if dense._probed.get((n, k, bias), 0) >= 0:
        assert product.reordered is not None  # made once, at the first product
        assert dense._probed[(n, k, bias)] == len(dense._PROBE_ROWS)  # 769 rows: every row class probed


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
    monkeypatch.setattr(dense, "_probed", {})
    monkeypatch.setattr(dense, "_agrees", lambda *a: False)
    weight = _weight(16, 32)
    product = ReorderedLinear(weight)
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert torch.equal(product(x), F.linear(x, weight))
    assert product.reordered is None and not product._ok
    assert dense._probed == {(16, 32, False): -1}
    with pytest.raises(ValueError, match="no reordered weight agrees"):
        ReorderedLinear(weight).release(lambda: weight)


@needs_onednn
def test_row_classes_are_probed_at_their_first_product(monkeypatch):
    """A shape is probed for the row classes a product needs, at its first product of that many rows: a decode
    step's few rows never pay a prompt chunk's probe (qwen2.5-0.5b's LM head: 2.4 s of its first answer)."""
    probed: list[tuple[int, ...]] = []
    agrees = dense._agrees
    monkeypatch.setattr(dense, "_probed", {})
    monkeypatch.setattr(dense, "_agrees", lambda *a: probed.append(a[3]) or agrees(*a))
    weight = _weight(40, 24)
    product = ReorderedLinear(weight)
    for m, new in [(1, (1,)), (1, None), (2, (3,)), (3, None), (20, (33,)), (98, (97, 515)), (2000, None)]:
        probed.clear()
        x = torch.randn((m, 24), generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)  # [M, K]
        assert torch.equal(product(x), F.linear(x, weight))
        assert probed == ([new] if new else []), m
    other = ReorderedLinear(_weight(40, 24, seed=3))  # the same shape: probed already, for every class
    probed.clear()
    other(torch.randn((600, 24)).to(torch.bfloat16))
    assert probed == [] and other.reordered is not None


@needs_onednn
def test_a_released_weight_is_made_again_to_probe_and_kept_where_a_class_disagrees(monkeypatch):
    """After release the plain weight is gone: a class not yet probed makes it again for the probe; a class that
    disagrees then keeps it (F.linear for every count from then on, the same bits)."""
    agrees = dense._agrees
    monkeypatch.setattr(dense, "_probed", {})
    monkeypatch.setattr(dense, "_agrees", lambda *a: max(a[3]) < 97 and agrees(*a))  # the 97-row class disagrees
    weight = _weight(40, 24)
    made: list[int] = []
    product = ReorderedLinear(weight.clone())
    product.release(lambda: made.append(1) or weight.clone())
    assert product.weight is None and made == [] and dense._probed[(40, 24, False)] == 1
    x = torch.randn((20, 24)).to(torch.bfloat16)
    assert torch.equal(product(x), F.linear(x, weight)) and made == [1]  # made again to probe 3 and 33 rows
    assert product.weight is None and product.reordered is not None
    x = torch.randn((50, 24)).to(torch.bfloat16)
    assert torch.equal(product(x), F.linear(x, weight)) and len(made) == 2  # made again to probe 97 rows: kept
    assert dense._probed[(40, 24, False)] == -1 and not product._ok and product.reordered is None
    assert product.weight is not None
    product(torch.randn((2, 24)).to(torch.bfloat16))
    assert len(made) == 2


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

    ops = build_ops("auto", "cpu")
    rest = import_ext().pool_rest if ext_available() and hasattr(import_ext(), "pool_rest") else None
    if ops.backends["dense_linear"] == "onednn":
        assert ops.dense_linear(_weight(8, 16)).rest is rest
    elif rest is not None:  # no bf16 oneDNN product here (AVX2 only): F.linear, the pool resting before each
        assert ops.dense_linear.keywords["rest"] is rest
    else:
        assert ops.dense_linear is torch_dense_linear


def test_a_cpu_without_onednns_bf16_product_keeps_f_linear(monkeypatch):
    def no_bf16(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(dense, "_probed", {})
    monkeypatch.setattr(dense, "_pending", weakref.WeakSet())
    monkeypatch.setattr(dense, "_reorder", no_bf16)
    weight = _weight(16, 32)
    product = ReorderedLinear(weight)
    for rows in (1, 5, 600):
        x = torch.randn(rows, 32).to(torch.bfloat16)
        assert torch.equal(product(x), F.linear(x, weight))
    assert product.reordered is None and dense.probe_pending() == 0
    with pytest.raises(ValueError, match="no reordered weight"):
        product.release(lambda: weight)


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


def _hf_logits(lm) -> torch.Tensor:
    ids = lm.tokenizer(["Who wrote Hamlet? " * 7, "The river rises " * 11], return_tensors="pt", padding=True)
    with torch.inference_mode():
        return lm.model(**ids).logits  # [2, T, V]: HF's modules, q/k/v and gate/up one after the other


@needs_onednn
@pytest.mark.parametrize("attention_bias", [False, True])
def test_adopted_copies_are_held_once_with_the_same_bits(attention_bias):
    """The registry's op takes over int4-dense's kept copies at the fused pass's first bind (OnednnDense.adopt): no
    layer keeps a plain copy afterwards (the joins' parts neither), and the fused pass, HF's own forward (its parts
    take their columns of the join's product) and a prompt's states give the bits they gave with the plain copies."""
    lm = tiny_model(dtype=torch.bfloat16, attention_bias=attention_bias)
    quantize_model(lm.model, "int4-dense")
    runner = ModelRunner(lm, prefix_cache=0, step="eager")
    assert isinstance(runner.ops.dense_linear, dense.OnednnDense)
    plain_logits = _hf_logits(lm)  # before any bind: the parts' own plain copies
    plain_states = runner.prompt_states(["Who wrote Hamlet? " * 5, "a", "The river rises " * 9], layer=2)
    fused = runner.fused
    quantized = [m for layer in fused.layers for m in layer.linears if hasattr(m, "has_kept")]
    parts = [p for m in quantized for p, _, _ in getattr(m, "kept_parts", ())]
    assert parts and all(m.dense is not None for m in quantized + parts)
    plain = _generate(lm, torch_dense_linear, 45)  # the reference op adopts nothing (its products hold the copies)
    assert all(m.dense is not None for m in quantized + parts)
    copies = [weakref.ref(m.dense) for m in [*quantized, lm.model.lm_head]]
    adopted = _generate(lm, runner.ops.dense_linear, 45)
    assert all(m.dense is None and m.has_kept(torch.bfloat16) for m in quantized + parts)
    gc.collect()
    assert all(ref() is None for ref in copies)  # freed: the products bound before with the reference op went too
    assert all(isinstance(m._kept_product, ReorderedLinear) and m._kept_product.weight is None
               for m in [*quantized, lm.model.lm_head])  # the head too: HF's logits below go through it
    for (ids_a, lp_a, sum_a), (ids_b, lp_b, sum_b) in zip(adopted, plain):
        assert ids_a == ids_b and lp_a == lp_b
        assert torch.equal(sum_a, sum_b)
    assert torch.equal(_hf_logits(lm), plain_logits)
    states = runner.prompt_states(["Who wrote Hamlet? " * 5, "a", "The river rises " * 9], layer=2)
    assert torch.equal(states, plain_states)
    part = parts[0]
    shared = part._kept_product.shared
    part.refresh()  # new codes: a plain copy made again from them, and the join's product waits for it no more
    assert part.dense is not None and part._kept_product is None
    siblings = [p for m in quantized for p, _, _ in getattr(m, "kept_parts", ()) if p._kept_product is not None
                and p._kept_product.shared is shared]
    x = torch.randn(9, part.in_features).to(torch.bfloat16)
    for p in siblings:
        p(x)
    assert shared._y is None  # the parts still sharing it took their columns: nothing kept


@needs_onednn
def test_a_model_cast_after_the_adoption_computes_as_one_never_adopted():
    """``model.to(float32)`` after the adoption: the released copies become plain ones first, so they are cast as the
    buffers were (the same logits as a model whose copies were never adopted)."""
    lms = [tiny_model(dtype=torch.bfloat16) for _ in range(2)]
    for lm in lms:
        quantize_model(lm.model, "int4-dense")
    runner = ModelRunner(lms[0], prefix_cache=0, step="eager")
    _generate(lms[0], runner.ops.dense_linear, 45)
    assert all(m.dense is None for m in lms[0].model.model.layers.modules() if hasattr(m, "has_kept"))
    for lm in lms:
        lm.model.to(torch.float32)
    assert all(m.dense is not None and m.dense.dtype is torch.float32
               for m in lms[0].model.modules() if hasattr(m, "has_kept"))
    ids = lms[0].tokenizer(["Who wrote Hamlet? " * 7], return_tensors="pt")
    with torch.inference_mode():
        assert torch.equal(lms[0].model(**ids).logits, lms[1].model(**ids).logits)


@needs_onednn
def test_a_compiled_step_keeps_the_copies_plain():
    """A compiled decode step traces HF's modules: its runner's op adopts nothing (an adopted product is not
    traceable); an eager runner's does."""
    lm = tiny_model(dtype=torch.bfloat16)
    quantize_model(lm.model, "int4-dense")
    assert ModelRunner(lm, prefix_cache=0, step="compiled").ops.dense_linear.adopts is False
    assert ModelRunner(lm, prefix_cache=0, step="eager").ops.dense_linear.adopts is True


@needs_onednn
def test_a_join_whose_columns_differ_keeps_its_plain_copies(monkeypatch):
    lm = tiny_model(dtype=torch.bfloat16)
    quantize_model(lm.model, "int4-dense")
    runner = ModelRunner(lm, prefix_cache=0, step="eager")
    monkeypatch.setattr(dense, "columns_agree", lambda weight, edges: False)
    _generate(lm, runner.ops.dense_linear, 45)
    for layer in runner.fused.layers:
        joins = [m for m in layer.linears if getattr(m, "kept_parts", None)]
        singles = [m for m in layer.linears if hasattr(m, "has_kept") and not getattr(m, "kept_parts", None)]
        assert joins and all(m.dense is not None for m in joins)
        assert all(p.dense is not None for m in joins for p, _, _ in m.kept_parts)
        assert all(m.dense is None for m in singles)  # a layer of its own is adopted all the same


@needs_onednn
@pytest.mark.parametrize("edges", [[(0, 64), (64, 80), (80, 96)], [(0, 1), (1, 97)], [(0, 769)]])
def test_shared_columns_compute_once_a_rows_and_drop_the_product(edges):
    n = edges[-1][1]
    weight = _weight(n, 64)
    calls = []

    def product(x):
        calls.append(x.shape[0])
        return F.linear(x, weight)  # [M, N]

    shared = dense.SharedColumns(product, edges)
    parts = [shared.part(i) for i in range(len(edges))]
    assert dense.columns_agree(weight, edges)
    for m in (1, 7, 97):
        x = torch.randn((m, 64 + 3)).to(torch.bfloat16)[:, 3:]  # rows with a stride, as HF's reshape can give
        got = [p(x) for p in parts]
        assert calls == [m]  # once for every part
        assert shared._y is None and shared._rows is None  # every part took its columns: nothing kept
        for (s, e), y in zip(edges, got):
            assert y.is_contiguous() and torch.equal(y, F.linear(x, weight[s:e]))
        calls.clear()
    x = torch.randn(5, 64).to(torch.bfloat16)
    parts[0](x)
    x.mul_(2)  # the rows changed in place between two parts' calls: computed again
    assert torch.equal(parts[-1](x), F.linear(x, weight[edges[-1][0]:edges[-1][1]]))
    assert calls == [5, 5]
    calls.clear()
    parts[0](x)  # the rows the last part took: the kept product
    assert calls == ([] if len(parts) > 1 else [5])
    parts[0](x)  # the same part again on the same rows (a new forward): computed again
    assert calls == ([5] if len(parts) > 1 else [5, 5])
    with torch.inference_mode():  # no version counter there: the rows' storage and shape
        y = torch.randn(3, 64).to(torch.bfloat16)
        assert all(torch.equal(p(y), F.linear(y, weight[s:e])) for p, (s, e) in zip(parts, edges))


@needs_onednn
def test_a_released_weight_is_made_again_for_other_inputs(monkeypatch):
    monkeypatch.setattr(dense, "_probed", {})
    weight = _weight(24, 64)
    product = ReorderedLinear(weight)
    made = []
    product.release(lambda: made.append(1) or weight.clone())
    assert product.weight is None and product.reordered is not None
    x = torch.randn(3, 2, 64).to(torch.bfloat16)  # [3, 2, K]: not 2-D, the plain weight made again
    assert torch.equal(product(x), F.linear(x, weight)) and made == [1]
    rows = torch.randn(9, 64).to(torch.bfloat16)
    assert torch.equal(product(rows), F.linear(rows, weight)) and made == [1, 1]  # to probe 9 rows' class
    assert torch.equal(product(rows), F.linear(rows, weight)) and made == [1, 1]  # probed: the reordered weight
    with pytest.raises(ValueError, match="no reordered weight"):
        ReorderedLinear(weight.float()).release(lambda: weight)


@needs_onednn
def test_a_warm_up_probes_every_row_class_left(monkeypatch, tiny):
    """``Engine.finish_warm_up`` (a server's and an evaluation's warm-up, after their first answer) probes the row
    classes a first pass did not need, so that no later product pays for them; a product dropped meanwhile is not
    kept alive for it."""
    from fastgate.engine.local import Engine

    probed: list[tuple[int, ...]] = []
    agrees = dense._agrees
    monkeypatch.setattr(dense, "_probed", {})
    monkeypatch.setattr(dense, "_pending", weakref.WeakSet())
    monkeypatch.setattr(dense, "_agrees", lambda *a: probed.append(a[3]) or agrees(*a))
    product = ReorderedLinear(_weight(40, 24))
    gone = ReorderedLinear(_weight(8, 24))
    product(torch.randn((2, 24)).to(torch.bfloat16))
    del gone
    gc.collect()
    assert probed == [(1, 3)] and len(dense._pending) == 1
    Engine(tiny).finish_warm_up()
    assert probed == [(1, 3), (33, 97, 515)] and len(dense._pending) == 0
    probed.clear()
    x = torch.randn((700, 24)).to(torch.bfloat16)
    assert torch.equal(product(x), F.linear(x, product.weight)) and probed == []


@needs_onednn
def test_two_threads_probing_one_shape_take_turns(monkeypatch):
    """Thread A probes the 33-row class (slowly) while thread B's 600-row product finds the 515-row class
    disagreeing: B waits for A's probe, both get ``F.linear``'s bits and shape, and the disagreement is kept (before,
    A returned a [20, 0] tensor: B had dropped the reordered weight A was about to multiply, and A's verdict
    overwrote B's)."""
    import threading

    real = dense._agrees
    a_probing, b_called = threading.Event(), threading.Event()

    def agrees(w, b, r, rows=dense._PROBE_ROWS):
        if rows == (33,):  # A's probe: slow, as a real one is (it releases the GIL in torch)
            a_probing.set()
            b_called.wait(1.0)  # B's product has started (it waits for this probe)
        return max(rows) < 515 and real(w, b, r, rows)  # the 515-row class disagrees

    monkeypatch.setattr(dense, "_probed", {})
    monkeypatch.setattr(dense, "_agrees", agrees)
    weight = _weight(16, 32)
    product = ReorderedLinear(weight)
    product(torch.randn(2, 32).to(torch.bfloat16))  # the 1- and 3-row classes probed
    out: dict[str, torch.Tensor] = {}
    xa, xb = torch.randn(20, 32).to(torch.bfloat16), torch.randn(600, 32).to(torch.bfloat16)
    a = threading.Thread(target=lambda: out.update(a=product(xa)))
    a.start()
    assert a_probing.wait(5.0)

    def call_b():
        b_called.set()
        out["b"] = product(xb)

    b = threading.Thread(target=call_b)
    b.start()
    a.join(10.0)
    b.join(10.0)
    assert torch.equal(out["a"], F.linear(xa, weight)) and torch.equal(out["b"], F.linear(xb, weight))
    assert dense._probed[(16, 32, False)] == -1 and not product._ok and product.reordered is None
