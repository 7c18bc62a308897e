"""Methods on the tiny model with a small BM25 index: typed results, batching by decision, validation."""

from __future__ import annotations

import pytest

from fastgate.errors import InputError, UnknownNameError
from fastgate.methods import METHODS, build_method, make_config
from fastgate.methods.base import MethodResult
from fastgate.retrieval import BM25Retriever

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "capital of Kyrgyzstan", "largest planet"]


@pytest.fixture(scope="module")
def bm25(small_index):
    return BM25Retriever(small_index / "bm25")


def test_registry_and_parameters():
    assert set(METHODS) >= {"never", "always", "dtr"}
    assert METHODS["dtr"].parameters()["tau"] == 0.001
    assert make_config("dtr", {"tau": "0.5", "k": "2"}).tau == 0.5
    with pytest.raises(UnknownNameError, match="unknown method 'magic'"):
        make_config("magic")
    with pytest.raises(InputError, match="unknown parameter"):
        make_config("dtr", {"theta": 1})
    with pytest.raises(InputError, match="expects float"):
        make_config("dtr", {"tau": "high"})
    with pytest.raises(InputError):
        make_config("always", {"k": 0})


def test_never_and_always(tiny_engine, bm25):
    never = build_method("never", tiny_engine)
    r = never.answer("Who wrote Hamlet?")
    assert isinstance(r, MethodResult)
    assert (r.retrieved, r.retrieval_calls, r.lm_calls, r.passages) == (False, 0, 1, [])
    always = build_method("always", tiny_engine, bm25, {"k": 2})
    results = always.answer_batch(QUESTIONS)
    assert [x.question for x in results] == QUESTIONS
    assert all(x.retrieved and x.retrieval_calls == 1 and 1 <= len(x.passages) <= 2 for x in results)
    assert len(results[0].passages) == 2
    assert results[1].passages[0].id == "p5"
    d = results[0].to_dict()
    assert set(d) >= {"answer", "retrieved", "passages", "retrieval_calls", "lm_calls", "generated_tokens", "timings"}
    assert set(d["passages"][0]) == {"id", "title", "score"}


@pytest.mark.parametrize("tau,expect", [(0.0, True), (float("inf"), False)])
def test_dtr_threshold_extremes(tiny_engine, bm25, tau, expect):
    results = build_method("dtr", tiny_engine, bm25, {"tau": tau}).answer_batch(QUESTIONS)
    assert all(r.retrieved is expect for r in results)
    assert all(r.lm_calls == (2 if expect else 1) for r in results)
    assert all(len(r.gate_steps) == 1 and r.gate_steps[0].gate == "answer_nll" for r in results)


def test_dtr_batches_by_decision_and_keeps_order(tiny_engine, bm25):
    scores = [r.gate_steps[0].score for r in build_method("dtr", tiny_engine, bm25, {"tau": 0}).answer_batch(QUESTIONS)]
    tau = sorted(scores)[len(scores) // 2]  # split the batch in two
    method = build_method("dtr", tiny_engine, bm25, {"tau": tau})
    batch = method.answer_batch(QUESTIONS)
    assert [r.retrieved for r in batch] == [s >= tau for s in scores]
    assert any(r.retrieved for r in batch) and not all(r.retrieved for r in batch)
    for q, r in zip(QUESTIONS, batch):
        alone = method.answer(q)
        assert (alone.answer, alone.retrieved) == (r.answer, r.retrieved)


def test_question_validation(tiny_engine, bm25):
    method = build_method("never", tiny_engine)
    for bad in ["", "   \n"]:
        with pytest.raises(InputError, match="empty"):
            method.answer(bad)
    with pytest.raises(InputError, match="too long"):
        method.answer("why " * 5000)
    with pytest.raises(InputError):
        method.answer_batch("a string, not a list")
    with pytest.raises(InputError, match="needs a retriever"):
        build_method("always", tiny_engine, None)
