"""``fastgate.ops.threads.serial_torch``: torch's CPU work on one thread inside, the count restored after (also on
an error), nothing changed for many rows, another device or one thread; and the decode loop handles a few rows'
logits inside it (the cast of the fused pass, the token choice), so torch's OpenMP threads do not spin beside the C++
kernels' pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.decode import DecodeLoop
from fastgate.engine.packed import PackedLoop
from fastgate.ops.threads import SERIAL_ROWS, serial_torch


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_one_thread_inside_and_restored_after(two_threads):
    x = torch.zeros(3, 5)
    with serial_torch(x, 3):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), serial_torch(x, SERIAL_ROWS):
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_many_rows_or_another_device_keep_torch_s_threads(two_threads):
    with serial_torch(torch.zeros(1), SERIAL_ROWS + 1):
        assert torch.get_num_threads() == 2
    with serial_torch(torch.zeros(1, device="meta"), 1):
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("kind", [DecodeLoop, PackedLoop])
def test_a_few_rows_logits_are_handled_on_one_thread(tiny_engine, two_threads, monkeypatch, kind):
    runner = tiny_engine.runner
    seen = []
    choose = runner.ops.token_logprobs

    def spy(logits, chosen=None):
        seen.append((logits.shape[0], torch.get_num_threads()))
        return choose(logits, chosen)

    monkeypatch.setattr(runner, "ops", dataclasses.replace(runner.ops, token_logprobs=spy))
    loop = kind(runner, mid=tiny_engine.n_layers // 2)
    cfg = GenerationConfig(max_new_tokens=3, stop_at_eos=False)
    with torch.inference_mode():
        loop.add([(p, cfg, TapSpec(), 1, None) for p in ("The capital of Spain", "Q: 1889?")])
        while loop.rows:
            loop.step()
    assert seen and all(threads == 1 for _, threads in seen), seen
    assert torch.get_num_threads() == 2
