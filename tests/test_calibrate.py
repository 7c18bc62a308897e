"""``fastgate calibrate`` and the calibration files: the boundary rule, the CLI pass on the tiny model (resumable),
the written entry and how ask / eval read it back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastgate.errors import InputError
from fastgate.methods.calibration import calibrated_params, calibration_entries, write_calibration
from fastgate.train.calibrate import choose_cut, dev_curve

QA = [("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "Shakespeare"),
      ("What is the capital of Kyrgyzstan?", "Bishkek"), ("What is the largest planet?", "Jupiter"),
      ("When was the Eiffel Tower completed?", "1889"), ("What is the capital of Germany?", "Berlin"),
      ("What is the capital of Burkina Faso?", "Ouagadougou")]


def test_cut_retrieves_exactly_k():
    s = np.array([0.3, 0.9, 0.1, 0.5, 0.7])
    for k in range(6):
        cut = choose_cut(s, k, retrieve_above=True)
        assert int((s >= cut).sum()) == k
        cut = choose_cut(s, k, retrieve_above=False)
        assert int((s <= cut).sum()) == k
    assert choose_cut(s, 2, True) == pytest.approx(0.6)  # midpoint of 0.7 and 0.5


def test_dev_curve_replays_answers_and_the_random_line():
    scores = np.array([3.0, 2.0, 1.0, 0.0])
    skip = np.array([0.0, 0.0, 1.0, 1.0])
    read = np.array([1.0, 1.0, 0.0, 1.0])
    curve = dev_curve(scores, True, skip, read)
    assert [r["acc"] for r in curve] == [0.5, 0.75, 1.0, 0.75, 0.75]
    assert curve[2]["random"] == pytest.approx(0.5 * 0.5 + 0.5 * 0.75)


@pytest.fixture()
def cli(monkeypatch, tmp_path, tiny, small_index):
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in QA))

    def run(*extra: str) -> int:
        return main(["calibrate", "--model", "tiny", "--data", str(data), "--index", str(small_index), "--quiet",
                     "--batch-size", "2", "--n", "7", "--out", str(tmp_path / "runs"), *extra])

    return run


def test_calibrate_dtr_writes_an_entry_that_ask_and_eval_use(cli, capsys, tmp_path):
    assert cli("--method", "dtr", "--rate", "0.5") == 0
    out = capsys.readouterr().out
    assert "<- chosen" in out and "written to" in out
    entries = calibration_entries("tiny")
    assert len(entries) == 1 and entries[0]["method"] == "dtr" and entries[0]["n"] == 7
    tau = entries[0]["params"]["tau"]
    recs = [json.loads(line) for line in (tmp_path / "runs" / "results.jsonl").read_text().splitlines()]
    scores = np.array([r["gate_steps"][0]["score"] for r in recs])
    assert {r["run"] for r in recs} == {"dtr[tau=1e9]"} and not any(r["retrieved"] for r in recs)
    assert int((scores >= tau).sum()) == 4  # round(0.5 * 7)
    assert calibrated_params("tiny", "dtr")["tau"] == tau  # what Runtime.effective_params applies
    assert calibrated_params("tiny", "dtr", {"tau": 0.1})["tau"] == 0.1  # the user's value wins
    # a second calibration of the same method replaces the entry; other models are untouched
    assert cli("--method", "dtr", "--rate", "0.3", "--dry-run") == 0
    assert calibration_entries("tiny")[0]["params"]["tau"] == tau
    assert cli("--method", "dtr", "--rate", "1.0") == 0
    assert len(calibration_entries("tiny")) == 1 and calibration_entries("tiny")[0]["params"]["tau"] <= scores.min()


def test_interrupted_calibration_resumes(cli, capsys, monkeypatch, tmp_path):
    import fastgate.eval.runner as runner

    real, calls = runner.ResultsStore.append, []

    def flaky(self, records):  # the second group of answered questions is never stored: interrupted before
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, records)

    monkeypatch.setattr(runner.ResultsStore, "append", flaky)
    assert cli("--method", "dtr", "--dry-run") != 0  # main reports "fastgate: interrupted"
    assert "interrupted" in capsys.readouterr().err
    monkeypatch.setattr(runner.ResultsStore, "append", real)
    assert len((tmp_path / "runs" / "results.jsonl").read_text().splitlines()) == 2  # the first batch was kept
    capsys.readouterr()
    assert cli("--method", "dtr", "--dry-run") == 0
    resumed = capsys.readouterr().out
    assert "5 answer(s) to compute" in resumed
    lines = (tmp_path / "runs" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 7 and len({json.loads(line)["id"] for line in lines}) == 7


def test_best_rule_runs_always_and_reports_the_gain(cli, capsys, tmp_path):
    assert cli("--method", "dtr", "--rule", "best", "--rate", "0.8") == 0
    out = capsys.readouterr().out
    assert "random" in out and "points over the random gate" in out
    runs = {json.loads(line)["run"] for line in (tmp_path / "runs" / "results.jsonl").read_text().splitlines()}
    assert runs == {"dtr[tau=1e9]", "always[retriever=dense]"}  # DTR reads dense passages: so does its `always`
    entry = calibration_entries("tiny")[0]
    assert entry["rule"] == "best" and entry["rate"] <= 0.8 and "dev_gain_over_random" in entry


def test_the_rules_replay_reads_of_the_calibrated_runs_own_retriever(cli, capsys, tmp_path):
    """`always` read BM25 passages whatever the calibrated run reads: a method on dense passages was judged against
    another retriever's reads."""
    assert cli("--method", "dtr", "--retriever", "bm25", "--rule", "best", "--rate", "0.8") == 0
    runs = {json.loads(line)["run"] for line in (tmp_path / "runs" / "results.jsonl").read_text().splitlines()}
    assert runs == {"dtr[tau=1e9,retriever=bm25]", "always"}


