"""Training the learned gates on tiny synthetic data: features are cached and resumable, loss decreases, the fitted
probers round-trip through a checkpoint and drive the gates."""

from __future__ import annotations

import re

import pytest
import torch

from fastgate.errors import CheckpointError, InputError
from fastgate.eval.datasets import QAExample, is_held_out, split_examples
from fastgate.eval.metrics import accuracy, exact_match, normalize_answer, token_f1
from fastgate.gates.checkpoints import load_probe_checkpoint, save_probe_checkpoint
from fastgate.train import FeatureCache, FitConfig, confidence_features, fit_prober, fit_probers, prober_features

EXAMPLES = [QAExample(f"q{i}", q, (a,)) for i, (q, a) in enumerate([
    ("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "William Shakespeare"),
    ("capital of Kyrgyzstan", "Bishkek"), ("largest planet", "Jupiter"), ("capital of Germany", "Berlin"),
    ("Eiffel Tower year", "1889"), ("capital of Burkina Faso", "Ouagadougou")])]


class _CountingEngine:
    """Wraps an engine and counts the prompts it generates for."""

    def __init__(self, engine) -> None:
        self.engine, self.prompts = engine, 0

    def generate(self, prompts, *args, **kwargs):
        self.prompts += len(prompts)
        return self.engine.generate(prompts, *args, **kwargs)


def test_metrics():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert exact_match("the Paris", ["Paris"]) == 1.0 and exact_match("Paris, France", ["Paris"]) == 0.0
    assert accuracy("It is Paris, France.", ["Paris"]) == 1.0 and accuracy("Parisian", ["Paris"]) == 0.0
    assert token_f1("New Delhi India", ["New Delhi"]) == pytest.approx(0.8)


def test_held_out_split_is_stable_and_disjoint():
    from fastgate.eval.datasets import country_capitals

    caps = country_capitals()
    train, held = split_examples(caps)
    assert len(train) + len(held) == len(caps) and not {e.id for e in train} & {e.id for e in held}
    assert 0.1 < len(held) / len(caps) < 0.3
    assert [is_held_out(e) for e in caps] == [is_held_out(e) for e in country_capitals()]


def test_a_corrupt_feature_cache_is_a_clear_error(tmp_path, tiny_engine):
    """An empty meta.json (a process killed while writing it) and a truncated chunk raised JSONDecodeError and
    SafetensorError tracebacks."""
    meta = {"kind": "confidence", "model": tiny_engine.lm.fingerprint, "layer": 2}
    cache = FeatureCache(tmp_path / "c", meta)
    confidence_features(tiny_engine, EXAMPLES[:2], 2, cache, max_tokens=4, batch_size=2, progress=False)
    assert [p.name for p in (tmp_path / "c").iterdir() if p.suffix == ".tmp"] == []
    chunk = next((tmp_path / "c").glob("chunk_*.safetensors"))
    chunk.write_bytes(chunk.read_bytes()[:5])
    with pytest.raises(CheckpointError, match="chunk .* is corrupt"):
        FeatureCache(tmp_path / "c", meta)
    (tmp_path / "c" / "meta.json").write_text("")
    with pytest.raises(CheckpointError, match="meta.json is unreadable"):
        FeatureCache(tmp_path / "c", meta)


def test_confidence_features_resume_without_redoing(tmp_path, tiny_engine):
    meta = {"kind": "confidence", "model": tiny_engine.lm.fingerprint, "layer": 2}
    spy = _CountingEngine(tiny_engine)
    confidence_features(spy, EXAMPLES[:3], 2, FeatureCache(tmp_path, meta), max_tokens=4, batch_size=2,
                        progress=False)
    assert spy.prompts == 3
    spy.prompts = 0
    cache = FeatureCache(tmp_path, meta)  # a new process: the cache is read back from disk
    confidence_features(spy, EXAMPLES, 2, cache, max_tokens=4, batch_size=2, progress=False)
    assert spy.prompts == len(EXAMPLES) - 3  # only the unfinished questions
    ids, feats, labels = cache.load()
    assert sorted(ids) == sorted(e.id for e in EXAMPLES)
    assert feats.shape == (len(EXAMPLES), 1, tiny_engine.lm.hidden_size) and labels.shape == (len(EXAMPLES),)
    from fastgate.prompts import closed_book_prompt

    states = tiny_engine.prompt_states([closed_book_prompt(EXAMPLES[0].question)], 2)  # the pre-answer state
    torch.testing.assert_close(feats[ids.index("q0"), 0], states[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(CheckpointError, match="made for"):
        FeatureCache(tmp_path, {**meta, "layer": 3})
    # a --data file edited since (its ids are line numbers): the cached rows and labels were reused silently
    edited = [EXAMPLES[0], QAExample("q1", EXAMPLES[1].question, ("another answer",)), *EXAMPLES[2:]]
    with pytest.raises(CheckpointError, match="example q1 from another question or other gold answers"):
        confidence_features(spy, edited, 2, FeatureCache(tmp_path, meta), max_tokens=4, progress=False)
    moved = [QAExample("q0", "Another question?", EXAMPLES[0].answers), *EXAMPLES[1:]]
    with pytest.raises(CheckpointError, match="example q0"):
        confidence_features(spy, moved, 2, FeatureCache(tmp_path, meta), max_tokens=4, progress=False)
    # the same examples, answers in another order: the same
    same = [QAExample(e.id, e.question, tuple(reversed(e.answers))) for e in EXAMPLES]
    confidence_features(spy, same, 2, FeatureCache(tmp_path, meta), max_tokens=4, progress=False)


def test_prober_features_without_and_with_retrieval(tmp_path, tiny_engine, small_index):
    from fastgate.retrieval import BM25Retriever

    meta = {"kind": "prober", "layers": [2, 4]}
    cache = FeatureCache(tmp_path, meta)
    prober_features(tiny_engine, BM25Retriever(small_index / "bm25"), EXAMPLES[:3], (2, 4), cache, k=2,
                    max_tokens=6, batch_size=2, progress=False)
    ids, feats, labels = cache.load()
    assert {i.split("#")[1] for i in ids} == {"closed", "rag"}
    assert feats.shape[1:] == (2, tiny_engine.lm.hidden_size) and set(labels.tolist()) <= {0, 1}


def test_fit_decreases_loss_and_round_trips(tmp_path, tiny):
    torch.manual_seed(0)
    y = torch.randint(0, 2, (300,))
    x = torch.randn(300, 2, tiny.hidden_size)
    x[:, :, :8] += 1.5 * y[:, None, None]  # a direction LayerNorm keeps
    params, results = fit_probers(x, y, FitConfig(hidden=32, epochs=6, lr=1e-3))
    for r in results:
        assert r.losses[-1] < r.losses[0]
        assert r.val_accuracy > r.majority_accuracy + 0.2
    path = save_probe_checkpoint(tmp_path / "p", params, kind="probing", model=tiny, layers=(2, 4),
                                 extra={"val_accuracy": [r.val_accuracy for r in results]})
    loaded = load_probe_checkpoint(path, tiny)
    assert all(torch.equal(a, b) for a, b in zip(loaded.params, params))
    with pytest.raises(InputError):
        fit_prober(x[:3, 0], y[:3])


def test_auroc_and_gate_evaluation():
    from fastgate.gates.checkpoints import random_probe_params
    from fastgate.ops.reference import probe_logits
    from fastgate.train.evaluate import auroc, evaluate_gate

    assert auroc(torch.tensor([0.9, 0.8, 0.1, 0.2]), torch.tensor([1, 1, 0, 0])) == 1.0
    assert auroc(torch.tensor([0.1, 0.2, 0.9, 0.8]), torch.tensor([1, 1, 0, 0])) == 0.0
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == 0.5
    params = random_probe_params(1, 8, 4, seed=1)
    feats, labels = torch.randn(20, 1, 8), torch.randint(0, 2, (20,))
    ev = evaluate_gate(params, feats, labels, kind="confidence", threshold=0.5)
    conf = torch.softmax(probe_logits(feats, torch.ones(20), params), -1)[:, 0, 1]
    assert ev.decision_accuracy == pytest.approx(float(((conf > 0.5) == labels.bool()).float().mean()))
    assert ev.auroc == pytest.approx(auroc(conf, labels)) and ev.n == 20


def test_load_qa_jsonl_and_errors(tmp_path):
    from fastgate.errors import CorpusError
    from fastgate.eval.datasets import load_qa

    good = tmp_path / "qa.jsonl"
    good.write_text('{"question": "Who wrote Hamlet?", "answers": ["Shakespeare"]}\n\n'
                    '{"id": "b", "question": " Capital of Chad? ", "answers": ["N\'Djamena"]}\n')
    rows = load_qa(good)
    assert [(r.id, r.question, r.answers) for r in rows] == [("qa-1", "Who wrote Hamlet?", ("Shakespeare",)),
                                                            ("b", "Capital of Chad?", ("N'Djamena",))]
    for text, message in [('{"question": "x", "answers": "nope"}\n', ":1: question must be"),
                          ("not json\n", ":1: not valid JSON"), ('["a list"]\n', "expected a JSON object")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(CorpusError, match=message):
            load_qa(bad)
    with pytest.raises(CorpusError, match="missing.jsonl: no such file"):
        load_qa(tmp_path / "missing.jsonl")
    with pytest.raises(CorpusError, match="neither a built-in set"):
        load_qa("missing")


def test_reranker_preferences_and_fine_tune(tmp_path, tiny_engine, small_index):
    from fastgate.assets.embedder import Embedder
    from fastgate.gates.checkpoints import random_probe_params
    from fastgate.gates.prober import ConfidenceGate
    from fastgate.retrieval import BM25Retriever
    from fastgate.train.reranker import Preference, RerankerConfig, fit_reranker, shift_preferences

    gate = ConfidenceGate(random_probe_params(1, tiny_engine.lm.hidden_size, 8, seed=3), layer=2)
    prefs = shift_preferences(tiny_engine, gate, BM25Retriever(small_index / "bm25"), EXAMPLES, n_candidates=4,
                              top=2, progress=False)
    for p in prefs:
        assert 1 <= len(p.positives) <= 2 and 1 <= len(p.negatives) <= 2 and not set(p.positives) & set(p.negatives)
    # preferences the base embedder gets wrong (the related passage is the negative), so training has to move it
    pairs = [Preference("capital of France", ("Jupiter is a planet.",), ("Paris is the capital of France.",)),
             Preference("who wrote Hamlet", ("Berlin is in Germany.",), ("Hamlet was written by Shakespeare.",))]
    losses = fit_reranker(pairs, tmp_path / "rr", cfg=RerankerConfig(epochs=8, lr=2e-4, batch_size=2))
    assert len(losses) == 8 and losses[-1] < losses[0]
    emb = Embedder(tmp_path / "rr")  # the saved directory loads as an embedder (sentence-transformers layout)
    v = emb.encode(["capital of France", "Jupiter is a planet.", "Paris is the capital of France."])
    assert v.shape == (3, 384)
    assert (tmp_path / "rr" / "modules.json").is_file() and (tmp_path / "rr" / "1_Pooling").is_dir()


def test_train_confidence_keeps_the_rows_of_ids_holding_a_hash(monkeypatch, tmp_path, tiny, capsys):
    """Example ids with "#" (cap#0, ...) lost every row: the rows were matched to examples by the id's part before
    the first "#", which only prober rows ("<id>#rag") carry."""
    import json

    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    qa = [("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "Shakespeare")] * 10
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"id": f"cap#{i}", "question": f"{q} ({i})", "answers": [a]}) + "\n"
                            for i, (q, a) in enumerate(qa)))
    assert main(["train", "confidence", "--model", "tiny", "--data", str(data), "--epochs", "1",
                 "--out", str(tmp_path / "ck")]) == 0
    captured = capsys.readouterr()
    out = captured.out
    trained = int(out.split(" training questions")[0].split()[-1])
    assert trained > 4 and f"{trained} labelled rows" in out
    # the tiny random model answers nothing right: a model of one class, said before it is saved
    assert f"warning: all {trained} rows are incorrect" in captured.err


def _no_work(monkeypatch, tmp_path):
    """``fastgate train`` with the data reading and the model load made to fail the test: a flag's check must come
    before both."""
    import fastgate.assets.models
    import fastgate.train.cli

    def boom(*args, **kwargs):
        raise AssertionError("the check came after the work")

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", boom)
    monkeypatch.setattr(fastgate.train.cli, "_examples", boom)


def test_fit_config_refuses_bad_settings():
    for bad in ({"lr": float("nan")}, {"lr": -1.0}, {"lr": 0.0}, {"lr": float("inf")}, {"dropout": 2.0},
                {"dropout": -0.1}, {"dropout": 1.0}, {"dropout": float("nan")}, {"epochs": 0}, {"hidden": 0}):
        with pytest.raises(InputError, match=next(iter(bad))):
            FitConfig(**bad)
    FitConfig(dropout=0.0, lr=1e-5)


@pytest.mark.parametrize("kind", ["prober", "confidence"])
def test_train_bad_flags_fail_before_the_model_loads(monkeypatch, tmp_path, capsys, kind):
    """--lr nan / -1, --dropout 2 and --batch-size 0 were raw tracebacks (AdamW's, torch's, range()'s) after the
    model had loaded."""
    from fastgate.entrypoints.cli import main

    _no_work(monkeypatch, tmp_path)
    for flags, message in [(["--lr", "nan"], "lr must be a finite number > 0"), (["--lr", "-1"], "lr must be"),
                           (["--dropout", "2"], r"dropout must be in \[0, 1\)"),
                           (["--batch-size", "0"], "--batch-size must be >= 1"), (["--epochs", "0"], "epochs must be")]:
        assert main(["train", kind, "--model", "tiny", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(message, err), (flags, err)


def test_train_reranker_checks_its_flags_and_out_before_any_work(monkeypatch, tmp_path, capsys):
    """--epochs 0 crashed with IndexError (losses[0]) after the whole preference pass; --out DIR holding the user's
    files had them replaced by the model's."""
    from fastgate.entrypoints.cli import main

    _no_work(monkeypatch, tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "config.json").write_text("{}")
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = ["--out", str(tmp_path / "rr")]
    for flags, message in [([*out, "--epochs", "0"], "epochs must be >= 1"), ([*out, "--lr", "nan"], "lr must be"),
                           ([*out, "--lr", "0"], "lr must be"), ([*out, "--candidates", "0"], "--candidates must be"),
                           (["--out", str(mine)], "not a fastgate reranker: not overwriting"),
                           (["--out", str(afile)], "not a directory")]:
        assert main(["train", "reranker", "--model", "tiny", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (flags, err)
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    assert (mine / "notes.txt").read_text() == "keep me" and not (tmp_path / "rr").exists()


def test_reranker_save_is_atomic(tmp_path):
    """The reranker was written straight into --out: an interrupted save left a half-written model there."""
    from fastgate.train.reranker import MARKER, _save_reranker, check_reranker_out

    def writer(text, fail=False):
        def write(tmp):
            (tmp / "model.safetensors").write_text(text)
            if fail:
                raise KeyboardInterrupt
            (tmp / "tokenizer.json").write_text(text)
        return write

    out = tmp_path / "rr"
    _save_reranker(out, writer("one"), {})
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "model.safetensors", "tokenizer.json"]
    check_reranker_out(out)  # ours: may be replaced
    with pytest.raises(KeyboardInterrupt):
        _save_reranker(out, writer("two", fail=True), {})
    assert (out / "model.safetensors").read_text() == "one" and (out / "tokenizer.json").read_text() == "one"
    _save_reranker(out, writer("three"), {"losses": [1.0]})
    assert (out / "model.safetensors").read_text() == "three" and (out / "tokenizer.json").read_text() == "three"
    assert [p.name for p in tmp_path.iterdir()] == ["rr"]  # no temporary directory left beside it
    fresh = tmp_path / "empty"
    fresh.mkdir()
    with pytest.raises(KeyboardInterrupt):
        _save_reranker(fresh, writer("x", fail=True), {})
    assert list(fresh.iterdir()) == []
    (fresh / "mine.txt").write_text("keep")
    with pytest.raises(InputError, match="not a fastgate reranker"):
        _save_reranker(fresh, writer("x"), {})
    assert [p.name for p in fresh.iterdir()] == ["mine.txt"]


def test_train_evaluate_reads_with_the_k_its_prober_was_trained_on(monkeypatch, tmp_path, tiny, small_index, capsys):
    """train evaluate searched k=3 passages whatever k the probers' rows were made with (not recorded)."""
    import json

    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    qa = [("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "Shakespeare")] * 15
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"{q} ({i})", "answers": [a]}) + "\n"
                            for i, (q, a) in enumerate(qa)))
    common = ["--model", "tiny", "--data", str(data), "--index", str(small_index)]
    assert main(["train", "prober", *common, "--epochs", "1", "--k", "2", "--layers", "2",
                 "--out", str(tmp_path / "ck")]) == 0
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["extra"]["k"] == 2
    capsys.readouterr()
    assert main(["train", "evaluate", *common, "--checkpoint", str(tmp_path / "ck")]) == 0
    metas = [json.loads(p.read_text()) for p in (tmp_path / "home" / "features").glob("*/meta.json")]
    assert {m["k"] for m in metas if m["kind"] == "prober-heldout"} == {2}


def test_train_takes_every_hidden_state_a_checkpoint_may_tap(monkeypatch, tmp_path, tiny, small_index, capsys):
    """Loading accepts probers on hidden states 0 .. n_layers (the output); training refused n_layers itself."""
    import json

    import fastgate.assets.models
    from fastgate.entrypoints.cli import main
    from fastgate.gates.checkpoints import load_probe_checkpoint

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is the capital of France? ({i})", "answers": ["Paris"]})
                            + "\n" for i in range(12)))
    common = ["--model", "tiny", "--data", str(data), "--index", str(small_index), "--epochs", "1", "--k", "2"]
    n = tiny.n_layers
    assert main(["train", "prober", *common, "--layers", str(n), "--out", str(tmp_path / "ck")]) == 0
    assert list(load_probe_checkpoint(tmp_path / "ck").layers) == [n]
    capsys.readouterr()
    assert main(["train", "prober", *common, "--layers", str(n + 1), "--out", str(tmp_path / "ck2")]) != 0
    assert f"hidden states 0 to {n}" in capsys.readouterr().err


def test_train_confidence_refuses_to_replace_a_probing_checkpoint_before_any_work(monkeypatch, tmp_path, tiny, capsys):
    from fastgate.entrypoints.cli import main
    from fastgate.gates.checkpoints import random_probe_params

    ck = save_probe_checkpoint(tmp_path / "probers", random_probe_params(2, tiny.hidden_size, 8), kind="probing",
                               model=tiny, layers=(1, 2))
    before = (ck / "config.json").read_text()
    _no_work(monkeypatch, tmp_path)
    assert main(["train", "confidence", "--model", "tiny", "--out", str(ck)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a probing checkpoint, and this is a confidence checkpoint" in err, err
    assert (ck / "config.json").read_text() == before


def _read_no_work(monkeypatch, tmp_path, tiny=None):
    """``fastgate train read`` whose passes fail the test; the model load too, unless ``tiny`` is given."""
    import fastgate.assets.models
    from fastgate.train import read as train_read

    def boom(*args, **kwargs):
        raise AssertionError("the check came after the work")

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", boom if tiny is None else (lambda *a, **kw: tiny))
    monkeypatch.setattr(train_read, "training_pass", boom)


def test_train_read_checks_batch_size_index_and_out_before_loading(monkeypatch, tmp_path, tiny, capsys):
    """--batch-size 0 and a missing --index each left a cache directory (eval.json, .lock) behind, after the model
    had loaded; --out on a prober checkpoint replaced its config."""
    from fastgate.entrypoints.cli import main
    from fastgate.gates.checkpoints import random_probe_params

    ck = save_probe_checkpoint(tmp_path / "probers", random_probe_params(2, tiny.hidden_size, 8), kind="probing",
                               model=tiny, layers=(1, 2))
    before = (ck / "config.json").read_text()
    _read_no_work(monkeypatch, tmp_path)
    cache = tmp_path / "pass"
    common = ["train", "read", "--model", "tiny", "--data", "capitals", "--n", "12", "--cache", str(cache)]
    for flags, message in [(["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
                           (["--index", str(tmp_path / "nonexist")], f"--index {tmp_path / 'nonexist'} does not exist"),
                           (["--out", str(ck)], "holds a probing checkpoint: `fastgate train read` writes a read "
                                                "checkpoint"),
                           (["--decide", "prefill", "--layer", "-1"], "--layer must be >= 0")]:
        assert main([*common, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (flags, err)
        assert not cache.exists() and not (tmp_path / "home").exists()
    assert (ck / "config.json").read_text() == before


def test_train_read_checks_layer_right_after_the_model_loads(monkeypatch, tmp_path, tiny, capsys):
    """--layer 99 ran the whole training pass, then failed on "tap layer 99 out of range"."""
    from fastgate.entrypoints.cli import main

    _read_no_work(monkeypatch, tmp_path, tiny)
    n = tiny.n_layers
    assert main(["train", "read", "--model", "tiny", "--data", "capitals", "--n", "12", "--decide", "prefill",
                 "--layer", str(n + 1), "--features", "all"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--layer {n + 1}: tiny has hidden states 0 to {n}" in err, err


@pytest.mark.parametrize("kind", ["prober", "confidence", "evaluate", "reranker", "read"])
def test_train_help_states_every_default(kind):
    """`train prober|confidence|evaluate|reranker --help` named no default for --model, --device, --hidden, --epochs,
    --lr, --dropout, --k, --data, --seed, --batch-size."""
    import argparse

    from fastgate.train.cli import add_train_args

    train = argparse.ArgumentParser()
    add_train_args(train)
    (kinds,) = [a for a in train._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [a.dest for a in kinds.choices[kind]._actions
               if a.default not in (None, False, argparse.SUPPRESS) and "default" not in (a.help or "")]
    assert not missing, missing
