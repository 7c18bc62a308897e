"""The decode rows' attention over a bf16 store (fastgate.ops.attention) against its torch reference: awkward shapes
(1, primes, 769 columns, head dims off the vector width), a store wider than its rows (a view), GQA, bad shapes; and
the bf16 packed pass through it against the cast-and-SDPA pass."""

from __future__ import annotations

import pytest
import torch

from fastgate.errors import ShapeError
from fastgate.ops import reference
from fastgate.ops.registry import build_ops, ext_available

needs_ext = pytest.mark.skipif(not ext_available(), reason="the C++ extension is not built")

SHAPES = [  # m rows, H heads, Hkv key / value heads, C columns, D head dim, R store rows
    (1, 1, 1, 1, 1, 1),
    (3, 6, 2, 17, 13, 5),
    (16, 9, 3, 640, 64, 16),
    (7, 14, 2, 769, 128, 9),
    (2, 4, 4, 31, 8, 2),
    (5, 10, 5, 97, 256, 7),
    (4, 8, 2, 45, 32, 4),  # the AVX-512 form's head dims (32, 64, 128) with 1 to 7 query heads a key head
    (3, 12, 2, 70, 64, 3),
    (2, 16, 1, 50, 64, 2),  # 16 query heads a key head: past the AVX-512 form's 8, the 8-wide loop
]


def _ext():
    ops = build_ops("ext", "cpu")
    assert ops.backends["decode_attention"] == "ext"
    return ops.decode_attention


@needs_ext
@pytest.mark.parametrize("m,H,Hkv,C,D,R", SHAPES)
def test_ext_equals_the_reference_in_float32_rounding(m, H, Hkv, C, D, R):
    g = torch.Generator().manual_seed(m * 1000 + C)
    keys = (3 * torch.randn(R, Hkv, C, D, generator=g)).to(torch.bfloat16)  # [R, Hkv, C, D]: peaked softmaxes too
    values = torch.randn(R, Hkv, C, D, generator=g).to(torch.bfloat16)
    q = torch.randn(m, H, D, generator=g)  # [m, H, D]
    pos = torch.randint(0, C, (m,), generator=g)  # [m]
    pos[0] = C - 1  # a row that attends the whole store
    for scale in (None, 0.3):
        got, want = _ext()(q, keys, values, pos, scale), reference.decode_attention(q, keys, values, pos, scale)
        assert got.dtype == torch.float32 and got.shape == (m, H, D)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@needs_ext
def test_a_store_view_bf16_queries_and_a_non_contiguous_query():
    g = torch.Generator().manual_seed(7)
    big_k = torch.randn(9, 3, 700, 64, generator=g).to(torch.bfloat16)
    big_v = torch.randn(9, 3, 700, 64, generator=g).to(torch.bfloat16)
    keys, values = big_k[:, :, :650], big_v[:, :, :650]  # [9, 3, 650, 64], rows 700 columns apart
    q = torch.randn(9, 6, 64, generator=g).transpose(0, 1).contiguous().transpose(0, 1)  # [6, 9, 64] -> not contiguous
    q = q[:8].to(torch.bfloat16)  # [8, 9, 64]... 8 rows of a 9-row store
    pos = torch.tensor([0, 1, 5, 649, 300, 2, 77, 128])
    torch.testing.assert_close(_ext()(q, keys, values, pos), reference.decode_attention(q, keys, values, pos),
                               rtol=1e-5, atol=2e-5)


@needs_ext
def test_inputs_the_kernel_does_not_take_go_to_the_reference():
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 1, 5, 4, generator=g), torch.randn(2, 1, 5, 4, generator=g)  # float32 store
    q, pos = torch.randn(2, 2, 4, generator=g), torch.tensor([4, 2])
    assert torch.equal(_ext()(q, keys, values, pos), reference.decode_attention(q, keys, values, pos))
    assert _ext()(q[:0], keys.bfloat16(), values.bfloat16(), pos[:0]).shape == (0, 2, 4)