def test_loss_rule_retrieves_least_within_the_loss(cli, capsys, tmp_path):
    assert cli("--method", "dtr", "--rule", "loss", "--max-loss", "0.01") == 0
    out = capsys.readouterr().out
    assert "rule loss: the fewest retrievals within 1.0 point(s)" in out
    recs = [json.loads(line) for line in (tmp_path / "runs" / "results.jsonl").read_text().splitlines()]
    assert {r["run"] for r in recs} == {"dtr[tau=1e9]", "always[retriever=dense]"}
    entry = calibration_entries("tiny")[0]
    assert entry["rule"] == "loss" and entry["max_loss"] == 0.01
    # the tiny model answers nothing right either way: retrieving on no question loses nothing
    assert not any(r["acc"] for r in recs) and entry["rate"] == 0.0


@pytest.mark.parametrize(("argv", "message"), [
    (["--method", "never"], "has no gate threshold to calibrate"),
    (["--method", "dtr", "--rule", "loss", "--max-loss", "-0.1"], "--max-loss must be in"),
    (["--method", "dtr", "--param", "tau=0.5"], "is what calibration chooses"),
    (["--method", "dtr", "--rate", "0"], "--rate must be in"),
    (["--method", "magic"], "unknown method"),
])
def test_calibrate_rejects_bad_input(cli, capsys, argv, message):
    assert cli(*argv) == 2
    assert message in capsys.readouterr().err


def test_conditional_entries_and_corrupt_files(monkeypatch, tmp_path):
    from fastgate.errors import InputError

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path))
    write_calibration("m", {"method": "read", "when": {"base": "dtr", "features": "all"}, "params": {"threshold": 1.5}})
    write_calibration("m", {"method": "read", "when": {"base": "dtr", "features": "dense"},
                            "params": {"threshold": 0.5}})
    assert calibrated_params("m", "read")["threshold"] == 1.5  # the defaults are base=dtr, features=all
    assert calibrated_params("m", "read", {"features": "dense"})["threshold"] == 0.5
    with pytest.raises(InputError, match="no calibrated threshold for read on model m .base=cbdr"):
        calibrated_params("m", "read", {"base": "cbdr"})  # not the 0.0 default: the base's own calibration or none
    assert calibrated_params("m", "read", {"base": "cbdr", "threshold": "0.2"})["threshold"] == "0.2"
    assert "threshold" not in calibrated_params("m", "read", {"base": "cbdr", "collect": True})  # training pass
    (tmp_path / "calibration" / "m.json").write_text("{broken")
    with pytest.raises(InputError, match="calibration file .* is corrupt"):
        calibrated_params("m", "read")
    (tmp_path / "calibration" / "m.json").write_text(json.dumps(
        {"model": "m", "entries": [{"method": "dtr", "when": ["k", 2], "params": {"tau": 0.3}}]}))
    with pytest.raises(InputError, match="calibration file .*m.json is corrupt"):  # not an AttributeError
        calibrated_params("m", "dtr")


