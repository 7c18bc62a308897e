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
    assert set(METHODS) == {"never", "always", "flare", "probing", "dtr", "seakr", "scaar", "cbdr", "read"}
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


def test_a_reading_prompt_too_long_for_the_context_keeps_its_best_ranked_passages(tiny_engine, bm25):
    """The engine cuts a prompt on the left, where the instruction and the best passages stand: the method keeps the
    leading passages that fit instead (the most that do), and its record lists those, not every one searched."""
    from fastgate.prompts import rag_prompt

    q = "What is the capital of France?"
    every = build_method("always", tiny_engine, bm25, {"k": 7}).answer(q).passages  # 512-token context: all fit
    assert len(every) >= 4
    tight = build_method("always", tiny_engine, bm25, {"k": 7, "max_answer_tokens": 250})
    r = tight.answer(q)
    room = tiny_engine.lm.max_context - 250 - 1

    def tokens(n):
        return tiny_engine.count_tokens(rag_prompt(q, [h.passage for h in every[:n]], 120))

    n = len(r.passages)
    assert 1 <= n < len(every) and [h.id for h in r.passages] == [h.id for h in every[:n]]
    assert tokens(n) <= room < tokens(n + 1) and not r.truncated
    assert r.prompt_tokens == tokens(n)


@pytest.mark.parametrize("tau,expect", [(0.0, True), (float("inf"), False)])
def test_dtr_threshold_extremes(tiny_engine, bm25, tau, expect):
    results = build_method("dtr", tiny_engine, bm25, {"tau": tau}).answer_batch(QUESTIONS)
    assert all(r.retrieved is expect for r in results)
    assert all(r.lm_calls == (3 if expect else 1) for r in results)  # answer; then pseudo-context and final answer
    assert all(len(r.gate_steps) == 1 and r.gate_steps[0].gate == "answer_nll" for r in results)


def test_dtr_caches_its_pseudo_context_block_and_its_prompts_find_it(tiny, bm25):
    from fastgate.engine.local import Engine
    from fastgate.prompts import PSEUDO_CONTEXT_PREFIX, pseudo_context_prompt

    eng = Engine(tiny)
    build_method("dtr", eng, bm25, {"tau": 0.0})
    block = tuple(eng.runner.encode([PSEUDO_CONTEXT_PREFIX], [1])[0][0])
    assert block in eng.runner.cached_prefixes()
    rows = eng.runner.encode([pseudo_context_prompt(q) for q in QUESTIONS[:1]], [1])[0]
    assert eng.runner.shared_prefix(rows) == block  # a lone prompt starts from the cached block


