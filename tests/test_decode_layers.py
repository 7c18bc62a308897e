"""The op ``decode_layers`` (fastgate.ops.decoder): an int4 model's decoder layers for decode rows in one C++ call
(float32 rows; bf16 rows where the CPU has AVX512-BF16), bitwise the fused pass's per-op path; its SwiGLU bitwise
torch's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastgate.ops.decoder import torch_float_block
from fastgate.ops.registry import import_ext


def _ext():
    ext = import_ext()
    if ext is None or not hasattr(ext, "decode_layers_f32") or not ext.torch_exp_found():
        return None
    ext.set_torch_float_block(torch_float_block())  # as the registry does: torch's step on this CPU
    return ext


needs_layers = pytest.mark.skipif(_ext() is None,
                                  reason="no C++ extension with decode_layers_f32 (AVX2, FMA, torch's exp)")


def _bf16_ext():
    ext = _ext()
    return ext if ext is not None and hasattr(ext, "decode_layers_bf16") and ext.quant_kernels_supported() else None


needs_bf16_layers = pytest.mark.skipif(_bf16_ext() is None,
                                       reason="no C++ extension with decode_layers_bf16 (AVX512-BF16, torch's exp)")


@needs_layers
@pytest.mark.parametrize("rows, inter", [(1, 1), (1, 7), (3, 13), (2, 16), (1, 31), (2, 32), (1, 33), (3, 47),
                                        (4, 769), (2, 1536), (1, 4864)])
def test_silu_mul_is_torchs_bit_for_bit(rows, inter):
    """silu(gate) * up of float32 rows as torch computes it: 16 at a time with its SLEEF exp, a row's tail with the C
    library's (odd widths put values in both), extreme and special values included."""
    ext = _ext()
    gen = torch.Generator().manual_seed(inter)
    gu = torch.randn((rows, 2 * inter), generator=gen) * 8  # [m, 2 I]
    special = torch.tensor([0.0, -0.0, 88.0, -104.0, 1e-30, -1e-30, 20.5, -87.3])
    gu[0, :min(inter, 8)] = special[:min(inter, 8)]
    gu = gu[:, :].contiguous()
    out = torch.empty((rows, inter))
    ext.silu_mul_f32(gu.data_ptr(), out.data_ptr(), rows, inter)
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    assert torch.equal(out, ref)


@needs_bf16_layers
@pytest.mark.parametrize("rows, inter", [(1, 1), (1, 7), (3, 13), (2, 32), (1, 33), (2, 63), (1, 64), (3, 65),
                                        (4, 769), (2, 1536), (1, 4864)])
def test_silu_mul_of_bf16_is_torchs_bit_for_bit(rows, inter):
    """silu(gate) * up of bf16 rows as torch computes them (widened, its SLEEF exp 64 values a step on AVX-512, a
    row's tail with the C library's, each result rounded to bf16), extreme and special values included."""
    ext = _bf16_ext()
    gen = torch.Generator().manual_seed(inter)
    gu = torch.randn((rows, 2 * inter), generator=gen) * 8  # [m, 2 I]
    special = torch.tensor([0.0, -0.0, 88.0, -104.0, 1e-30, -1e-30, 20.5, -87.3])
    gu[0, :min(inter, 8)] = special[:min(inter, 8)]
    gu = gu.to(torch.bfloat16)
    out = torch.empty((rows, inter), dtype=torch.bfloat16)
    ext.silu_mul_bf16(gu.data_ptr(), out.data_ptr(), rows, inter)
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    assert torch.equal(out, ref)


@needs_bf16_layers
def test_silu_mul_of_bf16_is_torchs_on_every_bf16_gate():
    """Every one of the 65,536 bf16 values as the gate (infinities and NaNs included; NaN where torch gives NaN), times
    an up of both signs and a range of magnitudes: the vector loop's rounding is f32_to_bf16's."""
    ext = _bf16_ext()
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # [65536]
    up = (torch.randn(65536, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16)
    up[::7] = torch.tensor(float("inf"), dtype=torch.bfloat16)
    gu = torch.cat((gate, up)).reshape(1, -1)  # [1, 2 I]
    out = torch.empty((1, 65536), dtype=torch.bfloat16)
    ext.silu_mul_bf16(gu.data_ptr(), out.data_ptr(), 1, 65536)
    ref = (torch.nn.functional.silu(gate) * up).reshape(1, -1)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], ref[~nan])


