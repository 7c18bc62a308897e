"""The prompt chunks' attention (op ``prefill_attention``): the blocked bf16 CPU implementation and the C++ kernels
(bf16 and float32 inputs) against float32 / float64 attention of the same inputs over awkward shapes, every other
input through torch's SDPA unchanged, shape errors, and the packed pass calling the op the runner chose."""

from __future__ import annotations

import pytest
import torch

from fastgate.errors import ShapeError
from fastgate.ops import build_ops, reference
from fastgate.ops.prefill import BLOCK, KERNEL_HEAD_DIMS, blocked_prefill_attention, ext_prefill_attention
from fastgate.ops.registry import import_ext

EXT = import_ext()
KERNEL = EXT is not None and EXT.prefill_attention_bf16_supported()  # the C++ kernel needs AVX512-BF16
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs the extension and a CPU with AVX512-BF16")
# AVX-512 (16 floats a vector), or AVX2 and FMA (8)
F32_KERNEL = EXT is not None and getattr(EXT, "prefill_attention_f32_supported", lambda: False)()
needs_f32_kernel = pytest.mark.skipif(not F32_KERNEL, reason="needs the extension and a CPU with AVX2 and FMA")


@pytest.fixture(params=[8, 16])
def width(request):
    """The float32 kernel's vector width for one test (16 only where the CPU has AVX-512), restored after it."""
    if request.param == 16 and not EXT.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512: the kernel runs 8 wide")
    EXT.set_max_vector_width(request.param)
    yield request.param
    EXT.set_max_vector_width(16)
IMPLEMENTATIONS = [pytest.param("blocked", id="blocked"), pytest.param("ext", id="ext", marks=needs_kernel)]


def _impl(name):
    return blocked_prefill_attention if name == "blocked" else ext_prefill_attention(EXT)


