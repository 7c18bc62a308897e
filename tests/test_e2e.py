"""End to end with the real default model (SmolLM2-135M, converted once into $FASTGATE_HOME) and real corpus."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def ask(capsys):
    """``fastgate ask --dtype float32 ARGV`` in this process (the CLI's own ``main``; a subprocess would pay the
    imports again): its status, stdout and stderr. float32 on every CPU: the thresholds were calibrated, and these
    answers checked, in float32."""
    from fastgate.entrypoints.cli import main

    def run(*argv):
        capsys.readouterr()
        code = main(["ask", "--dtype", "float32", *argv])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def test_gate_decides_differently_for_known_and_unknown_facts(ask):
    proc = ask("--json", "--method", "dtr", "--retriever", "bm25", "Who wrote Hamlet?",
               "What is the capital of Burkina Faso?")
    assert proc.returncode == 0, proc.stderr
    known, unknown = (json.loads(line) for line in proc.stdout.strip().splitlines())
    for r in (known, unknown):
        assert set(r) >= {"answer", "retrieved", "passages", "retrieval_calls", "lm_calls", "generated_tokens",
                          "timings"}
        assert r["timings"]["total_s"] > 0
    assert "Shakespeare" in known["answer"]
    assert known["retrieved"] is False and known["retrieval_calls"] == 0 and known["lm_calls"] == 1
    # answer, pseudo-context, answer with the passages chosen by AIS over both paths
    assert unknown["retrieved"] is True and unknown["retrieval_calls"] == 1 and unknown["lm_calls"] == 3
    assert "Burkina Faso" in [p["title"] for p in unknown["passages"]]
    assert all(set(p) == {"id", "title", "score"} for p in unknown["passages"])
    assert "Ouagadougou" in unknown["answer"]


def test_dense_retriever_on_custom_index(ask, small_index):
    proc = ask("--json", "--method", "always", "--retriever", "dense", "--index", str(small_index), "--k", "2",
               "What is the capital of Kyrgyzstan?")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["retriever"] == "dense" and r["retrieved"] is True
    assert r["passages"][0]["id"] == "p4" and len(r["passages"]) == 2
    assert r["answer"]  # the 135M model's answer quality is not under test here


def test_question_longer_than_context_is_rejected(ask):
    proc = ask("--method", "never", "why " * 20000)
    assert proc.returncode == 2
    assert proc.stderr.startswith("fastgate: error: the question is too long")
    assert "Traceback" not in proc.stderr


def test_same_greedy_answer_alone_and_in_a_batch_of_8():
    from fastgate.assets.models import load
    from fastgate.engine.local import Engine
    from fastgate.methods import build_method
    from fastgate.retrieval import open_retriever

    engine = Engine(load("smollm2-135m", dtype="float32"))  # exact comparisons: float32 on every CPU
    questions = ["Who wrote Hamlet?", "What is the capital of Burkina Faso?", "What is the capital of Japan?",
                 "What is the capital of Kyrgyzstan?", "Who painted the Mona Lisa?", "What is the capital of Chad?",
                 "In what year did the Berlin Wall fall?", "What is the largest ocean?"]
    method = build_method("dtr", engine, open_retriever("bm25"), {"tau": 0.5})
    batch = method.answer_batch(questions)
    assert any(r.retrieved for r in batch) and not all(r.retrieved for r in batch)
    # alone: the first question the gate sends to retrieval and the first it answers closed-book (each alone costs
    # a whole run of the real model; the tiny-model tests compare every question of every method)
    some = [next(i for i, r in enumerate(batch) if r.retrieved == kind) for kind in (True, False)]
    for q, r in [(questions[i], batch[i]) for i in sorted(some)]:
        alone = method.answer(q)
        assert (alone.answer, alone.retrieved, [h.id for h in alone.passages]) == (
            r.answer, r.retrieved, [h.id for h in r.passages])