def _counting(inner, counter: list[int]):
    """The op ``decode_layers`` ``inner`` with its stacks' calls counted (their rows appended to ``counter``)."""
    def op(layers, *a):
        stack = inner(layers, *a)
        if stack is None:
            return None
        run = stack.__call__

        class Counted:
            takes = stack.takes

            def __call__(self, h, *b):
                counter.append(h.shape[0])
                return run(h, *b)

        return Counted()

    return op


def _runs(lm, prompts, stacked: bool, max_new: int = 7, layers=(0, 2, 4), budget=None, counter=None):
    """(token ids, log-probs, running sums) of ``prompts`` on ``lm`` with the C++ ops, the decoder layers in one call
    (``stacked``) or op by op."""
    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.ops.decoder import no_decode_layers

    runner = ModelRunner(lm, backend="ext", prefix_cache=0, step="eager")
    op = runner.ops.decode_layers
    if not stacked:
        op = no_decode_layers
    elif counter is not None:  # count the stack's calls (their rows)
        op = _counting(op, counter)
    runner.ops = dataclasses.replace(runner.ops, decode_layers=op)
    cfg = GenerationConfig(max_new_tokens=max_new, stop_at_eos=False)
    loop = PackedLoop(runner, mid=2)
    tickets = loop.admit([(p, cfg, TapSpec(layers=layers, eos_state=True), 1, None) for p in prompts])
    while loop.busy:
        loop.step(budget)
    return [(list(t.result.sequences[0].token_ids), list(t.result.sequences[0].token_logprobs),
             t.result.running_sum, t.result.eos_state) for t in tickets]


PROMPTS = ["Q: What is the capital of France?\nA:", "Who wrote Hamlet?", "a", "The river rises in the hills",
           "one two three four five six seven", "Z"]


def _stacked_against_per_op(dtype, weights, bias, n):
    """(stack's calls, the stacked runs, the per-op runs) of two equal tiny models in ``dtype``."""
    from fastgate.assets.quant import quantize_model
    from fastgate.testing import tiny_model

    models = []
    for _ in range(2):
        lm = tiny_model(dtype=dtype, attention_bias=bias)
        if bias:  # Qwen2: q/k/v biases (drawn: HF's init zeroes them), none on o
            gen = torch.Generator().manual_seed(5)
            for layer in lm.model.model.layers:
                attn = layer.self_attn
                attn.o_proj.bias = None
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.data.copy_(torch.randn(proj.bias.shape, generator=gen) * 0.5)
        quantize_model(lm.model, weights)
        models.append(lm)
    calls: list[int] = []
    a = _runs(models[0], PROMPTS[:n], True, counter=calls, budget=9)
    b = _runs(models[1], PROMPTS[:n], False, budget=9)
    return calls, a, b


def _assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x[0] == y[0] and x[1] == y[1]
        assert torch.equal(x[2], y[2]) and torch.equal(x[3], y[3])


@needs_layers
@pytest.mark.parametrize("weights, bias, n", [("int4", False, 1), ("int4", False, 5), ("int4-dense", False, 3),
                                             ("int4", True, 6)])
def test_stacked_layers_are_the_per_op_path_bit_for_bit(weights, bias, n):
    """Tokens, log-probs, tapped running sums and EOS states equal the per-op decode path's exactly, for one row, a
    prime number of rows, the kept dense copy's form, and q/k/v biases (Qwen2's); the stack did run (its calls
    counted), in segments between the tapped layers."""
    calls, a, b = _stacked_against_per_op(torch.float32, weights, bias, n)
    assert calls and max(calls) <= n
    assert len(calls) % 2 == 0  # two calls a pass: layers 0-1 and 2-3 (the taps: 0 the embeddings, 2, 4 the norm)
    _assert_same(a, b)


@needs_bf16_layers
@pytest.mark.parametrize("weights, bias, n", [("int4", False, 1), ("int4", False, 5), ("int4-dense", False, 3),
                                             ("int4-dense", False, 5), ("int4", True, 6), ("int4-dense", True, 2)])
def test_bf16_stacked_layers_are_the_per_op_path_bit_for_bit(weights, bias, n):
    """The same for bf16 rows (decode_layers_bf16): the q/k/v bias rounded as torch adds a bf16 bias; with the kept
    dense copy (int4-dense) too, whose products the C++ kernels take up to the op's ``bf16_rows`` (32)."""
    calls, a, b = _stacked_against_per_op(torch.bfloat16, weights, bias, n)
    assert calls and len(calls) % 2 == 0 and max(calls) == n
    _assert_same(a, b)


