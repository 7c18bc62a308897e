"""The read gate: features, the logistic model and its checkpoint, the method over a base gate on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fastgate.engine.local import Generation
from fastgate.errors import CheckpointError, InputError
from fastgate.gates.read import (
    FEATURE_SETS,
    ReadGate,
    fit_read_model,
    load_read_checkpoint,
    read_features,
    save_read_checkpoint,
)
from fastgate.methods import build_method
from fastgate.retrieval import BM25Retriever, DenseRetriever
from fastgate.retrieval.base import Hit

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "capital of Kyrgyzstan", "largest planet"]


def _gen(text: str, lps: list[float]) -> Generation:
    return Generation(text=text, token_ids=list(range(len(lps))), token_logprobs=lps, answer_tokens=len(lps),
                      finish_reason="stop", prompt_tokens=5, truncated=False)


def _hit(pid: str, title: str, text: str, score: float) -> Hit:
    from fastgate.assets.corpus import Passage

    return Hit(Passage(pid, title, text), score)


@pytest.fixture(scope="module")
def retrievers(small_index):
    return {"bm25": BM25Retriever(small_index / "bm25"), "dense": DenseRetriever(small_index / "dense")}


def test_features_by_hand():
    bm = [_hit("a", "Paris", "Paris is the capital of France.", 9.0), _hit("b", "Berlin", "Berlin.", 4.0)]
    dn = [_hit("b", "Berlin", "Berlin.", 0.5), _hit("c", "Rome", "Rome.", 0.25)]
    f = read_features("What is the capital of France?", _gen("Paris", [-0.5, -1.5]), 1.0, bm, dn)
    assert f["cb_nll"] == pytest.approx(1.0) and f["cb_min_logprob"] == -1.5 and f["base_score"] == 1.0
    assert f["bm25_top"] == 9.0 and f["bm25_drop"] == 5.0 and f["dense_drop"] == 0.25
    assert f["bm25_cover"] == 1.0  # capital, france both in the top passage
    assert f["dense_cover"] == 0.0
    assert f["bm25_answer_in"] == 1.0 and f["dense_answer_in"] == 0.0
    assert f["agree"] == 0.5
    assert set(FEATURE_SETS["all"]) <= set(f) and not any(k.startswith("bm25") for k in FEATURE_SETS["dense"])
    # a base without a score, no searches: defined, finite features
    g = read_features("q?", _gen("", []), math.nan, None, None)
    assert all(math.isfinite(v) for v in g.values())


def test_fit_separates_and_checkpoint_round_trip(tmp_path, tiny):
    rng = np.random.default_rng(0)
    rows = [{f: float(rng.normal()) for f in FEATURE_SETS["all"]} for _ in range(200)]
    labels = [int(r["bm25_top"] > 0.5) for r in rows]
    m = fit_read_model(rows, labels, FEATURE_SETS["all"])
    w = dict(zip(m.features, m.weights))
    assert max(w, key=lambda k: abs(w[k])) == "bm25_top" and w["bm25_top"] > 0
    logits = m.logits(rows)
    assert ((logits > 0) == np.asarray(labels, bool)).mean() > 0.9
    path = save_read_checkpoint(tmp_path / "ck", {"all": m}, model=tiny, base="dtr", meta={"n": 200})
    back = load_read_checkpoint(path, "all", model=tiny, base="dtr")
    np.testing.assert_allclose(back.logits(rows), logits)
    with pytest.raises(CheckpointError, match="no 'dense' model"):
        load_read_checkpoint(path, "dense", model=tiny)
    with pytest.raises(CheckpointError, match="over dtr, not cbdr"):
        load_read_checkpoint(path, "all", base="cbdr")
    other = type("M", (), {"name": "other-model", "fingerprint": ""})()
    with pytest.raises(CheckpointError, match="trained for model"):
        load_read_checkpoint(path, "all", model=other)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="missing or corrupt"):
        load_read_checkpoint(path, "all")
    (path / "config.json").write_bytes(b"{\xc9\xff\x00 binary")  # not UTF-8 text at all
    with pytest.raises(CheckpointError, match="missing or corrupt"):
        load_read_checkpoint(path, "all")
    with pytest.raises(InputError, match="missing"):
        m.logits([{"bm25_top": 1.0}])
    gate = ReadGate(m, threshold=0.0)
    steps = gate.decide(rows[:4])
    assert [s.retrieve for s in steps] == [bool(x >= 0) for x in logits[:4]]


def test_gain_model_scores_expected_gain_and_round_trips(tmp_path, tiny):
    from fastgate.gates.read import GainModel, ReadModel, fit_gain_model

    rng = np.random.default_rng(0)
    rows = [{f: float(rng.normal()) for f in FEATURE_SETS["all"]} for _ in range(300)]
    fixed = np.array([int(r["bm25_top"] > 0.3) for r in rows])
    broken = np.array([int(r["cb_nll"] < -1.0 and not f) for r, f in zip(rows, fixed)])
    m = fit_gain_model(rows, fixed, broken, FEATURE_SETS["all"])
    p_fix = 1 / (1 + np.exp(-m.fix.logits(rows)))
    p_harm = 1 / (1 + np.exp(-m.harm.logits(rows)))
    np.testing.assert_allclose(m.score(rows), p_fix - p_harm)  # the definition, by hand
    assert m.score(rows)[fixed == 1].mean() > m.score(rows)[fixed == 0].mean() + 0.3
    assert m.score(rows)[broken == 1].mean() < 0  # a read that would break the answer is not worth one
    path = save_read_checkpoint(tmp_path / "gain", {"all": m}, model=tiny, base="dtr", meta={})
    assert json.loads((path / "config.json").read_text())["score"] == "gain"
    back = load_read_checkpoint(path, "all", model=tiny, base="dtr")
    assert isinstance(back, GainModel)
    np.testing.assert_allclose(back.score(rows), m.score(rows))
    steps = ReadGate(back, threshold=0.05).decide(rows[:6])
    assert [s.retrieve for s in steps] == [bool(x >= 0.05) for x in m.score(rows[:6])]
    # a checkpoint from before the gain model (no "score") is log-odds: the gate's score is its logits
    old = save_read_checkpoint(tmp_path / "old", {"all": m.fix}, model=tiny, base="dtr", meta={})
    doc = json.loads((old / "config.json").read_text())
    del doc["score"]
    (old / "config.json").write_text(json.dumps(doc))
    back_old = load_read_checkpoint(old, "all", model=tiny, base="dtr")
    assert isinstance(back_old, ReadModel)
    np.testing.assert_allclose(back_old.score(rows), m.fix.logits(rows))
    with pytest.raises(InputError, match="all of one kind"):
        save_read_checkpoint(tmp_path / "mixed", {"all": m, "dense": m.fix}, model=tiny, base="dtr", meta={})
    doc["score"] = "odds"
    (old / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="unknown score 'odds'"):
        load_read_checkpoint(old, "all", model=tiny, base="dtr")
    with pytest.raises(CheckpointError, match="different features"):
        GainModel(m.fix, fit_read_model(rows, fixed, FEATURE_SETS["dense"]))


def test_fitting_refuses_features_that_are_not_finite_and_a_negative_penalty():
    from fastgate.gates.read import fit_read_model

    rows = [{"a": float(i), "b": 1.0} for i in range(20)]
    labels = [i % 2 for i in range(20)]
    assert fit_read_model(rows, labels, ("a", "b")).weights[0] != 0.0
    rows[3]["b"] = math.nan  # one NaN made every weight NaN: a gate that never reads
    rows[5]["b"] = math.inf
    with pytest.raises(InputError, match="feature b is not a finite number in 2 of 20 rows"):
        fit_read_model(rows, labels, ("a", "b"))
    with pytest.raises(InputError, match="L2 penalty"):
        fit_read_model(rows[:3], labels[:3], ("a",), l2=-50.0)


def test_choose_price_is_the_highest_price_within_the_loss_on_every_set():
    from fastgate.train.read import choose_price, price_meets, price_table

    # set a: reading fixes questions 0-1 (scored high) and breaks question 2; set b: reading fixes question 4 only
    scores = np.array([0.9, 0.8, 0.1, 0.0, 0.5, 0.2, 0.05, -0.3])
    cb = np.array([0, 0, 1, 0, 0, 0, 0, 0], dtype=float)
    rd = np.array([1, 1, 0, 0, 1, 0, 0, 0], dtype=float)
    groups = np.array(["a"] * 4 + ["b"] * 4)
    price = choose_price(scores, cb, rd, groups, max_loss=0.0)
    assert price == pytest.approx((0.5 + 0.2) / 2)  # set b needs its one fix read: the price falls below 0.5
    table = {r["data"]: r for r in price_table(scores, cb, rd, groups, price)}
    assert table["a"]["reads"] == 0.5 and table["a"]["acc"] == 0.75 and table["a"]["loss"] == -0.25  # above always
    assert table["b"]["reads"] == 0.25 and table["b"]["acc"] == 0.25 and table["b"]["never"] == 0.0
    assert choose_price(scores, cb, rd, groups, max_loss=0.2) == pytest.approx((0.5 + 0.2) / 2)
    assert choose_price(scores, cb, rd, groups, max_loss=0.25) > 0.9  # a quarter point each: reading nothing holds
    # nothing holds: the price whose worst set loses least, said so (it read everything, breaking 2 of set a's 10
    # answers, 20 points, to fix 1 of set b's 100 scored below them)
    scores = np.concatenate([np.arange(10.0, 20.0), [5.0], np.linspace(0.0, 4.0, 99)])
    groups = np.array(["a"] * 10 + ["b"] * 100)
    cb = np.array([1.0, 1.0] + [0.0] * 108)
    rd = np.array([0.0] * 10 + [1.0] + [0.0] * 99)
    price = choose_price(scores, cb, rd, groups, max_loss=0.0)
    assert price > 19.0 and not price_meets(scores, cb, rd, groups, price, 0.0)  # reads nothing: b loses 1 point
    assert price_meets(scores, cb, rd, groups, price, 0.01)


def _checkpoint(tmp_path, tiny, weight: float) -> str:
    """A checkpoint whose log-odds are ``weight`` × (standardised) BM25 top score."""
    feats = FEATURE_SETS["all"]
    from fastgate.gates.read import ReadModel

    m = ReadModel(feats, tuple(0.0 for _ in feats), tuple(1.0 for _ in feats),
                  tuple(weight if f == "bm25_top" else 0.0 for f in feats), 0.0)
    d = FEATURE_SETS["dense"]
    md = ReadModel(d, tuple(0.0 for _ in d), tuple(1.0 for _ in d), tuple(0.0 for _ in d), 1.0)
    return str(save_read_checkpoint(tmp_path / f"ck{weight}", {"all": m, "dense": md}, model=tiny, base="dtr",
                                    meta={}))


def test_read_method_follows_its_gate_not_the_base(tmp_path, tiny, tiny_engine, retrievers):
    bm25 = retrievers["bm25"]
    closed = build_method("never", tiny_engine).answer_batch(QUESTIONS)
    always = build_method("always", tiny_engine, bm25).answer_batch(QUESTIONS)
    # weight 1, threshold -1e9: reads everything, whatever DTR's tau says; answers equal `always`'s
    ck = _checkpoint(tmp_path, tiny, 1.0)
    reads = build_method("read", tiny_engine, bm25, {"checkpoint": ck, "threshold": -1e9},
                         retrievers=retrievers).answer_batch(QUESTIONS)
    assert [r.answer for r in reads] == [r.answer for r in always]
    assert all(r.retrieved and r.retrieval_calls == 2 for r in reads)
    assert [r.gate_steps[0].gate for r in reads] == ["read"] * 4  # the base's score is not a recorded decision
    # threshold +1e9: keeps every closed-book answer, still searched (features), never read
    skips = build_method("read", tiny_engine, bm25, {"checkpoint": ck, "threshold": 1e9},
                         retrievers=retrievers).answer_batch(QUESTIONS)
    assert [r.answer for r in skips] == [r.answer for r in closed]
    assert not any(r.retrieved for r in skips) and all(r.passages == [] for r in skips)
    d = skips[0].details
    assert d["closed_book_answer"] == closed[0].answer and set(FEATURE_SETS["all"]) <= set(d["features"])
    dtr = build_method("dtr", tiny_engine, bm25, {"tau": 0}).answer_batch(QUESTIONS)
    assert [r.details["base_score"] for r in skips] == pytest.approx([r.gate_steps[0].score for r in dtr])
    # the decision follows the score: read exactly where the BM25 top score >= threshold
    thr = float(np.median([r.details["features"]["bm25_top"] for r in skips]))
    mid = build_method("read", tiny_engine, bm25, {"checkpoint": ck, "threshold": thr},
                       retrievers=retrievers).answer_batch(QUESTIONS)
    assert [r.retrieved for r in mid] == [r.details["features"]["bm25_top"] >= thr for r in mid]
    json.dumps([r.to_dict() for r in mid])  # records stay JSON


def test_read_dense_features_skip_the_bm25_search_for_features(tmp_path, tiny, tiny_engine, retrievers):
    ck = _checkpoint(tmp_path, tiny, 1.0)
    res = build_method("read", tiny_engine, retrievers["bm25"], {"checkpoint": ck, "features": "dense"},
                       retrievers=retrievers).answer_batch(QUESTIONS)
    assert all(r.retrieval_calls == 1 for r in res)  # dense only for the features; bias 1: reads dense hits
    assert all(r.retrieved for r in res)


def test_read_collect_reads_everything_without_a_checkpoint(tiny_engine, retrievers):
    res = build_method("read", tiny_engine, retrievers["bm25"], {"collect": True},
                       retrievers=retrievers).answer_batch(QUESTIONS[:2])
    assert all(r.retrieved and r.details["read"] for r in res)
    assert all("closed_book_answer" in r.details for r in res)


def test_read_refuses_bad_configs(tiny_engine, retrievers, tmp_path):
    with pytest.raises(InputError, match="base must be one of"):
        build_method("read", tiny_engine, retrievers["bm25"], {"base": "never"}, retrievers=retrievers)
    with pytest.raises(InputError, match="features must be one of"):
        build_method("read", tiny_engine, retrievers["bm25"], {"features": "bm25"}, retrievers=retrievers)
    with pytest.raises(CheckpointError, match="fastgate train read"):
        build_method("read", tiny_engine, retrievers["bm25"], {}, retrievers=retrievers)
    with pytest.raises(CheckpointError):
        build_method("read", tiny_engine, retrievers["bm25"], {"checkpoint": str(tmp_path / "none")},
                     retrievers=retrievers)


@pytest.mark.parametrize("base", ["flare", "scaar"])
def test_read_wraps_other_gated_methods(tiny_engine, retrievers, base):
    res = build_method("read", tiny_engine, retrievers["bm25"], {"collect": True, "base": base},
                       retrievers=retrievers).answer_batch(QUESTIONS[:2])
    for r in res:
        assert r.details["base"] == base and r.details["base_score"] is not None
        assert math.isfinite(r.details["features"]["base_score"]) and r.retrieved
        assert r.lm_calls >= 3  # the base's CoT sentence, the closed-book answer, the answer from the passages


# ---------------------------------------------------------------------------------------------------- train read
TRAIN_QA = [("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "Shakespeare"),
            ("What is the capital of Kyrgyzstan?", "Bishkek"), ("What is the largest planet?", "Jupiter"),
            ("When was the Eiffel Tower completed?", "1889"), ("What is the capital of Germany?", "Berlin")] * 2


def _train_setup(monkeypatch, tmp_path, tiny) -> list[tuple[str, str]]:
    """`fastgate train read` on the tiny model under a fresh $FASTGATE_HOME; returns the training questions."""
    import fastgate.assets.models

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    return list(TRAIN_QA)


def _qa_file(path, pairs, prefix: str = "q"):
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "question": q, "answers": [a]}) + "\n"
                            for i, (q, a) in enumerate(pairs)))
    return path


def test_train_read_cli_collects_fits_and_resumes(monkeypatch, tmp_path, tiny, small_index, capsys):
    from fastgate.entrypoints.cli import main

    qa = _train_setup(monkeypatch, tmp_path, tiny)
    data = _qa_file(tmp_path / "qa.jsonl", qa)
    argv = ["train", "read", "--model", "tiny", "--data", str(data), "--n", "12", "--index", str(small_index),
            "--cache", str(tmp_path / "pass"), "--out", str(tmp_path / "ck"), "--quiet", "--batch-size", "4"]
    from fastgate.train import read as train_read

    # the tiny model answers nothing right: label every question "fixed" by hand so the fit has two classes
    real = train_read.collect_rows

    def labelled(records):
        rows, fixed, cb, rd = real(records)
        return rows, np.arange(len(rows)) % 2, cb, rd

    monkeypatch.setattr(train_read, "collect_rows", labelled)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "12 questions" in out and "out-of-fold" in out and "checkpoint:" in out
    for features in ("all", "dense"):
        m = load_read_checkpoint(tmp_path / "ck", features, model=tiny, base="dtr")
        assert m.features == FEATURE_SETS[features]
    recs = (tmp_path / "pass" / "results.jsonl").read_text().splitlines()
    assert len(recs) == 12 and all(json.loads(r)["details"]["read"] for r in recs)
    assert {json.loads(r)["retriever"] for r in recs} == {"bm25"}
    # the dense-only gate's labels come from reading dense passages (its own pass), as it reads them when it runs
    dense = [json.loads(r) for r in (tmp_path / "pass-dense-reads" / "results.jsonl").read_text().splitlines()]
    assert len(dense) == 12 and {r["retriever"] for r in dense} == {"dense"}
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["labels_from_reads"] == {"all": "bm25",
                                                                                             "dense": "dense"}
    assert main(argv) == 0  # resumed: nothing recomputed
    assert len((tmp_path / "pass" / "results.jsonl").read_text().splitlines()) == 12
    # the numeric form is a flag here as in eval (a store's refusal to resume names it): it reaches the model's load
    import fastgate.assets.models

    asked = []
    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: asked.append(kw) or tiny)
    assert main(argv + ["--weights", "float", "--dtype", "float32"]) == 0
    assert asked and asked[-1]["weights"] == "float" and asked[-1]["dtype"] == "float32"
    assert len((tmp_path / "pass-dense-reads" / "results.jsonl").read_text().splitlines()) == 12
    # without --out the checkpoint goes under $FASTGATE_HOME, never relative to the working directory
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main([a for a in argv if a not in ("--out", str(tmp_path / "ck"))]) == 0
    assert f"checkpoint: {tmp_path / 'home' / 'checkpoints' / 'tiny-read-dtr'}" in capsys.readouterr().out
    assert load_read_checkpoint(tmp_path / "home" / "checkpoints" / "tiny-read-dtr", "all", model=tiny, base="dtr")
    assert list(cwd.iterdir()) == []
    # a model given as a directory: the pass goes under $FASTGATE_HOME by the model's name, not beside the model
    model_dir = tmp_path / "models" / "my-tiny"
    plain = [a for a in argv if a not in ("--cache", str(tmp_path / "pass"))]
    assert main([*plain[:3], str(model_dir), *plain[4:]]) == 0
    assert not (tmp_path / "models").exists()
    assert sorted(p.name for p in (tmp_path / "home" / "features").iterdir())[0].startswith("tiny-read-dtr-")


def test_train_read_pools_dev_sets_and_writes_its_price_as_the_checkpoints_calibration(monkeypatch, tmp_path, tiny,
                                                                                       small_index, capsys):
    from fastgate.entrypoints.cli import main
    from fastgate.gates.read import GainModel
    from fastgate.methods.calibration import calibrated_params
    from fastgate.train import read as train_read

    qa = _train_setup(monkeypatch, tmp_path, tiny)
    files = [_qa_file(tmp_path / "one.jsonl", qa, "one"), _qa_file(tmp_path / "two.jsonl", qa[::-1], "two")]
    real = train_read.collect_rows

    def labelled(records):  # the tiny model answers nothing right: fixes and a break by hand
        rows, fixed, cb, rd = real(records)
        fixed = np.arange(len(rows)) % 2
        cb = np.zeros(len(rows))
        cb[2] = 1.0  # closed-book right, read wrong: a break
        return rows, fixed, cb, fixed.astype(float)

    monkeypatch.setattr(train_read, "collect_rows", labelled)
    out = tmp_path / "ck"
    argv = ["train", "read", "--model", "tiny", "--data", f"{files[0]},{files[1]}", "--n", "12,10", "--index",
            str(small_index), "--cache", str(tmp_path / "pass"), "--out", str(out), "--quiet", "--batch-size", "4",
            "--features", "all"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "price of a read" in text and "learning curve" in text and "out-of-fold" in text
    stores = sorted(p.parent.name for p in (tmp_path / "pass").glob("*/results.jsonl"))
    assert len(stores) == 2 and all(name.endswith(".jsonl") for name in stores)  # one store per set, inside --cache
    doc = json.loads((out / "config.json").read_text())
    assert doc["score"] == "gain" and doc["n"] == 22 and [s["n"] for s in doc["sets"]] == [12, 10]
    assert [s["broken"] for s in doc["sets"]] == [1, 1] and doc["fixed"] == 6 + 5
    training = json.loads((out / "training.json").read_text())
    price = training["report"]["all"]["price"]
    assert training["command"].startswith("fastgate train read --model tiny --decide answer --base dtr --data ")
    # the recorded command makes it again: from the same store, into the same directory (it left --cache, --out and
    # --index out, answering everything again elsewhere)
    import shlex

    again = shlex.split(training["command"])[1:]
    assert {"--cache", "--out", "--index", "--batch-size"} <= set(again)
    assert main(again) == 0
    assert json.loads((out / "training.json").read_text())["report"]["all"]["price"] == price
    assert [r["n"] for r in training["report"]["all"]["out_of_fold"]] == [12, 10]
    assert training["report"]["all"]["learning_curve"][-1]["train"] == 22 - 3 - 2  # a fifth of each set held out
    assert isinstance(load_read_checkpoint(out, "all", model=tiny, base="dtr"), GainModel)
    # the price is this checkpoint's calibration: used for it, and for no other checkpoint
    assert calibrated_params("tiny", "read", {"checkpoint": str(out)})["threshold"] == pytest.approx(price)
    with pytest.raises(InputError, match="no calibrated threshold"):
        calibrated_params("tiny", "read", {"checkpoint": str(tmp_path / "elsewhere")})
    capsys.readouterr()
    assert main(argv[:5] + [f"{files[0]},{files[1]},capitals", "--n", "1,2"] + argv[8:]) == 2
    assert "--n gives 2 counts for 3 dev sets" in capsys.readouterr().err
    assert main(["train", "read", "--model", "tiny", "--data", f"{files[0]},nq:test"]) == 2
    assert "refuses" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- decide=prefill
def _projection(tiny, rank: int = 3):
    from fastgate.gates.read import StateProjection

    rng = np.random.default_rng(1)
    comps = np.linalg.qr(rng.normal(size=(tiny.hidden_size, rank)))[0].T  # [rank, d], orthonormal rows
    return StateProjection(tiny.n_layers // 2, tuple(rng.normal(size=tiny.hidden_size).tolist()),
                           tuple(tuple(c) for c in comps.tolist()))


def _prefill_checkpoint(tmp_path, tiny, weight: float = 1.0, name: str = "pf") -> str:
    """A prefill checkpoint whose log-odds are ``weight`` × BM25 top score (its state weights 0)."""
    from fastgate.gates.read import ReadModel, prefill_feature_names

    proj = _projection(tiny)
    models = {}
    for fs in ("all", "dense"):
        names = prefill_feature_names(fs, proj.rank)
        models[fs] = ReadModel(names, tuple(0.0 for _ in names), tuple(1.0 for _ in names),
                               tuple(weight if f == "bm25_top" else 0.0 for f in names), 0.0 if fs == "all" else 1.0)
    return str(save_read_checkpoint(tmp_path / name, models, model=tiny, base=None, meta={}, decide="prefill",
                                    projection=proj))


def test_prefill_features_by_hand(tiny):
    from fastgate.gates.read import PREFILL_SEARCH_FEATURES, StateProjection, prefill_feature_names, prefill_features

    proj = StateProjection(2, (1.0, 0.0, -1.0), ((1.0, 0.0, 0.0), (0.0, 0.6, 0.8)))
    bm = [_hit("a", "Paris", "Paris is the capital of France.", 9.0), _hit("b", "Berlin", "Berlin.", 4.0)]
    dn = [_hit("b", "Berlin", "Berlin.", 0.5), _hit("c", "Rome", "Rome.", 0.25)]
    import torch

    f = prefill_features("What is the capital of France?", torch.tensor([3.0, 1.0, 1.0]), proj, bm, dn)
    # state - mean = (2, 1, 2): (1,0,0)·=2; (0,.6,.8)·=0.6+1.6=2.2
    assert f["state_0"] == pytest.approx(2.0) and f["state_1"] == pytest.approx(2.2)
    assert f["bm25_top"] == 9.0 and f["bm25_drop"] == 5.0 and f["bm25_cover"] == 1.0
    assert f["dense_top"] == 0.5 and f["dense_drop"] == 0.25 and f["dense_cover"] == 0.0
    assert f["agree"] == 0.5 and f["q_words"] == pytest.approx(math.log1p(6))
    # nothing that needs the closed-book answer; the names are the checkpoint's, in order
    assert set(f) == set(prefill_feature_names("all", 2))
    assert prefill_feature_names("dense", 2) == ("state_0", "state_1", "q_words", "dense_top", "dense_drop",
                                                 "dense_cover")
    assert not any(k.startswith("bm25") for k in PREFILL_SEARCH_FEATURES["dense"])
    # the search features are the answer mode's own, so one training pass serves both modes
    full = read_features("What is the capital of France?", _gen("Paris", [-0.5]), 1.0, bm, dn)
    assert all(f[k] == full[k] for k in PREFILL_SEARCH_FEATURES["all"])
    with pytest.raises(InputError, match="4-d state"):
        proj.project(np.zeros(4))


def test_state_projection_is_the_top_principal_components():
    from fastgate.gates.read import fit_state_projection

    rng = np.random.default_rng(0)
    direction = np.array([3.0, 4.0, 0.0, 0.0]) / 5.0
    x = rng.normal(size=(200, 1)) * 10.0 * direction + rng.normal(size=(200, 4)) * 0.1 + 7.0
    p = fit_state_projection(x, layer=1, rank=2)
    assert p.rank == 2 and p.layer == 1 and p.dim == 4
    np.testing.assert_allclose(np.asarray(p.components[0]), direction, atol=0.02)  # sign fixed: largest entry > 0
    np.testing.assert_allclose(np.asarray(p.mean), x.mean(0))
    np.testing.assert_allclose(p.project(x[:3]), (x[:3] - x.mean(0)) @ np.asarray(p.components).T)


def test_prefill_checkpoint_refuses_the_other_mode_and_other_models(tmp_path, tiny):
    from fastgate.gates.read import load_prefill_checkpoint

    path = _prefill_checkpoint(tmp_path, tiny)
    m, proj = load_prefill_checkpoint(path, "all", model=tiny)
    assert m.features[:3] == ("state_0", "state_1", "state_2") and proj == _projection(tiny)
    doc = json.loads((tmp_path / "pf" / "config.json").read_text())
    assert doc["decide"] == "prefill" and doc["base"] is None
    with pytest.raises(CheckpointError, match="made for decide=prefill, not decide=answer"):
        load_read_checkpoint(path, "all", model=tiny, base="dtr")
    answer = _checkpoint(tmp_path, tiny, 1.0)
    with pytest.raises(CheckpointError, match="made for decide=answer, not decide=prefill"):
        load_prefill_checkpoint(answer, "all", model=tiny)
    other = type("M", (), {"name": "other-model", "fingerprint": "", "hidden_size": 64, "n_layers": 4})()
    with pytest.raises(CheckpointError, match="trained for model"):
        load_prefill_checkpoint(path, "all", model=other)
    wide = type("M", (), {"name": "tiny", "fingerprint": "", "hidden_size": 128, "n_layers": 4})()
    with pytest.raises(CheckpointError, match="projects 64-d states"):
        load_prefill_checkpoint(path, "all", model=wide)
    with pytest.raises(InputError, match="state projection"):
        save_read_checkpoint(tmp_path / "x", {}, model=tiny, base=None, meta={}, decide="prefill")


def _recording(method):
    """Record every request ``method``'s programs yield (an All's parts flattened, tagged with its position)."""
    seen: dict[str, list] = {}
    program = method.program

    def rec(question):
        log = seen.setdefault(question, [])
        gen, out = program(question), None
        try:
            while True:
                req = gen.send(out)
                log.append(req)
                out = yield req
        except StopIteration as stop:
            return stop.value

    method.program = rec
    return seen


def _kinds(reqs) -> list:
    from fastgate.programs import All

    return [tuple(type(r).__name__ for r in req.requests) if isinstance(req, All) else type(req).__name__
            for req in reqs]


def test_prefill_skip_and_read_request_sequences_and_costs(tmp_path, tiny, tiny_engine, retrievers):
    from fastgate.prompts import closed_book_prompt

    bm25 = retrievers["bm25"]
    ck = _prefill_checkpoint(tmp_path, tiny)
    never = build_method("never", tiny_engine).answer_batch(QUESTIONS)
    always = build_method("always", tiny_engine, bm25).answer_batch(QUESTIONS)
    answer_ck = _checkpoint(tmp_path, tiny, 1.0)

    # skip everything: PromptStates and both searches in one fan-out, the decision, ONE closed-book generation
    skip = build_method("read", tiny_engine, bm25, {"decide": "prefill", "checkpoint": ck, "threshold": 1e9},
                        retrievers=retrievers)
    seen = _recording(skip)
    hits0 = tiny_engine.prefix_hits
    res = skip.answer_batch(QUESTIONS)
    assert all(_kinds(seen[q]) == [("PromptStates", "Search", "Search"), "Decide", "Generate"] for q in QUESTIONS)
    gen = seen[QUESTIONS[0]][-1]
    assert gen.prompt == closed_book_prompt(QUESTIONS[0]) and gen.answer and gen.k == 1
    # the prefill and the generation both start from the cached few-shot block: the prompt is not prefilled twice
    assert tiny_engine.prefix_hits - hits0 == 2 * len(QUESTIONS)
    assert [r.answer for r in res] == [r.answer for r in never]
    for r, n in zip(res, never):
        assert not r.retrieved and r.passages == [] and r.retrieval_calls == 2 and r.lm_calls == 2
        assert r.generated_tokens == n.generated_tokens  # one closed-book answer, nothing else generated
        assert r.prompt_tokens == 2 * n.prompt_tokens  # the states' prefill counts the prompt as sent, too
        assert r.details["closed_book_answer"] == n.answer and r.details["decide"] == "prefill"
        assert [s.gate for s in r.gate_steps] == ["read"] and not r.gate_steps[0].retrieve

    # read everything: no closed-book generation at all; the answer is always's
    read = build_method("read", tiny_engine, bm25, {"decide": "prefill", "checkpoint": ck, "threshold": -1e9},
                        retrievers=retrievers)
    seen = _recording(read)
    res = read.answer_batch(QUESTIONS)
    assert all(_kinds(seen[q]) == [("PromptStates", "Search", "Search"), "Decide", "Generate"] for q in QUESTIONS)
    assert all(seen[q][-1].prompt != closed_book_prompt(q) for q in QUESTIONS)
    today = build_method("read", tiny_engine, bm25, {"checkpoint": answer_ck, "threshold": -1e9},
                         retrievers=retrievers).answer_batch(QUESTIONS)
    assert [r.answer for r in res] == [r.answer for r in always] == [r.answer for r in today]
    for r, a, n, t in zip(res, always, never, today):
        assert r.retrieved and r.lm_calls == 2 and r.retrieval_calls == 2 and "closed_book_answer" not in r.details
        assert r.generated_tokens == a.generated_tokens  # only the answer from the passages
        assert t.generated_tokens == a.generated_tokens + n.generated_tokens  # today's read also generated closed-book
        assert r.prompt_tokens == a.prompt_tokens + n.prompt_tokens == t.prompt_tokens
    json.dumps([r.to_dict() for r in res])


def test_prefill_features_in_the_record_match_a_hand_computed_reference(tmp_path, tiny, tiny_engine, retrievers):
    from fastgate.prompts import closed_book_prompt

    ck = _prefill_checkpoint(tmp_path, tiny)
    proj = _projection(tiny)
    bm25, dense = retrievers["bm25"], retrievers["dense"]
    m = build_method("read", tiny_engine, bm25, {"decide": "prefill", "checkpoint": ck, "threshold": 1e9},
                     retrievers=retrievers)
    res = m.answer_batch(QUESTIONS)
    states = tiny_engine.prompt_states([closed_book_prompt(q) for q in QUESTIONS], proj.layer).double().numpy()
    ref = (states - np.asarray(proj.mean)) @ np.asarray(proj.components).T  # [4, rank]
    for q, r, z in zip(QUESTIONS, res, ref):
        f = r.details["features"]
        np.testing.assert_allclose([f[f"state_{i}"] for i in range(proj.rank)], z, rtol=1e-4, atol=1e-4)
        b, d = bm25.search(q, 3), dense.search(q, 3)
        assert f["bm25_top"] == pytest.approx(b[0].score) and f["dense_top"] == pytest.approx(d[0].score)
        assert f["bm25_drop"] == pytest.approx(b[0].score - b[-1].score)
        assert r.gate_steps[0].score == pytest.approx(f["bm25_top"])  # weight 1 on bm25_top, bias 0, std 1
    # the decision follows the score: read exactly where the BM25 top score >= threshold
    thr = float(np.median([r.details["features"]["bm25_top"] for r in res]))
    mid = build_method("read", tiny_engine, bm25, {"decide": "prefill", "checkpoint": ck, "threshold": thr},
                       retrievers=retrievers).answer_batch(QUESTIONS)
    assert [r.retrieved for r in mid] == [r.details["features"]["bm25_top"] >= thr for r in mid]
    assert 0 < sum(r.retrieved for r in mid) < len(QUESTIONS)


def test_prefill_dense_features_search_dense_only(tmp_path, tiny, tiny_engine, retrievers):
    ck = _prefill_checkpoint(tmp_path, tiny)
    res = build_method("read", tiny_engine, retrievers["bm25"], {"decide": "prefill", "checkpoint": ck,
                                                                 "features": "dense", "threshold": 0.0},
                       retrievers=retrievers).answer_batch(QUESTIONS[:2])
    assert all(r.retrieval_calls == 1 and r.retrieved for r in res)  # bias 1: reads dense hits
    assert res[0].details["features"]["bm25_top"] == 0.0  # not searched: 0, as in the answer mode
    assert [h.id for h in res[0].passages] == [h.id for h in retrievers["dense"].search(QUESTIONS[0], 3)]


def test_prefill_refuses_bad_configs(tmp_path, tiny, tiny_engine, retrievers):
    with pytest.raises(InputError, match="decide must be one of"):
        build_method("read", tiny_engine, retrievers["bm25"], {"decide": "early"}, retrievers=retrievers)
    with pytest.raises(InputError, match="collect=true"):
        build_method("read", tiny_engine, retrievers["bm25"], {"decide": "prefill", "collect": True},
                     retrievers=retrievers)
    with pytest.raises(CheckpointError, match="--decide prefill"):
        build_method("read", tiny_engine, retrievers["bm25"], {"decide": "prefill", "threshold": 0.0},
                     retrievers=retrievers)
    with pytest.raises(CheckpointError, match="made for decide=answer"):
        build_method("read", tiny_engine, retrievers["bm25"], {"decide": "prefill", "threshold": 0.0,
                                                               "checkpoint": _checkpoint(tmp_path, tiny, 1.0)},
                     retrievers=retrievers)
    with pytest.raises(CheckpointError, match="made for decide=prefill"):
        build_method("read", tiny_engine, retrievers["bm25"], {"threshold": 0.0,
                                                               "checkpoint": _prefill_checkpoint(tmp_path, tiny)},
                     retrievers=retrievers)


def test_train_read_prefill_reuses_the_pass_and_writes_a_checkpoint_that_loads(monkeypatch, tmp_path, tiny,
                                                                              small_index, capsys):
    from fastgate.entrypoints.cli import main
    from fastgate.gates.read import ShiftGainModel, load_prefill_checkpoint, prefill_feature_names
    from fastgate.train import read as train_read

    qa = _train_setup(monkeypatch, tmp_path, tiny)
    data = _qa_file(tmp_path / "qa.jsonl", qa)
    real = train_read.collect_rows

    def labelled(records):  # the tiny model answers nothing right: two classes by hand
        rows, fixed, cb, rd = real(records)
        return rows, np.arange(len(rows)) % 2, cb, rd

    monkeypatch.setattr(train_read, "collect_rows", labelled)
    # both kinds of question, so that the shift-gain model (the default --adapt) is fitted, in both modes
    monkeypatch.setattr(train_read, "answerable_labels", lambda records, hits: np.arange(len(hits)) // 2 % 2)
    common = ["train", "read", "--model", "tiny", "--data", str(data), "--n", "12", "--index", str(small_index),
              "--cache", str(tmp_path / "pass"), "--quiet", "--batch-size", "4", "--features", "all"]
    assert main(common + ["--out", str(tmp_path / "answer")]) == 0  # today's gate: the pass runs once
    before = (tmp_path / "pass" / "results.jsonl").read_text()
    capsys.readouterr()
    assert main(common + ["--decide", "prefill", "--rank", "4"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "pass" / "results.jsonl").read_text() == before  # the same records: nothing answered again
    default = tmp_path / "home" / "checkpoints" / "tiny-read-prefill"
    assert f"checkpoint: {default}" in out and "--param decide=prefill" in out and "out-of-fold" in out
    m, proj = load_prefill_checkpoint(default, "all", model=tiny)
    assert proj.rank == 4 and proj.layer == tiny.n_layers // 2 and proj.dim == tiny.hidden_size
    assert m.features == prefill_feature_names("all", 4) and "bm25_new_names" in m.features  # passage features too
    doc = json.loads((default / "config.json").read_text())
    assert doc["decide"] == "prefill" and doc["base"] is None and doc["n"] == 12 and doc["layer"] == proj.layer
    assert doc["score"] == "shift-gain" and isinstance(m, ShiftGainModel)
    # the projection is of these questions' pre-answer states: they project to mean zero
    from fastgate.engine.local import Engine
    from fastgate.prompts import closed_book_prompt

    states = Engine(tiny).prompt_states([closed_book_prompt(q) for q, _ in qa], proj.layer)
    np.testing.assert_allclose(proj.project(states).mean(0), 0.0, atol=1e-4)
    # the other mode's checkpoint is refused by each loader
    with pytest.raises(CheckpointError, match="made for decide=prefill"):
        load_read_checkpoint(default, "all", model=tiny, base="dtr")
    with pytest.raises(CheckpointError, match="made for decide=answer"):
        load_prefill_checkpoint(tmp_path / "answer", "all", model=tiny)


def test_a_training_pass_resumes_across_a_new_threshold_and_a_gated_run_does_not(tmp_path):
    from fastgate.eval.runner import ResultsStore, RunSpec, _check_params
    from fastgate.methods import make_config
    from fastgate.methods.read import Read

    store = ResultsStore(tmp_path / "results.jsonl")
    collect = make_config("read", {"collect": True, "threshold": 0.5})
    gated = make_config("read", {"threshold": 0.5})
    assert Read.inert_parameters(collect) == {"threshold", "checkpoint"} and not Read.inert_parameters(gated)
    for key, cfg in (("read[collect=True]", collect), ("read", gated)):
        store.append([{"run": key, "id": "q1", "params": {"threshold": -3.0, "collect": cfg.collect}}])
    now = {"threshold": 0.5}
    _check_params(store, RunSpec("read", "bm25", (("collect", True),)), {**now, "collect": True},
                  Read.inert_parameters(collect))  # the pass reads every question: its threshold is never used
    with pytest.raises(InputError, match="threshold=-3.0, but this run would use threshold=0.5"):
        _check_params(store, RunSpec("read", "bm25", ()), {**now, "collect": False}, Read.inert_parameters(gated))


def test_passage_features_by_hand():
    from fastgate.gates.read import BM25_PASSAGE_FEATURES, passage_features

    hits = [_hit("a", "Eiffel Tower", "The Eiffel Tower was finished in 1889. Gustave Eiffel built it in Paris.", 9.0),
            _hit("b", "Paris", "Paris has many towers.", 4.0)]
    f = passage_features("When was the Eiffel Tower finished?", hits, "bm25")
    assert set(f) == set(BM25_PASSAGE_FEATURES)
    assert f["bm25_title_in_q"] == 1.0  # "eiffel tower": both title words in the question
    assert f["bm25_cover_all"] == 1.0  # eiffel, tower, finished all in the passages
    assert f["bm25_sent_cover"] == 1.0  # ... and all in "The Eiffel Tower was finished in 1889."
    assert f["q_typed"] == 1.0 and f["bm25_type_match"] == 1.0  # a "when" question, a year in that sentence
    assert f["bm25_new_names"] == pytest.approx(math.log1p(1))  # "The": capitalised, not in the question
    assert f["bm25_top_names"] == pytest.approx(math.log1p(3))  # the top passage adds The, Gustave, Paris
    b = passage_features("When was the Eiffel Tower built?", hits, "bm25")  # 2 of 3 words in each sentence
    assert b["bm25_sent_cover"] == pytest.approx(2 / 3) and b["bm25_type_match"] == 0.0  # the first: the title's
    g = passage_features("How many moons has Mars?", hits, "bm25")
    assert g["q_typed"] == 1.0 and g["bm25_type_match"] == 0.0 and g["bm25_title_in_q"] == 0.0
    none = passage_features("Who wrote Hamlet?", [], "bm25")
    assert all(v == 0.0 for v in none.values())
    # read_features carries them for the BM25 hits
    r = read_features("When was the Eiffel Tower finished?", _gen("1889", [-0.1]), 0.1, hits, None)
    assert {k: r[k] for k in f} == f


def _shift_data(n: int = 600, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = [{f: float(rng.normal()) for f in FEATURE_SETS["all"]} for _ in range(n)]
    answerable = np.array([int(r["bm25_top"] + 0.3 * rng.normal() > 0) for r in rows])
    fixed = np.array([int(a and r["cb_nll"] > -0.3) for r, a in zip(rows, answerable)])
    broken = np.array([int(not f and r["dense_top"] > 1.6) for r, f in zip(rows, fixed)])
    return rows, fixed, broken, answerable


def test_shift_gain_model_follows_the_answerable_share_of_the_questions_it_scores(tmp_path, tiny):
    from fastgate.gates.read import ShiftGainModel, fit_shift_gain_model, shift_posterior

    rows, fixed, broken, answerable = _shift_data()
    m = fit_shift_gain_model(rows, fixed, broken, answerable, FEATURE_SETS["all"], rate=0.05)
    assert m.prior == pytest.approx(answerable.mean())
    p, on, off = m.parts(rows)
    np.testing.assert_allclose(m.score(rows), p * on + (1 - p) * off)  # at the training share: the mix as fitted
    np.testing.assert_allclose(shift_posterior(p, m.prior, m.prior), p)
    assert (shift_posterior(p, m.prior, 0.1) < p).all()  # a lower share lowers every posterior
    # a stream of questions the corpus cannot answer: the gate's share estimate falls and fewer of them read
    stream = [r for r, a in zip(rows, answerable) if not a][:150] + [r for r, a in zip(rows, answerable) if a][:10]
    gate = ReadGate(m, threshold=0.1)
    fixed_share = m.score(stream) >= 0.1
    steps = gate.decide(stream)
    assert gate.share < 0.6 * m.prior  # 150 of 160 unanswerable: the estimate falls toward their share
    assert sum(s.retrieve for s in steps) < fixed_share.sum()
    # scored in order: a second gate fed the same stream in two batches decides the same
    other = ReadGate(m, threshold=0.1)
    first = other.decide(stream[:70])
    after_first = other.share
    assert [s.retrieve for s in first + other.decide(stream[70:])] == [s.retrieve for s in steps]
    # each step keeps the share of its own batch: a server's later requests move the gate's before a program resumes
    assert {s.share for s in first} == {after_first} and after_first != other.share
    assert steps[-1].share == gate.share
    assert "share" not in first[0].to_dict()  # the gate step's record is unchanged
    # the checkpoint keeps every part; the loaded gate starts again from the training share
    path = save_read_checkpoint(tmp_path / "shift", {"all": m}, model=tiny, base="dtr", meta={})
    assert json.loads((path / "config.json").read_text())["score"] == "shift-gain"
    back = load_read_checkpoint(path, "all", model=tiny, base="dtr")
    assert isinstance(back, ShiftGainModel) and back.rate == 0.05
    np.testing.assert_allclose(back.score(rows), m.score(rows))
    assert ReadGate(back, 0.1).share == pytest.approx(m.prior)
    doc = json.loads((path / "config.json").read_text())
    doc["models"]["all"]["prior"] = 1.5
    (path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="prior"):
        load_read_checkpoint(path, "all", model=tiny, base="dtr")
    with pytest.raises(InputError, match="both kinds"):
        fit_shift_gain_model(rows, fixed, broken, np.ones(len(rows), dtype=int), FEATURE_SETS["all"])


def test_cross_validated_shift_gains_adapt_within_each_set():
    from fastgate.train.read import cross_validated_gains, cross_validated_shift_gains

    rows, fixed, broken, answerable = _shift_data(800, seed=1)
    # two "sets": the first half as it is, the second only its unanswerable questions (a natural-like share)
    keep = np.r_[np.arange(400), 400 + np.flatnonzero(answerable[400:] == 0)]
    rows = [rows[i] for i in keep]
    fixed, broken, answerable = fixed[keep], broken[keep], answerable[keep]
    groups = np.array(["mixed"] * 400 + ["natural"] * (len(keep) - 400))
    plain = cross_validated_gains(rows, fixed, broken, FEATURE_SETS["all"], groups)
    shift = cross_validated_shift_gains(rows, fixed, broken, answerable, FEATURE_SETS["all"], groups, rate=0.05)
    assert np.isfinite(shift).all() and shift.shape == plain.shape
    nat = groups == "natural"
    assert shift[nat].mean() < plain[nat].mean()  # the natural-like set's gains fall as its share is learned
    assert abs(shift[~nat].mean() - plain[~nat].mean()) < 0.05  # the mixed set stays near its training share


def test_search_again_checks_the_records_passages_and_labels_answerable(retrievers):
    from fastgate.train.read import answerable_labels, backfill_passage_features, search_again

    bm25 = retrievers["bm25"]
    hits = bm25.search(QUESTIONS[0], 2)
    gold = hits[0].text.split()[0]
    rec = {"id": "q1", "question": QUESTIONS[0], "answers": [gold, "no such answer"],
           "passages": [{"id": h.id} for h in hits], "details": {"features": {"cb_nll": 1.0}}}
    other = {**rec, "id": "q2", "answers": ["zzzz qqqq"], "details": {"features": {"cb_nll": 1.0}}}
    found = search_again([rec, other], bm25)
    assert [[h.id for h in hs] for hs in found] == [[h.id for h in hits]] * 2
    assert answerable_labels([rec, other], found).tolist() == [1, 0]
    assert backfill_passage_features([rec, other], found) == 2 and "bm25_top_names" in rec["details"]["features"]
    assert backfill_passage_features([rec, other], found) == 0  # already there
    wrong = {**rec, "passages": [{"id": "not-a-passage"}]}
    with pytest.raises(InputError, match="another index"):
        search_again([wrong], bm25)


def test_read_method_over_a_shift_gain_checkpoint_records_the_gates_share(tmp_path, tiny, tiny_engine, retrievers):
    """A shift-gain checkpoint through the method: the gate's share estimate moves with the questions it scores and
    each record keeps it; the decisions follow the score against the price."""
    from fastgate.gates.read import GainModel, ReadModel, ShiftGainModel

    feats = FEATURE_SETS["all"]

    def flat(bias: float, w_top: float = 0.0) -> ReadModel:
        return ReadModel(feats, tuple(0.0 for _ in feats), tuple(1.0 for _ in feats),
                         tuple(w_top if f == "bm25_top" else 0.0 for f in feats), bias)

    m = ShiftGainModel(flat(-3.0, 0.1), GainModel(flat(2.0), flat(-5.0)), GainModel(flat(-6.0), flat(-6.0)),
                       prior=0.4, rate=0.1)
    ck = save_read_checkpoint(tmp_path / "shift", {"all": m}, model=tiny, base="dtr", meta={})
    method = build_method("read", tiny_engine, retrievers["bm25"], {"checkpoint": str(ck), "threshold": 0.3},
                          retrievers=retrievers)
    res = method.answer_batch(QUESTIONS)
    shares = [r.details["answerable_share"] for r in res]
    assert all(0.0 < s < 0.4 for s in shares)  # P(answerable) ~ 5% on every question: the estimate falls
    assert method.gate.share == pytest.approx(min(shares), abs=1e-4)  # the last batch of scores
    assert [r.retrieved for r in res] == [s.score >= 0.3 for r in res for s in r.gate_steps]


def test_a_non_finite_feature_or_weight_cannot_switch_reading_off(tmp_path, tiny):
    """One NaN feature moved a shift-gain gate's share to NaN (no question read again, on a server for every user);
    a NaN weight loaded and scored every question NaN; a renamed feature loaded and failed every question."""
    import json as _json

    from fastgate.gates.read import ReadModel, adapt_gains, load_read_checkpoint

    feats = ("bm25_top", "q_words")
    with pytest.raises(CheckpointError, match="finite"):
        ReadModel(feats, (0.0, 0.0), (1.0, 1.0), (math.nan, 0.0), 0.0)
    m = ReadModel(feats, (0.0, 0.0), (1.0, 1.0), (1.0, 0.0), 0.0)
    with pytest.raises(InputError, match="not a finite number: bm25_top"):
        m.score([{"bm25_top": math.nan, "q_words": 1.0}])
    gains, share = adapt_gains(np.array([math.nan, 0.9]), np.array([1.0, 1.0]), np.array([0.0, 0.0]), 0.3, 0.3, 0.5)
    assert share == share and share > 0.3  # the NaN row left it; the next moved it
    ck = Path(_checkpoint(tmp_path, tiny, 1.0))
    doc = _json.loads((ck / "config.json").read_text())
    doc["models"]["all"]["features"][0] = "cb_len"  # a feature this fastgate does not compute
    (ck / "config.json").write_text(_json.dumps(doc))
    with pytest.raises(CheckpointError, match="does not compute: cb_len"):
        load_read_checkpoint(ck, "all", model=tiny, base="dtr")


def test_the_shipped_checkpoint_by_its_path_and_prefill_find_the_right_price():
    from fastgate.gates.checkpoints import DEFAULT_CHECKPOINTS
    from fastgate.methods.calibration import calibrated_params

    shipped = DEFAULT_CHECKPOINTS / "smollm2-135m-read-dtr"
    price = calibrated_params("smollm2-135m", "read")["threshold"]
    assert calibrated_params("smollm2-135m", "read", {"checkpoint": str(shipped)})["threshold"] == price  # refused
    with pytest.raises(InputError, match="no calibrated threshold"):  # it got the answer mode's price
        calibrated_params("smollm2-135m", "read", {"decide": "prefill"})


def test_a_checkpoint_for_another_model_is_named_as_such_not_as_uncalibrated(tmp_path):
    from fastgate.gates.checkpoints import DEFAULT_CHECKPOINTS
    from fastgate.methods.calibration import calibrated_params

    foreign = _foreign(tmp_path, DEFAULT_CHECKPOINTS / "qwen2.5-0.5b-read-dtr")
    with pytest.raises(CheckpointError, match="trained for model qwen2.5-0.5b, not smollm2-135m"):  # not "calibrate"
        calibrated_params("smollm2-135m", "read", {"checkpoint": foreign})


def _foreign(tmp_path, shipped) -> str:
    """A copy of a shipped checkpoint outside the shipped folder (a user's checkpoint for another model)."""
    import shutil

    out = tmp_path / "foreign"
    shutil.copytree(shipped, out)
    return str(out)


def test_paper_defaults_leave_the_read_gate_its_checkpoints_price(tiny_engine, small_index):
    """--paper-defaults ran the read gate at threshold 0.0 without a word: it has no paper value."""
    from fastgate.serving.runtime import Runtime

    runtime = Runtime("tiny", index=str(small_index), engine=tiny_engine, paper_defaults=True)
    assert runtime.calibrated("dtr", {}) == {}  # the paper's tau
    with pytest.raises(InputError, match="no calibrated threshold for read"):  # tiny has no read checkpoint price
        runtime.calibrated("read", {})
    assert runtime.calibrated("read", {"threshold": 0.1}) == {"threshold": 0.1}


def test_a_server_builds_one_method_for_one_config(tiny_engine, small_index):
    from fastgate.serving.runtime import Runtime

    """{} and {"k": 3} are one config: two cached methods split a read gate's answerable-share estimate in two."""
    from fastgate.serving.service import AnswerService, ServiceConfig

    svc = AnswerService(ServiceConfig(method="dtr", params=(("tau", 0.0),), index=str(small_index)),
                        Runtime("tiny", index=str(small_index), engine=tiny_engine))
    a = svc._method(svc._request("never", {}))
    assert svc._method(svc._request("never", {"k": 3})) is a and svc._method(svc._request("never", {"k": 2})) is not a


def test_a_gate_searching_with_another_k_than_its_training_says_so(tmp_path, tiny, tiny_engine, retrievers, caplog):
    ck = _checkpoint(tmp_path, tiny, 1.0)  # no k recorded: the default's, 3
    with caplog.at_level("WARNING"):
        build_method("read", tiny_engine, retrievers["bm25"], {"checkpoint": ck, "threshold": 0.0},
                     retrievers=retrievers)
        assert "trained on searches of k=3" not in caplog.text
        build_method("read", tiny_engine, retrievers["bm25"], {"checkpoint": ck, "threshold": 0.0, "k": 10},
                     retrievers=retrievers)
    assert "trained on searches of k=3 passages; k=10" in caplog.text
    doc = json.loads((Path(ck) / "config.json").read_text())
    (Path(ck) / "config.json").write_text(json.dumps({**doc, "k": 2}))  # recorded: read with the gate, once
    with caplog.at_level("WARNING"):
        build_method("read", tiny_engine, retrievers["bm25"], {"checkpoint": ck, "threshold": 0.0},
                     retrievers=retrievers)
    assert "trained on searches of k=2 passages; k=3" in caplog.text


def _all_only_checkpoint(tmp_path, tiny) -> str:
    """A checkpoint with the full feature set only, as the shipped SmolLM2 gate (no ``dense`` model)."""
    from fastgate.gates.read import ReadModel

    feats = FEATURE_SETS["all"]
    m = ReadModel(feats, tuple(0.0 for _ in feats), tuple(1.0 for _ in feats), tuple(0.0 for _ in feats), 0.0)
    return str(save_read_checkpoint(tmp_path / "all-only", {"all": m}, model=tiny, base="dtr", meta={}))


def test_a_feature_set_the_checkpoint_lacks_is_named_before_the_missing_calibration(tmp_path, tiny, small_index,
                                                                                    monkeypatch, capsys):
    """`ask --method read --param features=dense` over a gate with only `all` said to run `fastgate calibrate ...
    --param features=dense`, which then failed on the checkpoint ("has no 'dense' model"): that comes first now."""
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main
    from fastgate.gates.checkpoints import default_checkpoint
    from fastgate.methods.calibration import calibrated_params

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    ck = _all_only_checkpoint(tmp_path, tiny)
    assert main(["ask", "--model", "tiny", "--index", str(small_index), "--method", "read", "--param",
                 f"checkpoint={ck}", "--param", "features=dense", "Hi?"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"read-gate checkpoint {ck} has no 'dense' model (has: all)" in err and "\n" not in err, err
    assert "fastgate calibrate" not in err and "--param features=all" in err
    with pytest.raises(CheckpointError, match="has no 'dense' model"):  # the library's lookup alike
        calibrated_params("tiny", "read", {"checkpoint": ck, "features": "dense"})
    with pytest.raises(InputError, match="no calibrated threshold"):  # the set it has: the calibration is missing
        calibrated_params("tiny", "read", {"checkpoint": ck})
    if default_checkpoint("smollm2-135m", "read-dtr-dense") is None:  # the reported case: the shipped gate
        with pytest.raises(CheckpointError, match="smollm2-135m-read-dtr has no 'dense' model"):
            calibrated_params("smollm2-135m", "read", {"features": "dense"})


def test_a_checkpoint_for_a_model_loaded_from_a_directory_is_taken_by_its_path(tmp_path, monkeypatch):
    """The checkpoint's header is checked before the model loads, by the --model the CLI got: a directory's path, where
    the model (and every checkpoint made for it) is named by the directory's last part. Every such model's read gate
    was refused ('trained for model my-llama, not /models/my-llama')."""
    from types import SimpleNamespace

    from fastgate.gates.read import FEATURE_SETS, ReadModel, save_read_checkpoint
    from fastgate.serving.runtime import check_request

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    feats = FEATURE_SETS["all"]
    model = ReadModel(feats, tuple(0.0 for _ in feats), tuple(1.0 for _ in feats), tuple(0.0 for _ in feats), 0.0)
    ck = str(save_read_checkpoint(tmp_path / "ck", {"all": model}, model=SimpleNamespace(name="my-llama",
                                                                                      fingerprint=""),
                                  base="dtr", meta={}))
    (tmp_path / "models" / "my-llama").mkdir(parents=True)
    params = {"checkpoint": ck, "threshold": 0.0}
    assert check_request("read", params, None, str(tmp_path / "models" / "my-llama")).method == "read"
    assert check_request("read", params, None, "my-llama").method == "read"
    with pytest.raises(CheckpointError, match="trained for model my-llama, not other"):
        check_request("read", params, None, "other")


def test_v1_answer_returns_the_read_gates_details_as_ask_json_does(tmp_path, tiny, tiny_engine, small_index):
    """`POST /v1/answer` is the `ask --json` object: the read gate's `details` (features, base score, share) came
    back from the method and FastAPI's response model dropped them; a method without details has no such key."""
    import httpx

    from fastgate.entrypoints.http import create_app
    from fastgate.serving.runtime import Runtime
    from fastgate.serving.service import AnswerService, ServiceConfig
    from fastgate.testing import serve_in_thread

    ck = _checkpoint(tmp_path, tiny, 1.0)
    svc = AnswerService(ServiceConfig(method="read", params=(("checkpoint", ck), ("threshold", 0.0)),
                                      index=str(small_index)),
                        Runtime("tiny", index=str(small_index), engine=tiny_engine)).start()
    question = "What is the capital of France?"
    try:
        direct = svc._method(svc._request(None, None)).answer(question).to_dict()
        with serve_in_thread(create_app(svc, timeout_s=60)) as port, httpx.Client(timeout=60) as client:
            read = client.post(f"http://127.0.0.1:{port}/v1/answer", json={"question": question})
            never = client.post(f"http://127.0.0.1:{port}/v1/answer", json={"question": question, "method": "never"})
    finally:
        svc.stop()
    assert read.status_code == 200 and never.status_code == 200
    body = read.json()
    assert set(direct["details"]) == set(body["details"]) and "features" in body["details"]
    assert body["details"]["features"] == pytest.approx(direct["details"]["features"])
    assert "details" not in never.json() and never.json()["engine"] == "local"
