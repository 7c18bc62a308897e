"""Weight-only int8 linear layers (fastgate.assets.quant): products against the de-quantized definition over awkward
shapes, the quantization's error bounds, the tiny model generating with them, and ``--weights`` reaching records."""

from __future__ import annotations

import json

import pytest
import torch
from bf16_rounding import assert_bf16_rounded
from torch import nn

from fastgate.assets.quant import (
    KERNEL_ROWS,
    Int8Linear,
    canonical_weights,
    int8_reference,
    quantize_int8,
    quantize_model,
    quantized_layers,
)
from fastgate.errors import InputError, UnknownNameError
from fastgate.testing import assert_greedy_equals_hf_generate, random_linear

# (rows, K, N): single elements, primes, 769 outputs, K a multiple of 16 (the bf16 kernel's) and not
SHAPES = [(1, 1, 1), (1, 13, 7), (3, 64, 769), (5, 769, 17), (2, 97, 31), (1, 64, 128), (16, 32, 5), (17, 48, 11),
          (7, 13, 769)]


def _layer(k: int, n: int, bias: bool = False, seed: int = 0) -> tuple[nn.Linear, Int8Linear]:
    lin = random_linear(k, n, bias, seed)
    return lin, Int8Linear.from_linear(lin)


def _kernel_definition(q: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``aten._weight_int8pack_mm`` computes before rounding its output to bf16, without the bias: the rows in
    bf16 times the codes, in float32, scaled by the layer's bf16 scales (``scale_bf16``: ``scale`` rounded to bf16)."""
    return int8_reference(x.to(torch.bfloat16), q.q, q.scale_bf16)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_product_equals_the_dequantized_reference_in_float32(m, k, n):
    _, q = _layer(k, n, bias=n % 2 == 1)
    q.bf16_products = False  # the dense float32 path: the definition up to float32 rounding
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(1))  # [M, K]
    assert not q.uses_kernel(x)
    ref = int8_reference(x, q.q, q.scale, q.bias)  # [M, N]
    y = q(x)
    assert y.dtype is torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_float32_rows_through_bf16_products_stay_within_bf16_rounding(m, k, n):
    """float32 rows rounded to bf16 for the kernel (an AVX-512 CPU's default): float32 out, the definition within
    the inputs' bf16 rounding; rows or K the kernel does not take stay on the exact dense path."""
    _, q = _layer(k, n, bias=True)
    q.bf16_products = True
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(5))
    assert q.uses_kernel(x) == (m <= KERNEL_ROWS and k % 16 == 0)
    y = q(x)
    assert y.dtype is torch.float32 and y.shape == (m, n)
    if q.uses_kernel(x):  # the kernel's product rounded once to bf16, then the bias added in float32
        product = _kernel_definition(q, x)
        assert_bf16_rounded(y, product + q.bias, product.abs() + q.bias.abs())
    else:
        torch.testing.assert_close(y, int8_reference(x, q.q, q.scale, q.bias), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_product_in_bfloat16_is_the_reference_within_bf16_rounding(m, k, n):
    _, q = _layer(k, n)
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert q.uses_kernel(x) == (m <= KERNEL_ROWS and k % 16 == 0)  # K = 13, 97, 769: never the kernel (it crashed)
    y = q(x)
    assert y.dtype is torch.bfloat16 and y.shape == (m, n)
    # the kernel rounds its product to bf16 once; the dense path rounds x @ q.T (exact codes, float32 sums) to bf16,
    # then its product with the bf16 scales: twice
    assert_bf16_rounded(y, _kernel_definition(q, x), roundings=1 if q.uses_kernel(x) else 2)


def test_int8_product_of_non_contiguous_and_3d_inputs():
    _, q = _layer(64, 769, bias=True)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn((4, 128), generator=gen)
    for x in (wide[:, ::2], torch.randn((64, 4), generator=gen).T, torch.randn((2, 3, 64), generator=gen)):
        assert not x.is_contiguous() or x.dim() == 3
        q.bf16_products = False
        torch.testing.assert_close(q(x), int8_reference(x, q.q, q.scale, q.bias), rtol=1e-5, atol=1e-5)
        q.bf16_products = True  # the kernel path of the same rows: its product rounded once, the bias added in float32
        product = _kernel_definition(q, x)
        assert_bf16_rounded(q(x), product + q.bias, product.abs() + q.bias.abs())
        xb = x.to(torch.bfloat16)  # the kernel wants contiguous 2-D rows: the layer makes them
        assert q(xb).shape == (*x.shape[:-1], 769)


def test_quantization_error_is_bounded_by_half_a_step():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn((769, 97), generator=gen)
    w[5] = 0.0  # a row of zeros keeps scale 1 and quantizes to zeros
    w[6, 3] = 1e3  # an outlier costs its own row only
    q, s = quantize_int8(w)
    assert q.dtype is torch.int8 and s.shape == (769,) and int(q.abs().max()) <= 127
    assert s[5] == 1 and not q[5].any()
    err = (w - q.float() * s[:, None]).abs()  # [N, K]
    assert bool((err <= s[:, None] / 2 + 1e-6).all())
    # the product's error is bounded by sum_k |x_k| * s_n / 2, and small against the float product
    x = torch.randn((3, 97), generator=gen)
    exact = x @ w.T  # [3, N]
    got = int8_reference(x, q, s)
    bound = x.abs().sum(dim=1, keepdim=True) * s[None, :] / 2 + 1e-4  # [3, N]
    assert bool(((got - exact).abs() <= bound).all())
    ok = [r for r in range(769) if r != 6]
    rel = (got - exact)[:, ok].norm() / exact[:, ok].norm()
    assert rel.item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (769, 31), (64, 96), (300, 700), (3, 70001)])