@needs_bf16_layers
def test_the_fused_pass_gives_a_bf16_stack_only_the_rows_its_kernels_take():
    """An int4-dense bf16 model: the C++ op's products take up to BF16_KERNEL_ROWS rows (the kept copy beyond), torch's
    the layers' own DENSE_KERNEL_ROWS; the stack is given no more rows than that, so a pass it takes is a pass whose
    per-op path runs the kernels (a pass of more rows runs the per-op path, the copy's products)."""
    from fastgate.assets.quant import DENSE_KERNEL_ROWS, quantize_model
    from fastgate.engine.fused import fused_forward
    from fastgate.ops.quant import (
        BF16_KERNEL_ROWS,
        ext_int4_matmul,
        ext_int8_matmul,
        torch_int4_matmul,
        torch_int8_matmul,
    )
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=torch.bfloat16)
    quantize_model(lm.model, "int4-dense")
    fused = fused_forward(lm.model)
    ext = _bf16_ext()
    ours = (ext_int4_matmul(ext, bf16=True), ext_int8_matmul(ext, bf16=True))
    assert fused._kernel_limit(ours, torch.bfloat16) == BF16_KERNEL_ROWS > DENSE_KERNEL_ROWS
    assert fused._kernel_limit((torch_int4_matmul, torch_int8_matmul), torch.bfloat16) == DENSE_KERNEL_ROWS
    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop

    def run(bf16_rows: int | None) -> list[int]:
        """The stack's calls (their rows) for six prompts decoded together, the products' op stopping at
        ``bf16_rows`` (None: the op's own)."""
        calls: list[int] = []
        runner = ModelRunner(lm, backend="ext", prefix_cache=0, step="eager")
        int4, int8 = ext_int4_matmul(ext, bf16=True), ext_int8_matmul(ext, bf16=True)
        if bf16_rows is not None:
            int4.bf16_rows = int8.bf16_rows = bf16_rows
        runner.ops = dataclasses.replace(runner.ops, decode_layers=_counting(runner.ops.decode_layers, calls),
                                         int4_matmul=int4, int8_matmul=int8)
        loop = PackedLoop(runner, mid=2)
        cfg = GenerationConfig(max_new_tokens=5, stop_at_eos=False)
        tickets = loop.admit([(p, cfg, TapSpec(), 1, None) for p in PROMPTS[:6]])
        while loop.busy:
            loop.step()
        assert all(len(t.result.sequences[0].token_ids) == 5 for t in tickets)
        return calls

    assert run(None) and max(run(None)) == 6  # six rows within the kernels' 32: the stack
    assert run(0) == []  # the kernels' own 4 rows: six-row passes take the per-op path (the copy's products)


@needs_layers
def test_models_the_stack_does_not_take_keep_the_per_op_path():
    """An o bias (Llama's attention_bias), int8 weights, float weights or bf16 rows: the op binds nothing or the pass
    does not use it, and generation still works."""
    from fastgate.assets.quant import quantize_model
    from fastgate.engine.fused import fused_forward
    from fastgate.testing import tiny_model

    ext = _ext()
    from fastgate.ops.decoder import ext_decode_layers

    op = ext_decode_layers(ext)
    for weights, bias in (("int4", True), ("int8", False), (None, False)):
        lm = tiny_model(dtype=torch.float32, attention_bias=bias)
        if weights:
            quantize_model(lm.model, weights)
        fused = fused_forward(lm.model)
        assert fused._stack(op) is None
        calls: list[int] = []
        out = _runs(lm, PROMPTS[:2], True, counter=calls)
        assert not calls and all(len(o[0]) == 7 for o in out)


