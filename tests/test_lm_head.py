"""The LM head in column slices (fastgate.engine.lm_head): bitwise the plain product, and the same generations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.lm_head import QUANTUM, SlicedHead, slice_edges, slice_head, sliced_linear
from fastgate.engine.local import Engine
from fastgate.errors import InputError


def test_edges_merge_a_short_tail_into_the_slice_before_it():
    assert slice_edges(300, 256) == [0, 300]  # a 44-column tail joins the first slice
    assert slice_edges(769, 256) == [0, 256, 512, 769]  # a 257-column tail stays on its own
    assert slice_edges(4099, 2048) == [0, 2048, 4099]  # a 3-column tail joins the second slice
    assert slice_edges(151936, 2048)[-3:] == [147456, 149504, 151936]  # Qwen's 384-column tail is merged
    assert slice_edges(49152, 2048) == list(range(0, 49153, 2048))
    assert slice_edges(1, 256) == [0, 1]


def _head(n: int, k: int, bias: bool, columns: int) -> nn.Module:
    model = nn.Module()
    model.lm_head = nn.Linear(k, n, bias=bias)
    assert slice_head(model, columns) is True
    return model.lm_head


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("k", [1, 5, 64, 769])
@pytest.mark.parametrize("n,columns", [(300, 256), (769, 256), (4099, 512), (9001, 2048), (3 * QUANTUM, QUANTUM)])
def test_sliced_head_is_bitwise_the_plain_product(rows, k, n, columns):
    """The head's logits are bitwise ``F.linear``'s on every call: the first, which checks the row count, and the
    next, which uses the slices where the check passed. (The slices alone are not bitwise on every machine: MKL on an
    AVX-512 Xeon sums some of these shapes in another order.)"""
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    head = _head(n, k, True, columns)
    with torch.no_grad():
        head.weight.copy_(torch.randn(n, k, generator=gen))
        head.bias.copy_(torch.randn(n, generator=gen))
        for _ in range(2):
            x = torch.randn(rows, k, generator=gen)
            assert torch.equal(head(x), F.linear(x, head.weight, head.bias))
            torch.testing.assert_close(sliced_linear(x, head.weight, None, columns), F.linear(x, head.weight),
                                       rtol=1e-5, atol=1e-4)
    assert set(head.bitwise) == ({(rows, torch.get_num_threads(), True)} if rows > 1 else set())


def test_sliced_head_uses_the_slices_only_for_row_counts_that_passed_the_check(monkeypatch):
    import fastgate.engine.lm_head as lm_head

    head = _head(769, 8, False, 256)
    calls = []
    exact = lm_head.sliced_linear

    def off_by_a_bit(x, weight, bias=None, columns=256):  # slices summed in another order: the last bit differs
        calls.append(x.shape)
        return torch.nextafter(exact(x, weight, bias, columns), torch.tensor(float("inf")))

    monkeypatch.setattr(lm_head, "sliced_linear", off_by_a_bit)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(head(x), F.linear(x, head.weight))
        assert len(calls) == 1 and head.bitwise == {(3, torch.get_num_threads(), True): False}  # one check, then plain

        def counted(x, weight, bias=None, columns=256):
            calls.append(x.shape)
            return F.linear(x, weight, bias)

        monkeypatch.setattr(lm_head, "sliced_linear", counted)
        y = torch.randn(4, 8)
        assert torch.equal(head(y), F.linear(y, head.weight))  # the check: the plain product is returned
        assert torch.equal(head(y), F.linear(y, head.weight))  # the slices, now trusted for 4 rows
        assert len(calls) == 3 and head.bitwise[(4, torch.get_num_threads(), True)] is True


def test_sliced_linear_takes_batched_and_non_contiguous_input():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(769, 64, generator=gen)
    wide = torch.randn(1, 16, 128, generator=gen)
    x = wide[:, :, ::2]  # [1, 16, 64], not contiguous, as HF's hidden_states[:, keep, :] can be
    assert not x.is_contiguous()
    out = sliced_linear(x, w, None, 256)
    assert out.shape == (1, 16, 769)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    head = _head(769, 64, False, 256)
    with torch.no_grad():
        head.weight.copy_(w)
        for _ in range(2):
            assert torch.equal(head(x), F.linear(x, w))
    assert (16, torch.get_num_threads(), False) in head.bitwise


def test_bad_slices_and_shapes_are_refused():
    w = torch.randn(769, 8)
    with pytest.raises(InputError, match="multiple of 256"):
        sliced_linear(torch.randn(2, 8), w, None, 100)
    with pytest.raises(InputError, match="multiple of 256"):
        sliced_linear(torch.randn(2, 8), w, None, 0)
    with pytest.raises(InputError, match="does not match"):
        sliced_linear(torch.randn(2, 9), w, None, 256)
    with pytest.raises(InputError, match="multiple of 256"):
        slice_head(nn.Module(), 300)


def test_slice_head_keeps_the_parameter_and_state_dict_and_can_be_undone():
    model = nn.Module()
    model.embed = nn.Embedding(1000, 16)
    model.lm_head = nn.Linear(16, 1000, bias=False)
    model.lm_head.weight = model.embed.weight  # tied, as in SmolLM2
    keys = list(model.state_dict())
    x = torch.randn(1, 5, 16)
    plain = model.lm_head(x)
    assert slice_head(model, 256) is True
    assert isinstance(model.lm_head, SlicedHead) and model.lm_head.weight is model.embed.weight
    assert list(model.state_dict()) == keys
    assert torch.equal(model.lm_head(x), plain)
    one = x[:, :1]
    assert torch.equal(model.lm_head(one), F.linear(one, model.embed.weight))  # one row: the plain product
    assert slice_head(model, 256) is True  # idempotent
    assert slice_head(model, 0) is False
    assert type(model.lm_head) is nn.Linear and torch.equal(model.lm_head(x), plain)


def test_slice_head_leaves_other_heads_alone():
    half = nn.Module()
    half.lm_head = nn.Linear(16, 1000).to(torch.bfloat16)
    assert slice_head(half) is False and type(half.lm_head) is nn.Linear
    headless = nn.Module()
    assert slice_head(headless) is False


def test_engine_generations_are_the_same_with_a_sliced_head(tiny):
    """Greedy tokens, log-probs and taps of a batch, with the tiny model's head in slices of 256 and without."""
    prompts = ["The capital of France is", "Hamlet was written by", "One two three four five six"]
    cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    taps = TapSpec(layers=(1, 2), pre_answer=True, eos_state=True)
    try:
        results = []
        for columns in (0, QUANTUM):
            engine = Engine(tiny, prefix_cache=0, head_columns=columns)
            assert engine.sliced_head is bool(columns)
            with torch.inference_mode():
                results.append(engine.generate(prompts, cfg, taps=taps))
        plain, sliced = results
        assert tiny.model.lm_head.out_features > QUANTUM  # the head really runs in two slices or more
        for a, b in zip(plain.sequences, sliced.sequences):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert a.token_logprobs == b.token_logprobs
        for name in ("running_sum", "count", "pre_answer", "eos_state"):
            assert torch.equal(getattr(plain, name), getattr(sliced, name))
    finally:
        Engine(tiny)  # back to the default the session's other engines were built with