def test_quantization_is_its_definition_bit_for_bit_and_leaves_the_weight(shape, dtype):
    """quantize_int8 works in blocks of rows through a small float32 buffer, the row maxima in the weight's own
    dtype (a load's quantization 10x faster): the codes and scales of the plain definition, ``round(w / (|w|'s row
    max / 127))`` in float32, on awkward shapes (several blocks and a partial one; rows longer than a block), zero and
    negative-only rows, each float dtype, a transposed (non-contiguous) weight, and the weight given left as it was (a
    float32 weight is the model's own)."""
    gen = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(shape, generator=gen) * torch.rand((shape[0], 1), generator=gen) * 5).to(dtype)
    w[0] = 0.0
    if shape[0] > 2:
        w[1] = -w[1].abs() - 1  # the largest magnitude a negative value
    for weight in (w, w.T.contiguous().T):
        before = weight.clone()
        q, s = quantize_int8(weight)
        ref = weight.to(torch.float32)
        amax = ref.abs().amax(dim=1)
        ref_s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        ref_q = torch.round(ref / ref_s[:, None]).clamp(-127, 127).to(torch.int8)
        assert torch.equal(q, ref_q) and torch.equal(s, ref_s) and q.is_contiguous()
        assert torch.equal(weight, before)


def test_quantize_model_swaps_the_blocks_linears_only(tiny):
    from fastgate.testing import tiny_model

    lm = tiny_model()
    head = lm.model.lm_head.weight.clone()
    embed = lm.model.model.embed_tokens.weight.clone()
    assert quantize_model(lm.model, "float") == 0 and quantized_layers(lm.model) == 0
    n = quantize_model(lm.model, "int8")
    assert n == lm.n_layers * 7 + 1 == quantized_layers(lm.model)  # q, k, v, o, gate, up, down; the LM head
    assert isinstance(lm.model.lm_head, Int8Linear)
    q, scale = quantize_int8(head)
    assert torch.equal(lm.model.lm_head.q, q) and torch.equal(lm.model.lm_head.scale, scale)
    assert torch.equal(lm.model.model.embed_tokens.weight, embed)  # the embedding table stays float
    assert next(lm.model.parameters()).dtype is torch.float32  # the runner's dtype: still the activations'
    # logits close to the float model's (the tiny model's weights are random, so only loosely)
    ids = lm.tokenizer("Who wrote Hamlet?", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = tiny.model(ids).logits, lm.model(ids).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 0.05


def _int8_tiny(dtype: torch.dtype = torch.float32):
    from fastgate.engine.local import Engine
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=dtype)
    quantize_model(lm.model, "int8")
    lm.weights = "int8"
    return Engine(lm)