@needs_layers
def test_stack_rejects_bad_inputs_before_writing():
    """Positions outside the store, a store of another dtype, rows the stack does not take: a clear error or
    ``takes`` False, and the store unwritten."""
    from fastgate.assets.quant import quantize_model
    from fastgate.engine.fused import fused_forward
    from fastgate.errors import ShapeError
    from fastgate.ops.decoder import ext_decode_layers
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=torch.float32)
    quantize_model(lm.model, "int4")
    fused = fused_forward(lm.model)
    stack = fused._stack(ext_decode_layers(_ext()))
    assert stack is not None
    n, cols = fused.n, 8
    keys = [torch.zeros((2, fused.kv_heads, cols, fused.head_dim)) for _ in range(n)]
    values = [torch.zeros_like(k) for k in keys]
    h = torch.randn(2, stack.d)
    cos, sin = torch.ones(2, fused.head_dim), torch.zeros(2, fused.head_dim)
    with pytest.raises(ShapeError, match="positions"):
        stack(h, cos, sin, keys, values, torch.tensor([3, cols]), 0, n)
    assert all(not k.any() for k in keys) and all(not v.any() for v in values)
    with pytest.raises(ShapeError, match="store"):
        stack(h, cos, sin, [k.to(torch.bfloat16) for k in keys], values, torch.tensor([0, 1]), 0, n)
    with pytest.raises(ShapeError):
        stack(h, cos, sin, keys, values, torch.tensor([0, 1], dtype=torch.int32), 0, n)
    assert not stack.takes(h.to(torch.bfloat16)) and not stack.takes(h.t().contiguous().t()[:, :5])
    assert not stack.takes(torch.randn(stack.max_rows + 1, stack.d))
    # layers past the last (a segmentation fault), none (uninitialised rows), rows of another dtype (read past h's
    # end): clear errors, the store unwritten
    for first, last in ((0, n + 4), (1, 1), (-1, n)):
        with pytest.raises(ShapeError, match="first="):
            stack(h, cos, sin, keys, values, torch.tensor([0, 5]), first, last)
    with pytest.raises(ShapeError, match="contiguous CPU rows"):
        stack(h.to(torch.bfloat16), cos, sin, keys, values, torch.tensor([0, 5]), 0, n)
    assert all(not k.any() for k in keys) and all(not v.any() for v in values)
    out = stack(h, cos, sin, keys, values, torch.tensor([0, 5]), 0, n)  # [2, d]
    assert out.shape == (2, stack.d) and torch.isfinite(out).all() and keys[0][1, :, 5].any()


def _joining_runs(lm, stacked: bool, budget=None):
    """One prompt decoding alone for four steps, then five more joining (the store grows under the running row:
    new buffers the stack must bind, not the pointers it kept), each generation to its end; the store's largest
    (rows, columns) before and after the join."""
    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.ops.decoder import no_decode_layers

    runner = ModelRunner(lm, backend="ext", prefix_cache=0, step="eager")
    if not stacked:
        runner.ops = dataclasses.replace(runner.ops, decode_layers=no_decode_layers)
    cfg = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    loop = PackedLoop(runner, mid=2)
    tickets = loop.admit([(PROMPTS[0], cfg, TapSpec(layers=(0, 2, 4)), 1, None)])
    for _ in range(4):
        loop.step(budget)
    first = last = (loop.store.rows_cap, loop.store.cols_cap)
    tickets += loop.admit([(p, cfg, TapSpec(layers=(0, 2, 4)), 1, None) for p in PROMPTS[1:]])
    while loop.busy:
        loop.step(budget)
        last = max(last, (loop.store.rows_cap, loop.store.cols_cap))  # (the store is let go at the end)
    stacks = [st._store for st in runner.fused._stacks.values() if st is not None and st._store is not None]
    assert not any(t is not None for st in stacks for t in (*st[0], *st[1]))  # the idle loop's store let go there too
    return (first, last), [(list(t.result.sequences[0].token_ids), list(t.result.sequences[0].token_logprobs),
                    t.result.running_sum) for t in tickets]


@needs_layers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stack_binds_a_grown_store(dtype):
    """Rows joining a store the stack already multiplied into: the store grows into new buffers (new lists, so the
    stack binds them: a growth that kept the lists the same objects left the stack on the old pointers, "positions
    must lie in 0..301" on SmolLM2's FLARE), the same tokens, log-probs and running sums as the per-op path; once
    the loop is idle, the lists the stack kept hold none of the store's buffers."""
    from fastgate.assets.quant import quantize_model
    from fastgate.testing import tiny_model

    if dtype is torch.bfloat16 and _bf16_ext() is None:
        pytest.skip("no C++ extension with decode_layers_bf16")
    runs = []
    for stacked in (True, False):
        lm = tiny_model(dtype=dtype)
        quantize_model(lm.model, "int4")
        runs.append(_joining_runs(lm, stacked))
    ((first, last), a), (_, b) = runs
    assert first[0] < len(PROMPTS) <= last[0]  # grew under the stack
    for x, y in zip(a, b, strict=True):
        assert x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2])