def test_a_condition_applies_however_its_value_is_typed(monkeypatch, tmp_path):
    """`calibrate --param k=2` writes the string "2"; `ask --k 2` passes the integer, the library either."""
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path))
    write_calibration("m", {"method": "dtr", "when": {"k": "2"}, "params": {"tau": 0.55}})
    write_calibration("m", {"method": "dtr", "when": {"k": "3"}, "params": {"tau": 0.66}})  # 3: dtr's default k
    for k in ("2", 2, "02"):
        assert calibrated_params("m", "dtr", {"k": k})["tau"] == 0.55
    assert calibrated_params("m", "dtr")["tau"] == 0.66 and calibrated_params("m", "dtr", {"k": 3})["tau"] == 0.66
    assert calibrated_params("m", "dtr", {"k": "4"}, warn=False).get("tau") is None


def test_shipped_files_keep_the_documented_values():
    from fastgate.methods.calibration import CALIBRATED, SEAKR_DELTA_BY_SAMPLES

    assert CALIBRATED["qwen2.5-0.5b"]["dtr"] == {"tau": 0.84}
    assert CALIBRATED["qwen2.5-1.5b"]["dtr"] == {"tau": 0.53}
    assert CALIBRATED["smollm2-135m"]["cbdr"] == {"beta": 0.8}
    assert SEAKR_DELTA_BY_SAMPLES == {"smollm2-135m": {3: 6.6}, "qwen2.5-0.5b": {3: 2.56}}


@pytest.fixture()
def fresh_warnings(monkeypatch):
    import fastgate.methods.calibration as calibration

    monkeypatch.setattr(calibration, "_WARNED", set())


def test_a_model_without_an_entry_says_so_once(monkeypatch, tmp_path, caplog, fresh_warnings):
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path))
    with caplog.at_level("WARNING", logger="fastgate.calibration"):
        assert "tau" not in calibrated_params("unknown-model", "dtr")
        assert "tau" not in calibrated_params("unknown-model", "dtr", {"k": 2})
        assert calibrated_params("unknown-model", "dtr", {"tau": 0.3})["tau"] == 0.3  # set by the user: no warning
        calibrated_params("unknown-model", "never")  # no gate, nothing to calibrate
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "no calibration of dtr on model unknown-model" in warning and "tau=0.001" in warning
    assert "fastgate calibrate --method dtr --model unknown-model" in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="fastgate.calibration"):
        calibrated_params("other-model", "dtr")
        calibrated_params("qwen2.5-0.5b", "dtr")  # shipped: no warning
    messages = [r.getMessage().split(":")[2].strip() for r in caplog.records]
    assert messages == ["no calibration of dtr on model other-model"]


def test_an_own_checkpoint_does_not_inherit_the_shipped_threshold(monkeypatch, tmp_path, caplog, fresh_warnings):
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    ckpt = tmp_path / "my-probers"
    ckpt.mkdir()
    assert calibrated_params("qwen2.5-0.5b", "probing")["theta"] == -5.32  # the shipped probers' value
    with caplog.at_level("WARNING", logger="fastgate.calibration"):
        assert "theta" not in calibrated_params("qwen2.5-0.5b", "probing", {"checkpoint": str(ckpt)})
    assert f"with checkpoint {ckpt.resolve()}" in caplog.records[0].getMessage()
    # the read gate refuses rather than silently using the shipped checkpoint's threshold on another one
    with pytest.raises(InputError, match="no calibrated threshold for read on model qwen2.5-0.5b with checkpoint"):
        calibrated_params("qwen2.5-0.5b", "read", {"checkpoint": str(ckpt)})
    # an entry made for that checkpoint applies to it, named by a relative or an absolute path, and to no other
    from fastgate.methods.calibration import checkpoint_key

    write_calibration("qwen2.5-0.5b", {"method": "probing", "when": {"checkpoint": checkpoint_key(ckpt)},
                                       "params": {"theta": -1.5}})
    monkeypatch.chdir(tmp_path)
    assert calibrated_params("qwen2.5-0.5b", "probing", {"checkpoint": "my-probers"})["theta"] == -1.5
    assert calibrated_params("qwen2.5-0.5b", "probing")["theta"] == -5.32


