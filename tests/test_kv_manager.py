"""The KV owner (:class:`fastgate.engine.kv_cache.KVCacheManager`): the prompt's truncation, a row's worst case and
the bytes of a cell, as the engine, the decode loops and admission use them."""

from __future__ import annotations

import pytest
import torch

from fastgate.engine.kv_cache import EXTRA_STEPS, KVCacheManager, KVGeometry, cell_bytes
from fastgate.errors import InputError


def _kv(max_context: int = 16) -> KVCacheManager:
    return KVCacheManager(KVGeometry(layers=3, kv_heads=2, head_dim=5, dtype=torch.float32), max_context)


def test_a_cell_costs_keys_and_values_of_every_layer():
    kv = _kv()
    assert kv.cell_bytes == 2 * 3 * 2 * 5 * 4
    assert KVCacheManager(KVGeometry(3, 2, 5, torch.bfloat16), 16).cell_bytes == kv.cell_bytes // 2
    assert kv.budget_cells(None) is None
    assert kv.budget_cells(10 * kv.cell_bytes + 1) == 10
    assert kv.budget_cells(1) == 1  # never zero: one cell at least


def test_truncation_keeps_the_end_and_leaves_room_for_the_new_tokens_and_a_forced_eos():
    kv = _kv(max_context=16)
    rows, cut = kv.truncate([list(range(20)), [1, 2, 3]], [5, 5])
    assert rows == [list(range(10, 20)), [1, 2, 3]] and cut == [True, False]  # 16 - 5 - 1 = 10 kept
    assert kv.prompt_tokens(20, 5) == 10 and kv.prompt_tokens(3, 5) == 3
    with pytest.raises(InputError, match="max_new_tokens=15 leaves no room in the 16-token context"):
        kv.prompt_room(15)


def test_a_rows_worst_case_is_its_prompt_its_steps_left_and_two_more():
    assert EXTRA_STEPS == 2
    assert KVCacheManager.row_columns(7, 4) == 7 + 4 + 2
    assert KVCacheManager.row_columns(9, 4, generated=3) == 9 + 1 + 2
    assert KVCacheManager.steps_left(4, 4) == 2


def test_the_engine_and_its_loops_ask_the_one_owner(tiny_engine):
    from fastgate.engine.decode import DecodeLoop

    kv = tiny_engine.kv
    assert kv.cell_bytes == cell_bytes(tiny_engine.model.config, tiny_engine.dtype)
    assert kv.max_context == tiny_engine.lm.max_context
    prompt = "Q: who wrote Hamlet?\nA:"
    ids, cut = tiny_engine.encode([prompt], 8)
    assert not cut[0] and len(ids[0]) == tiny_engine.count_tokens(prompt)
    loop = DecodeLoop(tiny_engine, tiny_engine.n_layers // 2)
    # three rows at their final width, and the prompt's own cache while it prefills
    assert loop.cells_after([(len(ids[0]), 3, 8)]) == 3 * kv.row_columns(len(ids[0]), 8) + len(ids[0])