def _inputs(heads, kv_heads, n, start, dim, dtype=torch.bfloat16, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    total = start + n
    # q as HF hands it over ([1, T, H, D] transposed: strided), keys / values a prefix of a wider buffer
    q = (torch.randn(1, n, heads, dim, generator=g) * scale).to(dtype).transpose(1, 2)  # [1, H, n, D]
    k = (torch.randn(1, kv_heads, total + 5, dim, generator=g) * scale).to(dtype)[:, :, :total]  # [1, Hkv, S, D]
    v = torch.randn(1, kv_heads, total + 5, dim, generator=g).to(dtype)[:, :, :total]
    return q, k, v


SHAPES = [  # heads, kv heads, queries, cached columns before them, head dim
    (1, 1, 1, 0, 64), (9, 3, 1, 0, 64), (4, 4, 1, 37, 64), (7, 1, 67, 131, 32), (9, 3, 700, 0, 64),
    (6, 2, 769, 0, 64), (8, 2, 131, 769, 128), (2, 1, 3, 5, 16), (14, 2, BLOCK, 0, 64), (3, 3, BLOCK + 1, 1, 80),
    (5, 5, 2 * BLOCK - 1, BLOCK, 256),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("heads,kv_heads,n,start,dim", SHAPES)
def test_float32_attention_rounded_once(impl, heads, kv_heads, n, start, dim):
    q, k, v = _inputs(heads, kv_heads, n, start, dim)
    exact = reference.prefill_attention(q.float(), k.float(), v.float(), start)  # [1, H, n, D] float32
    out = _impl(impl)(q, k, v, start)
    assert out.shape == (1, heads, n, dim) and out.dtype is torch.bfloat16
    # one rounding to bf16 (8 bits): within half a unit of the float32 result, up to float32's own sums
    assert ((out.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5).all()
    sdpa = reference.prefill_attention(q, k, v, start)  # torch's bf16 SDPA, which also rounds its probabilities
    assert (out.float() - exact).abs().mean() <= (sdpa.float() - exact).abs().mean() * 1.25 + 1e-7


@needs_kernel
@pytest.mark.parametrize("dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("n,start", [(1, 0), (15, 0), (16, 0), (17, 3), (97, 0), (33, 700), (769, 0)])
def test_kernel_over_row_blocks_and_key_groups(dim, n, start):
    """The kernel's tiles: 16 query rows an item, 8 query vectors a score pass, 16 keys a register, value tiles of 2
    to 8 vectors; every boundary (and a chunk after a long cached prefix) against float32 attention."""
    q, k, v = _inputs(7, 1, n, start, dim, seed=n + start)
    out = ext_prefill_attention(EXT)(q, k, v, start, scale=0.2)
    exact = reference.prefill_attention(q.float(), k.float(), v.float(), start, scale=0.2)
    assert ((out.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5).all()


@needs_kernel
def test_kernel_threads_agree_and_hand_other_inputs_to_the_blocks(monkeypatch):
    q, k, v = _inputs(9, 3, 300, 40, 64)
    op = ext_prefill_attention(EXT)
    one = op(q, k, v, 40)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    torch.testing.assert_close(op(q, k, v, 40), one, rtol=0, atol=0)  # items are independent: same bits
    q80, k80, v80 = _inputs(5, 5, 40, 3, 80)  # a head dim the kernel has no tiles for: the blocks, exactly
    torch.testing.assert_close(op(q80, k80, v80, 3), blocked_prefill_attention(q80, k80, v80, 3), rtol=0, atol=0)
    q16, k16, v16 = _inputs(4, 2, 20, 0, 64, dtype=torch.float16)  # float16: the reference, exactly
    torch.testing.assert_close(op(q16, k16, v16, 0), reference.prefill_attention(q16, k16, v16, 0), rtol=0, atol=0)
    with pytest.raises(ShapeError, match="start \\+ n"):
        op(q, k, v, 39)


F32_SHAPES = [  # heads, kv heads, queries, cached columns before them, head dim: the kernel's head dims
    (1, 1, 1, 0, 64), (9, 3, 1, 0, 64), (4, 4, 1, 37, 64), (7, 1, 67, 131, 32), (9, 3, 700, 0, 64),
    (6, 2, 769, 0, 64), (8, 2, 131, 769, 128), (14, 2, 17, 3, 64), (9, 3, 376, 324, 64), (2, 2, 15, 16, 32),
]


@needs_f32_kernel
@pytest.mark.parametrize("heads,kv_heads,n,start,dim", F32_SHAPES)
def test_float32_kernel_against_float64_attention(width, heads, kv_heads, n, start, dim):
    """float32 chunks: the kernel's sums run in another order than SDPA's, so its outputs are within float32's
    rounding of exact (float64) attention, not SDPA's bits."""
    q, k, v = _inputs(heads, kv_heads, n, start, dim, dtype=torch.float32, seed=n + start)
    out = ext_prefill_attention(EXT)(q, k, v, start)
    assert out.shape == (1, heads, n, dim) and out.dtype is torch.float32
    exact = reference.prefill_attention(q.double(), k.double(), v.double(), start)  # [1, H, n, D]
    err = (out.double() - exact).abs()
    assert (err <= exact.abs() * 2e-5 + 2e-5).all(), err.max()
    sdpa = reference.prefill_attention(q, k, v, start)  # torch's float32 flash kernel
    assert err.mean() <= (sdpa.double() - exact).abs().mean() * 8 + 1e-9


@needs_f32_kernel
def test_float32_kernel_widths_differ_only_in_the_last_bits():
    """The 8-wide kernel (AVX2) against the 16-wide one on the same inputs, where the CPU runs both."""
    if not EXT.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512: one width")
    q, k, v = _inputs(9, 3, 131, 17, 64, dtype=torch.float32)
    op = ext_prefill_attention(EXT)
    wide = op(q, k, v, 17)
    EXT.set_max_vector_width(8)
    try:
        narrow = op(q, k, v, 17)
    finally:
        EXT.set_max_vector_width(16)
    torch.testing.assert_close(narrow, wide, rtol=1e-5, atol=1e-5)


@needs_f32_kernel
def test_float32_kernel_threads_agree_and_strided_queries(width):
    q, k, v = _inputs(9, 3, 300, 40, 64, dtype=torch.float32)
    op = ext_prefill_attention(EXT)
    one = op(q, k, v, 40)
    torch.testing.assert_close(op(q.contiguous(), k, v, 40), one, rtol=0, atol=0)  # strides read, same bits
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.testing.assert_close(op(q, k, v, 40), one, rtol=0, atol=0)  # items are independent: same bits
    finally:
        torch.set_num_threads(threads)
    wide = torch.randn(1, 3, 400, 64)[:, :, :340]  # keys / values a prefix of a wider buffer
    ref = reference.prefill_attention(q, wide, wide, 40)
    assert (op(q, wide, wide, 40) - ref).abs().max() <= 1e-4
    with pytest.raises(ShapeError, match="start \\+ n"):
        op(q, k, v, 39)
    q80, k80, v80 = _inputs(5, 5, 40, 3, 80, dtype=torch.float32)  # no tiles for head dim 80: SDPA, exactly
    torch.testing.assert_close(op(q80, k80, v80, 3), reference.prefill_attention(q80, k80, v80, 3), rtol=0, atol=0)


@needs_f32_kernel
def test_float32_chunks_take_the_float32_kernel():
    """The op sends float32 inputs to ``prefill_attention_f32`` (bf16 ones to the bf16 kernel where the CPU has it)
    and none of them to SDPA."""
    from types import SimpleNamespace

    calls = []

    def counted(name):
        def run(*args):
            calls.append(name)
            return getattr(EXT, name)(*args)
        return run

    ext = SimpleNamespace(prefill_attention_bf16_supported=EXT.prefill_attention_bf16_supported,
                          prefill_attention_f32_supported=EXT.prefill_attention_f32_supported,
                          prefill_attention_bf16=counted("prefill_attention_bf16"),
                          prefill_attention_f32=counted("prefill_attention_f32"))
    op = ext_prefill_attention(ext)
    q, k, v = _inputs(9, 3, 37, 5, 64, dtype=torch.float32)
    op(q, k, v, 5)
    op(q.bfloat16(), k.bfloat16(), v.bfloat16(), 5)
    assert calls == ["prefill_attention_f32"] + (["prefill_attention_bf16"] if KERNEL else [])


def test_a_mask_passed_in_is_the_chunk_mask():
    q, k, v = _inputs(4, 2, 9, 11, 32)
    mask = reference.prefill_mask(11, 9)
    assert mask.shape == (9, 20) and mask[0, 11] and not mask[0, 12] and mask[8].all()
    assert reference.prefill_mask(0, 9) is None
    torch.testing.assert_close(reference.prefill_attention(q, k, v, 11, mask=mask),
                               reference.prefill_attention(q, k, v, 11), rtol=0, atol=0)
    torch.testing.assert_close(blocked_prefill_attention(q, k, v, 11, mask=mask),
                               blocked_prefill_attention(q, k, v, 11), rtol=0, atol=0)


def test_a_mask_of_another_chunk_is_refused():
    q, k, v = _inputs(4, 2, 9, 11, 32, dtype=torch.float32)
    with pytest.raises(ShapeError, match="mask must be"):
        reference.prefill_attention(q, k, v, 11, mask=reference.prefill_mask(10, 9))
    # at start 0 the chunk is plain causal: a mask passed in is not read
    q0, k0, v0 = _inputs(4, 2, 9, 0, 32, dtype=torch.float32)
    torch.testing.assert_close(reference.prefill_attention(q0, k0, v0, 0, mask=torch.zeros(1, 1, dtype=torch.bool)),
                               reference.prefill_attention(q0, k0, v0, 0), rtol=0, atol=0)


def test_scale_is_applied():
    q, k, v = _inputs(4, 2, 70, 3, 32)
    exact = reference.prefill_attention(q.float(), k.float(), v.float(), 3, scale=0.3)
    out = blocked_prefill_attention(q, k, v, 3, scale=0.3)
    assert ((out.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_run_the_reference_exactly(dtype):
    q, k, v = _inputs(6, 2, 97, 13, 64, dtype=dtype)
    torch.testing.assert_close(blocked_prefill_attention(q, k, v, 13), reference.prefill_attention(q, k, v, 13),
                               rtol=0, atol=0)


@pytest.mark.parametrize("fn", [reference.prefill_attention, blocked_prefill_attention])
def test_shape_errors(fn):
    q, k, v = _inputs(6, 2, 10, 4, 64)
    with pytest.raises(ShapeError, match="start \\+ n"):
        fn(q, k, v, 3)
    with pytest.raises(ShapeError, match="head dim"):
        fn(q, k[..., :32], v[..., :32], 4)
    with pytest.raises(ShapeError, match="multiple"):
        fn(q[:, :5], k, v, 4)
    with pytest.raises(ShapeError, match="one shape"):
        fn(q[0], k, v, 4)


def test_registry_choice(monkeypatch):
    monkeypatch.delenv("FASTGATE_BACKEND", raising=False)
    assert build_ops("auto", "cpu").backends["prefill_attention"] == ("ext" if KERNEL or F32_KERNEL else "blocked")
    monkeypatch.setattr("fastgate.ops.registry.import_ext", lambda: None)  # no extension: the blocks
    assert build_ops("auto", "cpu").prefill_attention is blocked_prefill_attention
    assert build_ops("auto", "cpu").backends["prefill_attention"] == "blocked"
    assert build_ops("torch", "cpu").prefill_attention is reference.prefill_attention
    assert build_ops("auto", "meta").backends["prefill_attention"] == "torch"


def test_inputs_it_is_not_for_go_to_the_reference():
    q, k, v = _inputs(4, 2, 9, 3, 32)
    meta = [t.to("meta") for t in (q, k, v)]
    assert blocked_prefill_attention(*meta, 3).device.type == "meta"  # SDPA's meta kernel: shapes only
    mixed = (q, k.float(), v.float())  # bf16 queries over float32 keys: SDPA decides (here: it refuses)
    with pytest.raises(RuntimeError):
        reference.prefill_attention(*mixed, 3)
    with pytest.raises(RuntimeError):
        blocked_prefill_attention(*mixed, 3)


def test_contiguous_queries_and_an_empty_chunk():
    q, k, v = _inputs(6, 3, 70, 9, 64)
    torch.testing.assert_close(blocked_prefill_attention(q.contiguous(), k, v, 9),
                               blocked_prefill_attention(q, k, v, 9), rtol=0, atol=0)
    empty = blocked_prefill_attention(q[:, :, :0], k[:, :, :9], v[:, :, :9], 9)
    assert empty.shape == (1, 6, 0, 64)


def test_packed_pass_runs_chunks_through_the_runners_op(monkeypatch):
    """A bf16 packed loop's prompt chunks (after a cached prefix too) go through the op the runner chose."""
    import dataclasses

    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.testing import tiny_model

    monkeypatch.delenv("FASTGATE_BACKEND", raising=False)
    runner = ModelRunner(tiny_model(dtype=torch.bfloat16), prefix_cache=0, step="eager")
    assert runner.ops.backends["prefill_attention"] in ("ext", "blocked")
    calls = []

    def counting(q, keys, values, start, scale=None, mask=None):
        calls.append((q.dtype, q.shape[2], start))
        return runner_op(q, keys, values, start, scale, mask)

    runner_op = runner.ops.prefill_attention
    runner.ops = dataclasses.replace(runner.ops, prefill_attention=counting)
    loop = PackedLoop(runner, mid=runner.n_layers // 2)
    cfg = GenerationConfig(max_new_tokens=2, stop_at_eos=False)
    loop.admit([("a prompt long enough to take a few chunks of five tokens", cfg, TapSpec(), 1, None)])
    while loop.busy:
        loop.step(5)  # five prompt tokens a pass: chunks after a cached prefix
    assert calls and len(calls) % runner.n_layers == 0
    assert {dtype for dtype, _, _ in calls} == {torch.bfloat16}
    assert any(start > 0 for _, _, start in calls) and max(n for _, n, _ in calls) <= 5


@needs_f32_kernel
def test_float32_packed_chunks_through_the_kernel_answer_as_sdpa(monkeypatch):
    """A float32 model (head dim 32) whose prompt chunks, after a cached prefix too, run the float32 kernel: the same
    greedy tokens as with torch's SDPA, log-probs within float32's rounding, and the kernel called for every chunk."""
    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.testing import tiny_model

    monkeypatch.delenv("FASTGATE_BACKEND", raising=False)
    model = tiny_model(hidden=128)  # 4 heads of 32
    cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    prompts = ["a prompt long enough to take a few chunks of five tokens", "and a second one, shorter"]
    results = {}
    for backend in ("auto", "torch"):
        runner = ModelRunner(model, backend, prefix_cache=0, step="eager")
        calls = []
        if backend == "auto":
            assert runner.ops.backends["prefill_attention"] == "ext"
            real = EXT.prefill_attention_f32

            def counting(*args, real=real, calls=calls):
                calls.append(args[8])  # n, the chunk's queries
                return real(*args)

            monkeypatch.setattr(EXT, "prefill_attention_f32", counting)
            runner = ModelRunner(model, backend, prefix_cache=0, step="eager")  # the op binds the counting kernel
        loop = PackedLoop(runner, mid=runner.n_layers // 2)
        tickets = loop.admit([(p, cfg, TapSpec(), 1, None) for p in prompts])
        while loop.busy:
            loop.step(5)
        results[backend] = [t.result for t in tickets]
        if backend == "auto":
            assert calls and max(calls) <= 5
            monkeypatch.undo()
    for got, want in zip(results["auto"], results["torch"]):
        for a, b in zip(got.sequences, want.sequences):
            assert a.token_ids == b.token_ids and len(a.token_ids) == 6
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)


def _pass_inputs(heads, kv_heads, dim, chunks, t, seed=0):
    """A packed pass's query / new keys / new values as the fused pass hands them over (strided views of its
    projections: keys after the rotary embedding, values from the product, so their strides differ) and each chunk's
    buffers ``[1, Hkv, start + n + 3, D]`` (cached columns random, the chunk's own columns not yet written)."""
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(t, heads + kv_heads, dim, generator=g).to(torch.bfloat16)  # [T, H + Hkv, D]
    qkv = torch.randn(t, heads + 2 * kv_heads, dim, generator=g).to(torch.bfloat16)  # [T, H + 2 Hkv, D]
    query = qk[:, :heads].transpose(0, 1)[None]  # [1, H, T, D]
    key = qk[:, heads:].transpose(0, 1)[None]  # [1, Hkv, T, D]
    value = qkv[:, heads + kv_heads:].transpose(0, 1)[None]  # [1, Hkv, T, D], other strides
    bufs = [(torch.randn(1, kv_heads, start + n + 3, dim, generator=g).to(torch.bfloat16),
             torch.randn(1, kv_heads, start + n + 3, dim, generator=g).to(torch.bfloat16)) for _, n, start in chunks]
    return query, key, value, bufs


@needs_kernel
@pytest.mark.parametrize("dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (7, 1), (4, 4)])
def test_all_chunks_in_one_call_are_each_chunks_call_bit_for_bit(monkeypatch, dim, heads, kv_heads):
    """The packed pass's chunks in one C++ call (``prefill_attention.segs``): each chunk's buffers take its new keys
    / values and its rows of the output are what its own call computes, bit for bit; chunks of one row, primes,
    past a 16-row item, after a long cached prefix and from column 0, behind decode rows; one thread or two."""
    chunks = [(3, 1, 0), (4, 17, 3), (21, 33, 700), (54, 16, 0), (70, 7, 769), (77, 0, 5), (77, 40, 1)]
    t = 117
    query, key, value, bufs = _pass_inputs(heads, kv_heads, dim, chunks, t, seed=dim + heads)
    op = ext_prefill_attention(EXT)
    expected_bufs = [(k.clone(), v.clone()) for k, v in bufs]
    expected = torch.zeros(t, heads, dim, dtype=torch.bfloat16)
    for (offset, n, start), (k_buf, v_buf) in zip(chunks, expected_bufs):
        k_buf[:, :, start:start + n] = key[:, :, offset:offset + n]
        v_buf[:, :, start:start + n] = value[:, :, offset:offset + n]
        o = op(query[:, :, offset:offset + n], k_buf[:, :, :start + n], v_buf[:, :, :start + n], start, 0.3)
        expected[offset:offset + n] = o[0].transpose(0, 1)
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        got_bufs = [(k.clone(), v.clone()) for k, v in bufs]
        out = torch.zeros(t, heads, dim, dtype=torch.bfloat16)
        assert op.segs(query, key, value, [(o, n, s, k, v) for (o, n, s), (k, v) in zip(chunks, got_bufs)], 0.3, out)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        for (k, v), (ek, ev) in zip(got_bufs, expected_bufs):
            torch.testing.assert_close(k, ek, rtol=0, atol=0)
            torch.testing.assert_close(v, ev, rtol=0, atol=0)


@needs_kernel
def test_all_chunks_call_declines_inputs_it_is_not_for():
    """float32 rows, a head dim without tiles, a buffer whose columns are not contiguous: False, nothing written
    (the pass then calls the op chunk by chunk)."""
    op = ext_prefill_attention(EXT)
    chunks = [(0, 5, 2), (5, 3, 0)]
    query, key, value, bufs = _pass_inputs(4, 2, 64, chunks, 8)
    before = [(k.clone(), v.clone()) for k, v in bufs]
    out = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    rows = [(o, n, s, k, v) for (o, n, s), (k, v) in zip(chunks, bufs)]
    assert not op.segs(query.float(), key.float(), value.float(), rows, None, out.float())
    k0, v0 = bufs[0]
    wide = [(0, 5, 2, k0.transpose(2, 3).contiguous().transpose(2, 3), v0), rows[1]]  # columns not D apart
    assert not op.segs(query, key, value, wide, None, out)
    assert not op.segs(query, key, value, [(6, 5, 2, k0, v0)], None, out)  # past the pass's rows
    for (k, v), (bk, bv) in zip(bufs, before):
        assert torch.equal(k, bk) and torch.equal(v, bv)
    assert out.eq(0).all()
    q32, k32, v32, b32 = _pass_inputs(4, 2, 16, [(0, 4, 0)], 4)  # head dim 16: no tiles
    assert not op.segs(q32, k32, v32, [(0, 4, 0, *b32[0])], None, torch.zeros(4, 4, 16, dtype=torch.bfloat16))


@needs_kernel
def test_packed_pass_takes_all_chunks_in_one_call_with_the_same_answers(monkeypatch):
    """A bf16 packed loop (head dim 32) whose prompts start after a cached prefix: each layer's chunks go through the
    one call, and every generated token and log-prob equals the chunk-by-chunk pass's."""
    import dataclasses

    from fastgate.config import GenerationConfig, TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.testing import tiny_model

    monkeypatch.delenv("FASTGATE_BACKEND", raising=False)
    runner = ModelRunner(tiny_model(hidden=128, dtype=torch.bfloat16), step="eager")
    assert runner.ops.backends["prefill_attention"] == "ext" and hasattr(runner.ops.prefill_attention, "segs")
    prefix = "a shared block of words that every prompt starts with, cached once: "
    runner.cache_prefix(prefix)
    prompts = [prefix + p for p in ("one", "two words", "a longer question of many words here", "x " * 40)]
    cfg = GenerationConfig(max_new_tokens=4, stop_at_eos=False)
    op, calls = runner.ops.prefill_attention, []

    def counting(*args):
        calls.append(op.segs(*args))
        return calls[-1]

    def run(segs):
        def chunk(q, keys, values, start, scale=None, mask=None):
            return op(q, keys, values, start, scale, mask)

        if segs:
            chunk.segs = counting
        runner.ops = dataclasses.replace(runner.ops, prefill_attention=chunk)
        loop = PackedLoop(runner, mid=runner.n_layers // 2)
        done = loop.admit([(p, cfg, TapSpec(), 1, None) for p in prompts])
        while loop.busy:
            loop.step(16)
        return [(s.token_ids, s.token_logprobs) for d in done for s in d.result.sequences]

    assert run(segs=False) == run(segs=True)
    assert calls and all(calls) and len(calls) % runner.n_layers == 0