@pytest.fixture(scope="module")
def int8_engine():
    return _int8_tiny()


def test_greedy_generation_with_int8_weights_equals_hf_generate(int8_engine):
    assert_greedy_equals_hf_generate(int8_engine)


def test_int8_weights_with_bf16_activations_generate():
    from fastgate.config import GenerationConfig

    engine = _int8_tiny(torch.bfloat16)
    assert engine.dtype_name == "bfloat16"
    seq = engine.generate(["Who wrote Hamlet?"], GenerationConfig(max_new_tokens=6, stop_at_eos=False)).sequences[0]
    assert len(seq.token_ids) == 6 and all(isinstance(lp, float) for lp in seq.token_logprobs)


def test_an_unknown_weight_format_is_refused_with_the_choices():
    from fastgate.assets.models import load
    from fastgate.serving.runtime import Runtime

    assert canonical_weights("INT8") == "int8" and canonical_weights("float") == "float"
    with pytest.raises(UnknownNameError,
                       match=r"unknown weight format 'int3'; choose one of: auto, float, int8, int4, int4-dense"):
        canonical_weights("int3")
    with pytest.raises(UnknownNameError, match="weight format"):
        load("/nonexistent/model", weights="int2")  # refused before the model is looked for
    with pytest.raises(UnknownNameError, match="weight format"):
        Runtime("tiny", weights="q4")
    assert isinstance(UnknownNameError("weight format", "x", ["float"]), InputError)


def test_eval_records_name_the_weights_and_refuse_a_resume_under_another(tiny_engine, int8_engine, small_index,
                                                                          tmp_path):
    from fastgate.eval.datasets import QAExample
    from fastgate.eval.runner import ResultsStore, RunSpec, evaluate
    from fastgate.serving.runtime import Runtime

    examples = [QAExample("q1", "What is the capital of France?", ("Paris",)),
                QAExample("q2", "Who wrote Hamlet?", ("Shakespeare",))]
    run = RunSpec("never", None)
    store = ResultsStore(tmp_path / "results.jsonl")
    plain = Runtime("tiny", index=str(small_index), engine=tiny_engine)
    int8 = Runtime("tiny", index=str(small_index), engine=int8_engine)
    assert plain.weights_name == "float" and int8.weights_name == "int8"
    evaluate(int8, [run], examples[:1], store, progress=False)
    assert [(r["weights"], r["dtype"]) for r in store.records.values()] == [("int8", "float32")]
    with pytest.raises(InputError, match="int8 weights, but this run would use float"):
        evaluate(plain, [run], examples, ResultsStore(store.path), progress=False)
    # records from before they named their weights were float: resumed with float, refused with int8
    other = ResultsStore(tmp_path / "old.jsonl")
    evaluate(plain, [run], examples[:1], other, progress=False)
    lines = [json.loads(line) for line in other.path.read_text().splitlines()]
    other.path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "weights"}) + "\n" for r in lines))
    with pytest.raises(InputError, match="float weights, but this run would use int8"):
        evaluate(int8, [run], examples, ResultsStore(other.path), progress=False)
    evaluate(plain, [run], examples, ResultsStore(other.path), progress=False)
    assert [r.get("weights") for r in ResultsStore(other.path).records.values()] == [None, "float"]