@pytest.mark.parametrize("data", ["nq", "nq:test", "triviaqa:test:balanced", "webq", "heldout"])
def test_training_and_calibration_refuse_test_splits(data, capsys, monkeypatch, tmp_path):
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path))

    def never(*args, **kwargs):
        raise AssertionError("nothing may load before the split is refused")

    monkeypatch.setattr(fastgate.assets.models, "load", never)
    for argv in (["calibrate", "--method", "dtr"], ["train", "read"], ["train", "confidence"], ["train", "prober"]):
        assert main([*argv, "--model", "tiny", "--data", data]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("fastgate: error: ") and "refuses --data " + data in err and "\n" not in err
        if data.startswith("nq"):
            assert "use nq:dev" in err


@pytest.mark.parametrize("data", ["default", "capitals", "fanoutqa"])
def test_fitting_on_a_built_in_set_leaves_its_held_out_fifth_out(data):
    """`train read` and `calibrate` loaded the built-in sets whole: they fitted on the `heldout` questions that
    evaluations report on (prober and confidence training always dropped them)."""
    from fastgate.eval.datasets import is_held_out, load_fit_examples, load_qa

    name, examples = load_fit_examples(data, None, "calibration")
    held = {e.id for e in load_qa("heldout")}
    assert name == data and examples and not any(is_held_out(e) or e.id in held for e in examples)
    assert len(examples) == sum(not is_held_out(e) for e in load_qa(data))
    assert len(load_fit_examples(data, 10, "calibration")[1]) == 10


def test_calibration_asks_the_method_what_it_reads_and_what_its_threshold_holds_for():
    """calibrate's replayed `always` reads what the calibrated run reads, and the entry's `when` names what the
    threshold belongs to: both from the method's class, no method named in calibrate."""
    from fastgate.methods import make_config
    from fastgate.methods.base import method_class

    read = method_class("read")
    assert read.reads_from(make_config("read", {"features": "dense"}), "bm25") == "dense"  # its dense top-k
    assert read.reads_from(make_config("read", {}), "bm25") == "bm25"
    assert read.reads_from(make_config("read", {}), "dense") == "dense"
    assert read.calibration_condition(make_config("read", {"features": "dense"})) == {"base": "dtr",
                                                                                      "features": "dense"}
    dtr = method_class("dtr")
    assert dtr.reads_from(make_config("dtr", {}), "dense") == "dense" and dtr.calibration_condition(
        make_config("dtr", {})) == {}


def test_calibrate_holds_its_run_directory(cli, capsys, tmp_path):
    """Two calibrations into one run directory answered every question twice (as two evaluations did)."""
    import fcntl
    import os

    runs = tmp_path / "runs"
    runs.mkdir()
    fd = os.open(runs / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242\n")
        assert cli("--method", "dtr", "--rate", "0.5") == 2
        err = capsys.readouterr().err
        assert f"{runs} is in use by another fastgate calibrate (pid 4242)" in err
        assert not (runs / "results.jsonl").exists()
    finally:
        os.close(fd)
    assert cli("--method", "dtr", "--rate", "0.5") == 0  # released: it runs


def test_calibrating_a_feature_set_the_read_checkpoint_lacks_says_so_and_answers_nothing(cli, capsys, tmp_path,
                                                                                        tiny):
    """What `ask --method read --param features=dense` points at when no calibration applies: over a gate with only
    the `all` set, the checkpoint's own refusal comes first, with the way out, and no question is answered."""
    from fastgate.gates.read import FEATURE_SETS, ReadModel, save_read_checkpoint

    feats = FEATURE_SETS["all"]
    m = ReadModel(feats, tuple(0.0 for _ in feats), tuple(1.0 for _ in feats), tuple(0.0 for _ in feats), 0.0)
    ck = save_read_checkpoint(tmp_path / "all-only", {"all": m}, model=tiny, base="dtr", meta={})
    assert cli("--method", "read", "--param", f"checkpoint={ck}", "--param", "features=dense") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fastgate: error: read-gate checkpoint {ck} has no 'dense' model (has: all)"), err
    assert "--param features=all" in err and "\n" not in err
    results = tmp_path / "runs" / "results.jsonl"
    assert not results.exists() or not results.read_text().strip()


def test_calibrate_checks_its_flags_and_the_model_before_the_run_directory(capsys, monkeypatch, tmp_path):
    """A mistyped --model left calibration/runs/<typo>-... behind (--dry-run too); --n -5 was told ">= 0", then --n 0
    ">= 1"; a missing --data file was "neither a built-in set ... nor a JSONL file"."""
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main
    from fastgate.errors import UnknownNameError

    def load(name, *args, **kwargs):  # as the real one: neither an embedded name nor a directory
        raise UnknownNameError("model", name, ["smollm2-135m"])

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", load)
    assert main(["calibrate", "--method", "dtr", "--model", "smolm2", "--data", "capitals", "--n", "4",
                 "--dry-run"]) == 2
    assert "unknown model 'smolm2'" in capsys.readouterr().err
    assert not (tmp_path / "home" / "calibration").exists()
    for n in ("-5", "0", "1"):  # calibration needs two questions: one bound for all three
        with pytest.raises(SystemExit):
            main(["calibrate", "--method", "dtr", "--n", n])
        assert "expected a number of questions >= 2" in capsys.readouterr().err
    assert main(["calibrate", "--method", "dtr", "--data", str(tmp_path / "nosuch.jsonl")]) == 2
    assert f"--data {tmp_path / 'nosuch.jsonl'}: no such file" in capsys.readouterr().err


def test_another_models_calibration_file_is_neither_merged_into_nor_applied(cli, capsys, monkeypatch, tmp_path):
    """`calibrate --write FILE` on qwen's file rewrote it as the tiny model's, qwen's entries with it; a user file whose
    "model" is another model's was applied to the model its name says."""
    other = tmp_path / "qwen.json"
    doc = {"model": "qwen2.5-0.5b", "entries": [{"method": "dtr", "params": {"tau": 0.84}}]}
    other.write_text(json.dumps(doc))
    before = other.read_text()
    with pytest.raises(InputError, match=r"is qwen2\.5-0\.5b's calibration file, not tiny's.*choose another --write"):
        write_calibration("tiny", {"method": "flare", "params": {"theta": 0.1}}, other)
    assert other.read_text() == before
    # refused before the pass: nothing answered, no run directory made
    assert cli("--method", "dtr", "--write", str(other)) == 2
    err = capsys.readouterr().err.strip()
    assert "qwen2.5-0.5b's calibration file, not tiny's" in err and "--write" in err and "\n" not in err, err
    assert other.read_text() == before and not (tmp_path / "runs").exists()
    with pytest.raises(InputError, match="is a directory"):
        write_calibration("tiny", {"method": "flare", "params": {"theta": 0.1}}, tmp_path)
    # a file of the same model, or naming none, is merged into as before
    write_calibration("qwen2.5-0.5b", {"method": "flare", "params": {"theta": 0.1}}, other)
    assert [e["method"] for e in json.loads(other.read_text())["entries"]] == ["dtr", "flare"]
    # the reader: tiny's file holding qwen's thresholds is refused, naming both, not applied
    home = tmp_path / "home" / "calibration"
    home.mkdir(parents=True)
    (home / "tiny.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"holds qwen2\.5-0\.5b's thresholds .*not tiny's"):
        calibrated_params("tiny", "dtr")
    with pytest.raises(InputError, match="not tiny's"):
        calibration_entries("tiny")


def test_a_corrupt_calibration_file_says_fix_or_delete_and_blocks_no_method_without_a_threshold(monkeypatch,
                                                                                                  tmp_path):
    """The hint advised rerunning `fastgate calibrate`, which stops on the same file; `--method never` (no
    threshold) was refused on it too."""
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path))
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "m.json").write_text('{"model": "m", "entr')
    with pytest.raises(InputError) as info:
        calibrated_params("m", "dtr")
    assert str(info.value).endswith("): fix or delete it") and "fastgate calibrate" not in str(info.value)
    for method in ("never", "always"):
        assert calibrated_params("m", method, {"k": 2}) == {"k": 2}