@pytest.mark.parametrize("fn", [reference.decode_attention, pytest.param(None, marks=needs_ext)])
def test_bad_shapes_are_shape_errors(fn):
    fn = fn or _ext()
    k = torch.zeros(2, 2, 5, 4, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match="multiple"):
        fn(torch.zeros(2, 3, 4), k, k, torch.tensor([0, 1]))  # 3 heads over 2 key / value heads
    with pytest.raises(ShapeError, match="pos"):
        fn(torch.zeros(2, 2, 4), k, k, torch.tensor([0]))
    with pytest.raises(ShapeError, match="positions"):
        fn(torch.zeros(2, 2, 4), k, k, torch.tensor([0, 5]))  # column 5 of a 5-column store
    with pytest.raises(ShapeError, match="rows"):
        fn(torch.zeros(3, 2, 4), k, k, torch.tensor([0, 1, 2]))  # 3 rows of a 2-row store


@needs_ext
def test_bf16_packed_pass_through_the_op_gives_the_reference_tokens():
    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=torch.bfloat16)
    prompts = ["Q: What is the capital of France?\nA:", "Who wrote Hamlet?", "a", "The river rises in the hills"]
    cfg = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    out = {}
    for backend in ("ext", "torch"):
        runner = ModelRunner(lm, backend=backend, prefix_cache=0, step="eager")
        assert (runner.decode_attention is not None) == (backend == "ext")
        loop = PackedLoop(runner, mid=2)
        tickets = loop.admit([(p, cfg, TapSpec(layers=(0, 2)), 1, None) for p in prompts])
        while loop.busy:
            loop.step(5)  # prompt chunks beside decode rows
        out[backend] = [t.result for t in tickets]
    for a, b in zip(out["ext"], out["torch"]):
        assert list(a.sequences[0].token_ids) == list(b.sequences[0].token_ids)
        # the decode rows' attention agrees to float32 rounding, and the prompt chunks' (the blocked op under ext,
        # SDPA's bf16 path under torch) to bf16's; the bf16 activations after it round either way of a tie, and
        # that grows through the layers to a few hundredths of a log-prob (up to 0.058 on an EPYC with AVX2 only, whose
        # SDPA kernel blocks differently; each backend is then 0.03-0.07 from the float32 model's log-probs)
        torch.testing.assert_close(torch.tensor(list(a.sequences[0].token_logprobs)),
                                   torch.tensor(list(b.sequences[0].token_logprobs)), rtol=0, atol=0.1)


@needs_ext
def test_threads_split_rows_alike():
    """The kernel splits (row, head) items over at most torch's thread count: 1 and 2 threads give the same bits."""
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(16, 3, 640, 64, generator=g).to(torch.bfloat16)
    values = torch.randn(16, 3, 640, 64, generator=g).to(torch.bfloat16)
    q, pos = torch.randn(16, 9, 64, generator=g), torch.randint(500, 640, (16,), generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _ext()(q, keys, values, pos)
        torch.set_num_threads(2)
        two = _ext()(q, keys, values, pos)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)



@needs_ext
@pytest.mark.parametrize("m,H,Hkv,C,D,R", SHAPES)
def test_the_step_op_writes_the_store_and_attends_as_the_reference(m, H, Hkv, C, D, R):
    """decode_attention_step: each row's new key and value written at its column, then its bf16 heads attend; the
    store after it equals the reference's bitwise and the output is within one bf16 step of the reference's."""
    from fastgate.ops import reference as ref_ops

    step = build_ops("ext", "cpu").decode_attention_step
    g = torch.Generator().manual_seed(m * 977 + D)
    keys = (3 * torch.randn(R, Hkv, C + 2, D, generator=g)).to(torch.bfloat16)[:, :, 1:C + 1]  # a view of a store
    values = torch.randn(R, Hkv, C + 2, D, generator=g).to(torch.bfloat16)[:, :, 1:C + 1]
    qkv = torch.randn(m, H + 2 * Hkv, D, generator=g).to(torch.bfloat16)  # q, k, v heads of one product
    q, k_new, v_new = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
    pos = torch.randint(0, C, (m,), generator=g)
    pos[0] = C - 1
    k2, v2 = keys.clone(), values.clone()
    got = step(q, k_new, v_new, keys, values, pos, 0.3)
    want = ref_ops.decode_attention_step(q, k_new, v_new, k2, v2, pos, 0.3)
    assert torch.equal(keys, k2) and torch.equal(values, v2)
    assert got.dtype == torch.bfloat16 and got.shape == (m, H, D)
    exact = ref_ops.decode_attention(q, keys, values, pos, 0.3)  # float32
    assert (got.float() - exact).abs().max() <= exact.abs().max() * 2 ** -7 + 1e-5
    # one rounding to bf16 apart at most (float32 softmaxes summed in another order)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()