def test_ask_json_and_healthz_name_the_weights(tmp_path, capsys):
    from fastapi.testclient import TestClient

    from fastgate.entrypoints.cli import main
    from fastgate.entrypoints.http.app import create_app
    from fastgate.serving.service import AnswerService, ServiceConfig
    from fastgate.testing import tiny_model

    lm = tiny_model()
    lm.model.save_pretrained(tmp_path / "tiny")
    lm.tokenizer.save_pretrained(tmp_path / "tiny")
    argv = ["ask", "--model", str(tmp_path / "tiny"), "--device", "cpu", "--method", "never", "--json",
            "--max-tokens", "4", "--dtype", "float32"]
    assert main([*argv, "--weights", "int8", "Who wrote Hamlet?"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["weights"] == "int8" and record["dtype"] == "float32"
    assert main([*argv, "Who wrote Hamlet?"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["weights"] == "float"

    service = AnswerService(ServiceConfig(model=str(tmp_path / "tiny"), device="cpu", dtype="float32",
                                          weights="int8"))
    assert service.weights_name == "int8"  # known before the model loads
    health = TestClient(create_app(service)).get("/healthz").json()
    assert health["weights"] == "int8" and health["dtype"] == "float32"


@pytest.mark.parametrize(("weights", "hidden"), [("int8", None), ("int4", 128)])  # int4: K a multiple of 32
def test_the_traced_static_step_runs_quantized_weights_as_the_eager_pass(weights, hidden):
    """The compiled decode step (fastgate.engine.static_step, traced whole through AOTAutograd) takes the quantized
    layers (bf16 activations: the weight-only kernel is in the graph; int4's parts call it on views of the fused
    packed weight): the same greedy tokens as the eager packed pass."""
    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.engine.static_step import StepConfig
    from fastgate.testing import tiny_model

    lm = tiny_model(n_layers=2, dtype=torch.bfloat16, **({"hidden": hidden} if hidden else {}))
    quantize_model(lm.model, weights)
    cfg = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    # both rows tapped: a tapped row takes one step more, so both finish together and the step is traced once (2
    # rows; a lone last row would be batch 1's graph of its own, seconds more)
    specs = [("Q: What is the capital of France?\nA:", cfg, TapSpec(layers=(1,)), 1, None),
             ("Who wrote Hamlet?", cfg, TapSpec(layers=(0,)), 1, None)]

    def run(step):
        loop = PackedLoop(ModelRunner(lm, step=step), mid=1)
        tickets = loop.add(specs)
        while loop.busy:
            loop.step()
        return [list(t.result.sequences[0].token_ids) for t in tickets], loop

    eager, _ = run("eager")
    got, loop = run(StepConfig("compiled", backend="aot_eager"))
    assert got == eager and all(len(t) == 8 for t in got)
    assert loop.static_steps > 0 and loop.static.compiled


def test_a_load_hands_the_freed_heap_back(tmp_path, monkeypatch):
    """``load`` gives the C heap's free pages back after quantizing (the checkpoint's weights it replaced), and a
    runner after joining its fused layers' weights: once each; ``return_freed_memory`` itself says whether it could
    (glibc on Linux: yes)."""
    import sys

    import fastgate.assets.models as fm
    from fastgate.testing import tiny_model

    lm = tiny_model()
    lm.model.save_pretrained(tmp_path / "tiny")
    lm.tokenizer.save_pretrained(tmp_path / "tiny")
    calls = []
    monkeypatch.setattr(fm, "return_freed_memory", lambda: calls.append(1) or True)
    loaded = fm.load(str(tmp_path / "tiny"), device="cpu", dtype="float32", weights="int8")
    assert loaded.weights == "int8" and calls == [1]
    import fastgate.engine.model_runner as mr

    monkeypatch.setattr(mr, "return_freed_memory", lambda: calls.append(2) or True)
    mr.ModelRunner(loaded)  # its fused layers' joins free the parts' own weights: given back too
    assert calls == [1, 2]
    monkeypatch.undo()
    import platform

    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert fm.return_freed_memory() is glibc
