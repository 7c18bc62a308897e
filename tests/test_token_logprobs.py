"""The op ``token_logprobs`` (fastgate.ops.sampling; the decode loop's tokens and their log-probs): the C++ loop
(``token_logprobs_f32``, AVX2 and FMA with torch's exp and log) is torch's ``log_softmax`` + ``argmax`` + ``gather``
bit for bit over awkward vocabularies (1, primes, 769, a partial last vector), ties, infinities, NaNs, strided rows and
given tokens, at the width of torch's own kernels (16 where its capability is AVX512, 8 else; the other width in a
subprocess whose torch runs AVX2); what it does not take goes to the reference; the decode loop's greedy tokens and
log-probs are the same through either."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.ops import reference
from fastgate.ops.registry import build_ops, import_ext
from fastgate.ops.sampling import ext_token_logprobs, torch_width


def _op():
    ext = import_ext()
    if ext is None or not getattr(ext, "quant_f32_kernels_supported", lambda: False)():
        pytest.skip("needs the C++ extension on an x86-64 CPU with AVX2 and FMA")
    op = ext_token_logprobs(ext)
    if op is reference.token_logprobs:
        pytest.skip("the C++ loop is not torch's bit for bit with this torch")
    return op


def _same(got, want):
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert torch.equal(got[1], want[1]) or torch.equal(got[1].isnan(), want[1].isnan()) and torch.equal(
        got[1].nan_to_num(), want[1].nan_to_num()), (got[1], want[1])


@pytest.mark.parametrize("v", [1, 2, 7, 8, 9, 13, 31, 769, 4099, 49152, 49157])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_the_loop_is_torch_s_bits(v, m):
    op = _op()
    gen = torch.Generator().manual_seed(v * 31 + m)
    x = torch.randn((m, v), generator=gen) * torch.logspace(-2, 2, m)[:, None]  # [M, V], scales 0.01 .. 100
    _same(op(x), reference.token_logprobs(x))
    chosen = torch.randint(0, v, (m,), generator=gen)
    _same(op(x, chosen), reference.token_logprobs(x, chosen))


def test_it_runs_torch_s_own_width():
    assert _op().width == torch_width()


@pytest.mark.parametrize("v", [2, 3, 7, 8, 9, 15, 16, 17, 33])
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_rows_of_negative_values(v, scale):
    """Every value negative: a short row's maximum was taken over lanes already max'ed with the zero padding (0, not
    the row's largest: other bits, and -inf log-sums at -300)."""
    op = _op()
    gen = torch.Generator().manual_seed(v)
    x = -(torch.rand((5, v), generator=gen) * scale + 0.5)  # [5, V], all < 0
    _same(op(x), reference.token_logprobs(x))


def test_the_other_width_under_an_avx2_torch():
    """The 8-wide order where torch's kernels run 8 wide (ATEN_CPU_CAPABILITY=avx2: what an AVX2-only CPU runs), so
    both widths are tested on a machine with AVX-512."""
    _op()
    script = textwrap.dedent("""
        import torch
        from fastgate.ops import reference
        from fastgate.ops.registry import import_ext
        from fastgate.ops.sampling import ext_token_logprobs, torch_width
        assert torch_width() == 8, torch.backends.cpu.get_cpu_capability()
        op = ext_token_logprobs(import_ext())
        assert op is not reference.token_logprobs and op.width == 8
        gen = torch.Generator().manual_seed(0)
        for v in (1, 3, 7, 9, 769, 49157):
            for x in (torch.randn((3, v), generator=gen) * 5, -(torch.rand((3, v), generator=gen) * 300 + 0.5)):
                got, want = op(x), reference.token_logprobs(x)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (v, got, want)
        print("ok")
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_a_width_this_cpu_or_build_lacks_is_an_error():
    ext = import_ext()
    if ext is None or not getattr(ext, "quant_f32_kernels_supported", lambda: False)():
        pytest.skip("needs the C++ extension on an x86-64 CPU with AVX2 and FMA")
    x, picks, out = torch.randn(1, 20), torch.zeros(1, dtype=torch.int64), torch.zeros(1)
    with pytest.raises(ValueError, match="width 8 or 16"):
        ext.token_logprobs_f32(x.data_ptr(), 1, 20, 20, picks.data_ptr(), True, out.data_ptr(), 1, 12)
    assert out.item() == 0.0  # nothing written


def test_ties_infinities_nans_and_strided_rows():
    op = _op()
    x = torch.randn(6, 777)
    x[0, [5, 300, 700]] = 9.0  # a tie: the first
    x[1, 400] = float("inf")  # the infinite one, its log-prob NaN as torch has it
    x[2] = float("-inf")
    x[2, 17] = 0.0  # one finite: log-prob 0
    x[3, [40, 90]] = float("nan")  # the first NaN, NaN log-probs
    x[4, 776] = 50.0  # the largest in the last partial vector
    x[5] = float("-inf")  # no finite value: NaN
    _same(op(x), reference.token_logprobs(x))
    wide = torch.randn(4, 1000)[:, 3:772]  # rows 1,000 apart
    assert wide.stride() == (1000, 1)
    _same(op(wide), reference.token_logprobs(wide))
    chosen = torch.tensor([0, 768, 5, 400])
    _same(op(wide, chosen), reference.token_logprobs(wide, chosen))


def test_other_inputs_go_to_the_reference_with_its_errors():
    op = _op()
    x = torch.randn(3, 50)
    for other in (x.to(torch.bfloat16), x.double(), x.t().contiguous().t()):  # other dtypes; unit stride along M
        _same(op(other), reference.token_logprobs(other))
    with pytest.raises(RuntimeError):  # torch's gather: a token out of range
        op(x, torch.tensor([0, 50, 1]))
    empty = torch.randn(0, 50)
    assert op(empty)[0].shape == (0,) and op(empty)[1].shape == (0,)


def test_the_registry_binds_it_where_it_agrees_and_the_loop_s_answers_do_not_change(tiny_engine):
    _op()
    ops = build_ops("auto", "cpu")
    assert ops.backends["token_logprobs"] == "ext"
    assert build_ops("torch", "cpu").token_logprobs is reference.token_logprobs
    runner = tiny_engine.runner
    cfg = [GenerationConfig(max_new_tokens=12, stop_at_eos=False)] * 2
    prompts = ["The capital of France is", "Once upon a time"]
    bound = runner.ops
    try:
        fast = tiny_engine.generate(prompts, cfg, [TapSpec()] * 2, [1, 1], [None, None])
        runner.ops = dataclasses.replace(bound, token_logprobs=reference.token_logprobs)
        ref = tiny_engine.generate(prompts, cfg, [TapSpec()] * 2, [1, 1], [None, None])
    finally:
        runner.ops = bound
    for a, b in zip(fast.sequences, ref.sequences):
        assert a.token_ids == b.token_ids and a.token_logprobs == b.token_logprobs