def test_calibrate_checks_batch_size_index_and_n_as_eval_does_before_loading(capsys, monkeypatch, tmp_path):
    """--batch-size 0 and a missing --index loaded the model, left the run directory behind and then failed on a
    message naming neither flag; --n 1 answered its question and then could not calibrate."""
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    def never(*args, **kwargs):
        raise AssertionError("nothing may load before the flags are checked")

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fastgate.assets.models, "load", never)
    out = tmp_path / "runs"
    for flags in (["--batch-size", "0"], ["--index", str(tmp_path / "nonexist")]):
        common = ["--data", "capitals", "--n", "4", *flags, "--out", str(out), "--quiet"]
        assert main(["calibrate", "--method", "dtr", *common]) == 2
        mine = capsys.readouterr().err
        assert main(["eval", "--method", "dtr", *common]) == 2
        assert mine == capsys.readouterr().err and mine.count("\n") == 1, mine  # eval's very line
        assert not out.exists() and not (tmp_path / "home" / "calibration").exists()
    with pytest.raises(SystemExit):
        main(["calibrate", "--method", "dtr", "--n", "1"])
    assert "expected a number of questions >= 2" in capsys.readouterr().err
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"question": "Who wrote Hamlet?", "answers": ["Shakespeare"]}) + "\n")
    assert main(["calibrate", "--method", "dtr", "--data", str(one), "--out", str(out)]) == 2
    assert "has 1 question(s): calibration needs at least 2" in capsys.readouterr().err
    assert not out.exists()