@needs_ext
def test_a_bf16_decode_pass_takes_the_step_op_with_the_general_path_s_results():
    """The fused pass's decode-only path (bare products, one store-write-and-attention call a layer) runs for a bf16
    model with the C++ ops, and gives the general path's tokens, log-probs and taps bitwise (the same arithmetic)."""
    from decode_paths import decode_path_runs

    from fastgate.config import GenerationConfig
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=torch.bfloat16)
    prompts = ["Q: What is the capital of France?\nA:", "Who wrote Hamlet?", "a", "The river rises in the hills"]
    cfg = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    out, calls = decode_path_runs(lm, [prompts], cfg, layers=(0, 2), mid=2, budget=7)
    assert calls  # the decode-only passes went through it
    for a, b in zip(out[True][0], out[False][0]):
        assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@needs_ext
def test_the_per_op_decode_path_takes_the_swiglu_op():
    """Decode-only passes without the whole-layer op run each layer's SwiGLU through the runner's ``swiglu`` op, as
    the general path does, with the same bits as torch's two operations."""
    import dataclasses

    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.ops import reference
    from fastgate.ops.decoder import no_decode_layers
    from fastgate.testing import tiny_model

    lm = tiny_model(dtype=torch.bfloat16)
    prompts = ["Q: What is the capital of France?\nA:", "Who wrote Hamlet?", "a"]
    cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    out, rows, steps = {}, [], []
    for spy in (True, False):
        runner = ModelRunner(lm, backend="ext", prefix_cache=0, step="eager")
        inner, inner_step = (runner.ops.swiglu if spy else reference.swiglu), runner.ops.decode_attention_step

        def swiglu(gu, inner=inner, spy=spy):
            if spy:
                rows.append(gu.shape[0])
            return inner(gu)

        def step(*a, inner=inner_step, spy=spy):  # counts the decode-only passes' layers (as decode_paths does)
            if spy:
                steps.append(a[0].shape[0])
            return inner(*a)

        step.float32 = getattr(inner_step, "float32", False)
        roped = getattr(inner_step, "roped", None)
        if roped is not None:
            step.roped = lambda qkv, *a, roped=roped, spy=spy: (spy and steps.append(qkv.shape[0])) or roped(qkv, *a)
        runner.ops = dataclasses.replace(runner.ops, decode_attention_step=step, decode_layers=no_decode_layers,
                                         swiglu=swiglu)
        loop = PackedLoop(runner, mid=2)
        tickets = loop.admit([(p, cfg, TapSpec(layers=(0, 2)), 1, None) for p in prompts])
        while loop.busy:
            loop.step(None)
        out[spy] = [(t.result.sequences[0].token_ids, t.result.sequences[0].token_logprobs, t.result.running_sum)
                    for t in tickets]
    # the decode-only path ran (its store-write-and-attention call a layer), and each of its layers took the op
    assert steps.count(len(prompts)) >= 5 * lm.model.config.num_hidden_layers
    assert rows.count(len(prompts)) >= steps.count(len(prompts))
    for a, b in zip(out[True], out[False]):
        assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
