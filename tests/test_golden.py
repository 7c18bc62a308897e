"""Every method's results on the tiny model equal the golden ones recorded from the batch-synchronous implementation
(``tests/golden.py``): answers, gate decisions, passages and counters."""

from __future__ import annotations

import json

import pytest
from golden import FIXTURE, QUESTIONS, assert_same, cases, comparable, setups

GOLDEN = json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return setups(tmp_path_factory.mktemp("golden"))


@pytest.fixture(scope="module")
def methods(world):
    from fastgate.methods import build_method

    engine, retrievers, ckpts = world
    return [build_method(name, engine, retrievers[r], params) for name, r, params in cases(ckpts)]


@pytest.mark.parametrize("case", range(len(GOLDEN)), ids=[f"{g['method']}-{g['retriever']}" for g in GOLDEN])
def test_batch_equals_golden(case, methods):
    want = GOLDEN[case]
    got = [comparable(r) for r in methods[case].answer_batch(QUESTIONS)]
    for i, (g, w) in enumerate(zip(got, want["results"])):
        assert_same(g, w, f"{want['method']} q{i}")