def test_dtr_batches_by_decision_and_keeps_order(tiny_engine, bm25):
    scores = [r.gate_steps[0].score for r in build_method("dtr", tiny_engine, bm25, {"tau": 0}).answer_batch(QUESTIONS)]
    # split the batch in two, with tau halfway between two scores: a question answered alone runs other matmul shapes
    # than in the batch, so its NLL may differ in the last float bits, and a tau equal to a score would be a coin flip
    ranked = sorted(scores)
    tau = (ranked[len(scores) // 2 - 1] + ranked[len(scores) // 2]) / 2
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


# ---------------------------------------------------------------- the five methods (+ FLARE) on the tiny model
@pytest.fixture(scope="module")
def dense(small_index):
    from fastgate.retrieval import DenseRetriever

    return DenseRetriever(small_index / "dense")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny):
    from fastgate.gates.checkpoints import random_probe_params, save_probe_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    probe = save_probe_checkpoint(root / "probe", random_probe_params(2, tiny.hidden_size, 16, seed=1),
                                  kind="probing", model=tiny, layers=(2, 4))
    conf = save_probe_checkpoint(root / "conf", random_probe_params(1, tiny.hidden_size, 16, seed=2),
                                 kind="confidence", model=tiny, layers=(2,))
    return {"probing": str(probe), "cbdr": str(conf)}


FAST = {  # small settings so each method runs in about a second on the tiny model
    "flare": {"max_sentences": 2, "sentence_tokens": 8},
    "scaar": {"max_sentences": 2, "sentence_tokens": 8},
    "probing": {"max_iterations": 2, "max_rationale_tokens": 12},
    "seakr": {"samples": 3, "step_tokens": 6, "max_steps": 2, "n_candidates": 2, "answer_tokens": 8,
              "max_answer_tokens": 6},
    "cbdr": {"n_candidates": 4},
    "dtr": {"pseudo_tokens": 12},
}


def _params(name, checkpoints, **extra):
    p = dict(FAST.get(name, {}))
    if name in checkpoints:
        p["checkpoint"] = checkpoints[name]
    p.update(extra)
    return p


# (parameter, value that always retrieves, value that never does)
EXTREMES = {
    "flare": ("theta", 1.0, 0.0),
    "scaar": ("theta", 1.0, 0.0),
    "probing": ("theta", 100.0, -100.0),
    "dtr": ("tau", 0.0, float("inf")),
    "seakr": ("delta", -1e9, 1e9),
    "cbdr": ("beta", 1.0, 0.0),
}


@pytest.mark.parametrize("name", sorted(EXTREMES))
def test_gated_methods_follow_their_threshold(name, tiny_engine, bm25, checkpoints):
    key, always_value, never_value = EXTREMES[name]
    on = build_method(name, tiny_engine, bm25, _params(name, checkpoints, **{key: always_value}))
    off = build_method(name, tiny_engine, bm25, _params(name, checkpoints, **{key: never_value}))
    for r in on.answer_batch(QUESTIONS):
        assert r.retrieval_calls >= 1 and r.retrieved and r.gate_steps and r.gate_steps[0].retrieve
        assert r.lm_calls >= 2 and r.generated_tokens >= 1 and r.method == name
    for r in off.answer_batch(QUESTIONS):
        assert r.retrieval_calls == 0 and not r.retrieved and r.passages == []
        assert r.gate_steps and not any(s.retrieve for s in r.gate_steps)
        assert r.lm_calls >= 1


@pytest.mark.parametrize("name", sorted(EXTREMES))
def test_same_answer_alone_and_in_a_batch_of_8(name, tiny_engine, bm25, checkpoints):
    key = EXTREMES[name][0]
    probe = build_method(name, tiny_engine, bm25, _params(name, checkpoints))
    batch_q = QUESTIONS + ["capital of Germany", "Eiffel Tower", "Burkina Faso", "planet Jupiter"]
    # SCAAR's score is the θ at which its rule flips: like the others, a threshold in the middle of the scores
    scores = sorted(r.gate_steps[0].score for r in probe.answer_batch(batch_q))
    mid = (scores[3] + scores[4]) / 2  # a threshold in the middle of the first gate scores
    candidates = [{"probing": -mid}.get(name, mid)]
    for value in candidates:
        method = build_method(name, tiny_engine, bm25, _params(name, checkpoints, **{key: value}))
        batch = method.answer_batch(batch_q)
        if len({r.gate_steps[0].retrieve for r in batch}) == 2:
            break
    assert len({r.gate_steps[0].retrieve for r in batch}) == 2, "threshold did not split the batch"
    for q, r in zip(batch_q, batch):
        alone = method.answer(q)
        assert alone.question == r.question == q
        assert (alone.answer, alone.retrieval_calls, [s.retrieve for s in alone.gate_steps]) == (
            r.answer, r.retrieval_calls, [s.retrieve for s in r.gate_steps])
        assert [h.id for h in alone.passages] == [h.id for h in r.passages]


def test_learned_gates_need_a_checkpoint(tiny_engine, bm25, checkpoints, tmp_path):
    from fastgate.errors import CheckpointError

    for name in ("probing", "cbdr"):  # no checkpoint ships for the tiny test model
        with pytest.raises(CheckpointError, match="none ships for model"):
            build_method(name, tiny_engine, bm25)
    with pytest.raises(CheckpointError, match="not 'confidence'"):
        build_method("cbdr", tiny_engine, bm25, {"checkpoint": checkpoints["probing"]})
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        build_method("probing", tiny_engine, bm25, {"checkpoint": str(tmp_path / "missing")})


def test_dtr_selects_top_k_of_the_union_by_ais(tiny_engine, dense):
    import torch

    from fastgate.ops import build_ops
    from fastgate.scheduler import Scheduler

    method = build_method("dtr", tiny_engine, dense, {"n": 3, "k": 2})
    q, p = "capital of Burkina Faso", "Ouagadougou is a city in West Africa"
    (hits,) = Scheduler(tiny_engine).evaluate([method.select(q, p)])
    vq, vp = dense.embed([q, p])
    union = {}
    for h in dense.search_vectors(vq[None], 3)[0] + dense.search_vectors(vp[None], 3)[0]:
        union.setdefault(h.id, h)
    cands = list(union.values())
    docs = torch.from_numpy(dense.passage_vectors(cands))
    scores = build_ops("auto", "cpu").ais_scores(torch.from_numpy(vq), torch.from_numpy(vp), docs)
    want = sorted(zip(scores.tolist(), [h.id for h in cands]), key=lambda t: -t[0])[:2]
    assert [h.id for h in hits] == [i for _, i in want]
    assert [h.score for h in hits] == pytest.approx([s for s, _ in want], abs=1e-6)
    summed = Scheduler(tiny_engine).evaluate([build_method("dtr", tiny_engine, dense, {"n": 3, "k": 2, "mode": "sum"})
                                              .select(q, p)])[0]
    assert all(-2.0 <= h.score <= 2.0 for h in summed)


@pytest.mark.parametrize("retriever", ["dense", "bm25"])
def test_dtr_selects_for_a_batch_as_for_each_question_alone(tiny_engine, dense, bm25, retriever):
    from fastgate.scheduler import Scheduler

    index = {"dense": dense, "bm25": bm25}[retriever]
    method = build_method("dtr", tiny_engine, index, {"n": 3, "k": 2})
    # unions of different sizes (padded to the largest in one AIS call), and a pair that shares every candidate
    qs = ["capital of Burkina Faso", "Hamlet", "largest planet Jupiter", "capital of Burkina Faso"]
    ps = ["Ouagadougou is a city in West Africa", "Shakespeare wrote a tragedy", "Paris and Berlin", "Ouagadougou"]
    batch = Scheduler(tiny_engine).evaluate([method.select(q, p) for q, p in zip(qs, ps)])  # one AIS call
    assert len(batch) == len(qs)
    for q, p, hits in zip(qs, ps, batch):
        (alone,) = Scheduler(tiny_engine).evaluate([method.select(q, p)])
        assert [h.id for h in hits] == [h.id for h in alone] and 1 <= len(hits) <= 2
        assert [h.score for h in hits] == pytest.approx([h.score for h in alone], abs=1e-5)


def test_cbdr_reranks_by_confidence_shift(tiny_engine, bm25, checkpoints):
    from fastgate.prompts import closed_book_prompt, rag_prompt
    from fastgate.scheduler import Scheduler

    method = build_method("cbdr", tiny_engine, bm25, _params("cbdr", checkpoints, beta=1.0, k=2))
    q = "What is the capital of Burkina Faso?"
    cands = bm25.search(q, 4)
    conf_q = float(method.gate.confidence(tiny_engine.prompt_states([closed_book_prompt(q)], 2))[0])
    (top,) = Scheduler(tiny_engine).evaluate([method.rerank(q, conf_q, cands)])
    conf_c = method.gate.confidence(tiny_engine.prompt_states([rag_prompt(q, [h.passage]) for h in cands], 2))
    inc = [float(c) - conf_q for c in conf_c]
    want = sorted(range(len(cands)), key=lambda j: -inc[j])[:2]
    assert [h.id for h in top] == [cands[j].id for j in want]
    assert [h.score for h in top] == pytest.approx([inc[j] for j in want], abs=1e-5)


def test_seakr_reasoning_step_picks_the_lower_eigenscore(tiny_engine, bm25):
    method = build_method("seakr", tiny_engine, bm25, _params("seakr", {}, delta=-1e9))
    for r in method.answer_batch(QUESTIONS[:2]):
        final = [s for s in r.gate_steps if s.gate == "knowledge_path_eigenscore"]
        if r.passages:  # retrieved knowledge: both paths competed, the lower eigenscore won
            assert len(final) == 1 and final[0].retrieve == (final[0].score < final[0].threshold)
        else:
            assert final == []


def test_cli_lists_every_method(capsys):
    from fastgate.entrypoints.cli import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in METHODS:
        assert f"{name}:" in out
    assert "checkpoint = ''" in out and "delta = -6.0" in out


def test_cbdr_trained_reranker_orders_by_cosine(tiny_engine, bm25, checkpoints):
    from fastgate.assets.embedder import Embedder, default_embedder_path
    from fastgate.scheduler import Scheduler

    with pytest.raises(InputError, match="reranker_path"):
        make_config("cbdr", {"reranker": "trained"})
    path = str(default_embedder_path())  # any sentence-transformers directory works as a reranker
    method = build_method("cbdr", tiny_engine, bm25, _params("cbdr", checkpoints, beta=1.0, k=2, reranker="trained",
                                                              reranker_path=path))
    q = "What is the capital of Burkina Faso?"
    cands = bm25.search(q, 4)
    (top,) = Scheduler(tiny_engine).evaluate([method.rerank(q, 0.0, cands)])
    v = Embedder(path).encode([q] + [f"{h.title}. {h.text}" for h in cands])
    sims = (v[1:] @ v[0]).tolist()
    assert [h.id for h in top] == [cands[j].id for j in sorted(range(4), key=lambda j: -sims[j])[:2]]


def test_calibrated_seakr_delta_follows_the_sample_count():
    from fastgate.methods.calibration import CALIBRATED, SEAKR_DELTA_BY_SAMPLES, calibrated_params

    table = {20: CALIBRATED["smollm2-135m"]["seakr"]["delta"], **SEAKR_DELTA_BY_SAMPLES["smollm2-135m"]}
    assert calibrated_params("smollm2-135m", "seakr")["delta"] == table[20]
    assert calibrated_params("smollm2-135m", "seakr", {"samples": 3})["delta"] == table[3]
    assert calibrated_params("smollm2-135m", "seakr", {"samples": 4})["delta"] == table[3]  # nearest calibrated k
    assert calibrated_params("smollm2-135m", "seakr", {"samples": 3, "delta": 0.5})["delta"] == 0.5  # user wins
    assert table[3] != table[20]
    assert "delta" not in calibrated_params("other-model", "seakr", {"samples": 3})


def test_a_nan_threshold_is_refused_and_infinite_ones_kept():
    """NaN compares false with every score (a gate that silently never fires); +-inf are thresholds sweeps use."""
    for value in (float("nan"), "nan", "NaN"):
        with pytest.raises(InputError, match="parameter tau must be a number"):
            make_config("dtr", {"tau": value})
    assert make_config("dtr", {"tau": "inf"}).tau == float("inf")
    with pytest.raises(InputError, match="out of range for a float"):
        make_config("dtr", {"tau": 10 ** 400})
    assert make_config("flare", {"theta": 0.5}).theta == 0.5