def test_a_remote_calibration_that_cannot_reach_its_server_leaves_no_run_directory(capsys, monkeypatch, tmp_path,
                                                                                   small_index):
    """eval.json and .lock stayed in the run directory (under $FASTGATE_HOME by default); one that existed before,
    or that holds records, stays."""
    import socket

    from fastgate.entrypoints.cli import main

    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    with socket.socket() as s:  # nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in QA))
    argv = ["calibrate", "--method", "dtr", "--engine", "openai", "--base-url", f"http://127.0.0.1:{port}/v1",
            "--api-model", "m", "--api-retries", "0", "--data", str(data), "--n", "4", "--index", str(small_index),
            "--quiet"]
    assert main(argv) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    assert not (tmp_path / "home" / "calibration").exists()  # the run directory and the parents it made
    mine = tmp_path / "mine"
    mine.mkdir()
    assert main([*argv, "--out", str(mine)]) == 2
    assert mine.is_dir()  # it existed before: kept
    held = tmp_path / "held"
    assert main([*argv, "--out", str(held / "sub")]) == 2 and not held.exists()
    # a directory made for the run with records in it stays, whatever failed (fastgate.eval.runner.hold_out_dir)
    from fastgate.eval.runner import hold_out_dir

    def fails_in(directory, results: str) -> None:
        with pytest.raises(RuntimeError, match="boom"), hold_out_dir(directory):
            (directory / "eval.json").write_text("{}")
            (directory / "results.jsonl").write_text(results)
            raise RuntimeError("boom")

    fails_in(held, '{"run": "dtr"}\n')
    assert sorted(p.name for p in held.iterdir()) == [".lock", "eval.json", "results.jsonl"]
    fails_in(tmp_path / "again", "")  # only its own empty files: removed
    assert not (tmp_path / "again").exists()


def test_calibrate_help_says_what_dry_run_keeps_and_every_default():
    """--dry-run said "write nothing" but kept the pass's records and plot; --rule named no default, --quiet had no
    help."""
    import argparse

    from fastgate.train.calibrate import add_calibrate_args

    p = argparse.ArgumentParser()
    add_calibrate_args(p)
    helps = {a.dest: a.help or "" for a in p._actions}
    assert "write nothing" not in helps["dry_run"] and "records and plot are still kept" in helps["dry_run"]
    assert "default: %(default)s" in helps["rule"] and helps["quiet"]


def test_a_data_file_names_its_default_run_directory_by_stem_and_path_hash(tmp_path):
    """`calibrate --data /abs/qa.jsonl` without --out nested the file's whole path under calibration/runs/; two files
    of one stem now get a directory each, one level deep."""
    from fastgate.train.calibrate import _data_label

    a, b = tmp_path / "a" / "qa.jsonl", tmp_path / "b" / "qa.jsonl"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text('{"question": "q", "answers": ["a"]}\n')
    la, lb = _data_label(str(a)), _data_label(str(b))
    assert la.startswith("qa-") and lb.startswith("qa-") and la != lb and "/" not in la + lb
    assert _data_label(str(a)) == la  # stable
    assert _data_label("nq:dev:balanced") == "nq-dev-balanced"
