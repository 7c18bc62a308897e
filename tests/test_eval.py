"""The evaluation harness: scoring, incremental resumable records, summaries, plots and the ``fastgate eval`` CLI."""

from __future__ import annotations

import json
import math

import pytest

from fastgate.errors import InputError
from fastgate.eval.datasets import QAExample, load_qa, sample_examples
from fastgate.eval.runner import (
    EvalSettings,
    ResultsStore,
    RunSpec,
    check_settings,
    evaluate,
    markdown_table,
    plot_accuracy_vs_retrieval,
    summarize,
    write_summary,
)
from fastgate.serving.runtime import Runtime

EXAMPLES = [
    QAExample("q1", "What is the capital of France?", ("Paris",)),
    QAExample("q2", "Who wrote Hamlet?", ("William Shakespeare", "Shakespeare")),
    QAExample("q3", "What is the capital of Kyrgyzstan?", ("Bishkek",)),
    QAExample("q4", "What is the largest planet?", ("Jupiter",)),
    QAExample("q5", "When was the Eiffel Tower completed?", ("1889",)),
]


@pytest.fixture()
def runtime(tiny_engine, small_index):
    return Runtime("tiny", index=str(small_index), engine=tiny_engine)


def _record(run="dtr", qid="a", answer="Paris", retrieved=True, latency=2.0, batch=2, total=1.5, gate=0.01, **extra):
    rec = {"run": run, "id": qid, "method": run.split("[")[0], "answer": answer, "retrieved": retrieved,
           "retrieval_calls": int(retrieved), "lm_calls": 1 + 2 * retrieved, "generated_tokens": 4,
           "latency_s": latency, "batch_size": batch, "timings": {"total_s": total, "gate_s": gate},
           "em": float(answer == "Paris"), "f1": float(answer == "Paris"), "acc": float(answer == "Paris")}
    rec.update(extra)
    return rec


def test_summarize_counts_each_batch_once():
    recs = [_record(qid="a"), _record(qid="b", answer="Lyon", retrieved=False),
            _record(qid="c", latency=4.0, batch=1, total=3.0, gate=0.3)]
    s = summarize(RunSpec("dtr", "dense"), recs)
    assert s.n == 3 and s.em == pytest.approx(2 / 3) and s.retrieval_rate == pytest.approx(2 / 3)
    assert s.retrievals_per_q == pytest.approx(2 / 3) and s.lm_calls_per_q == pytest.approx(7 / 3)
    # wall time: one batch of 2 (2 s) and one of 1 (4 s) -> 3 questions in 6 s
    assert s.questions_per_s == pytest.approx(0.5)
    assert s.latency_p50_s == 2.0 and s.latency_p95_s == pytest.approx(3.8)
    assert s.gate_share == pytest.approx((0.01 + 0.3) / (1.5 + 3.0))
    # standard error of the mean: sample sd / sqrt(n); ACC is [1, 0, 1] -> sd sqrt(1/3), SE 1/3
    assert s.acc_se == pytest.approx(1 / 3) and s.em_se == pytest.approx(1 / 3)
    assert math.isnan(summarize(RunSpec("dtr", "dense"), recs[:1]).acc_se)  # one record: no sample sd
    table = markdown_table([s])
    assert table.splitlines()[0].startswith("| run | n | EM |") and "| dtr | 3 | 0.667 |" in table
    assert "| ACC | ± ACC (SE) |" in table and "| 0.667 | 0.333 |" in table
    with pytest.raises(InputError, match="no records"):
        summarize(RunSpec("dtr", "dense"), [])


def test_run_keys():
    assert RunSpec("dtr", "dense").key == "dtr"
    assert RunSpec("dtr", "bm25").key == "dtr[retriever=bm25]"
    assert RunSpec("flare", "bm25", (("theta", "0.3"),)).key == "flare[theta=0.3]"


def test_store_drops_a_cut_last_line_and_rejects_garbage(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(_record(qid="a")) + "\n" + '{"run": "dtr", "id": "b", "ans')
    store = ResultsStore(path)
    assert store.done("dtr", "a") and not store.done("dtr", "b")
    store.append([_record(qid="b")])
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "b"]
    path.write_text("not json\n")
    with pytest.raises(InputError, match="not a result record"):
        ResultsStore(path)
    path.write_bytes(json.dumps(_record(qid="a")).encode() + b"\n\xc9\xff binary\n")  # not UTF-8 text at all
    with pytest.raises(InputError, match=r"results\.jsonl:2 is not a result record"):
        ResultsStore(path)
    # a record holding characters str.splitlines() splits on (U+2028, U+0085), written raw (ensure_ascii=False)
    path.unlink()
    ResultsStore(path).append([{**_record(qid="c"), "answer": "line\u2028sep\x85next"}])
    assert ResultsStore(path).records[("dtr", "c")]["answer"] == "line\u2028sep\x85next"


def test_store_reads_compressed_records_and_writes_them_out_only_to_add(tmp_path):
    """Records committed as results.jsonl.gz (docs/results) are read as they are; reading writes nothing; the first
    append writes them out as results.jsonl with the new ones after; has_results sees them; a bad gzip is one
    InputError naming the file; a cut last line is dropped without touching the compressed file."""
    import gzip

    from fastgate.eval.runner import has_results

    path = tmp_path / "results.jsonl"
    packed = gzip.compress("".join(json.dumps(_record(qid=q)) + "\n" for q in "ab").encode())
    (tmp_path / "results.jsonl.gz").write_bytes(packed)
    assert has_results(tmp_path)
    store = ResultsStore(path)
    assert list(store.records) == [("dtr", "a"), ("dtr", "b")] and not path.exists()
    store.append([])
    assert not path.exists()  # nothing added: nothing written
    store.append([_record(qid="c")])
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "b", "c"]
    store.append([_record(qid="d")])  # once written out, appends go to the plain file alone
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "b", "c", "d"]
    assert list(ResultsStore(path).records) == [("dtr", q) for q in "abcd"]  # the plain file wins from now on
    assert (tmp_path / "results.jsonl.gz").read_bytes() == packed
    path.unlink()
    cut = gzip.compress((json.dumps(_record(qid="a")) + "\n" + '{"run": "dtr", "id": "b", "ans').encode())
    (tmp_path / "results.jsonl.gz").write_bytes(cut)
    store = ResultsStore(path)
    assert list(store.records) == [("dtr", "a")]
    store.append([_record(qid="e")])
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "e"]  # no glued half record
    path.unlink()
    (tmp_path / "results.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(InputError, match=r"results\.jsonl\.gz is not a readable gzip file"):
        ResultsStore(path)
    (tmp_path / "results.jsonl.gz").unlink()
    assert not has_results(tmp_path)
    # compressed records are records: an evaluation of other settings is refused there, not written over them
    check_settings(tmp_path, EvalSettings(model="tiny"))
    (tmp_path / "results.jsonl.gz").write_bytes(packed)
    with pytest.raises(InputError, match="other settings.*seed"):
        check_settings(tmp_path, EvalSettings(model="tiny", seed=3))


def test_settings_must_match(tmp_path):
    check_settings(tmp_path, EvalSettings(model="tiny"))
    check_settings(tmp_path, EvalSettings(model="tiny"))  # same settings: fine
    ResultsStore(tmp_path / "results.jsonl").append([_record()])  # records made under them
    with pytest.raises(InputError, match="other settings.*seed"):
        check_settings(tmp_path, EvalSettings(model="tiny", seed=3))
    (tmp_path / "eval.json").write_bytes(b"{\xc9\xff binary")  # not UTF-8 text at all
    with pytest.raises(InputError, match="eval.json is corrupt"):
        check_settings(tmp_path, EvalSettings(model="tiny"))


def test_sample_examples_is_a_stable_prefix():
    xs = [QAExample(str(i), f"q{i}", ("a",)) for i in range(50)]
    assert sample_examples(xs, 10, 0) == sample_examples(xs, 20, 0)[:10]
    assert sample_examples(xs, 10, 0) != sample_examples(xs, 10, 1)
    assert sample_examples(xs, None, 0)[0] == sample_examples(xs, 1, 0)[0]


def test_evaluate_records_scores_and_resumes(runtime, tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    runs = [RunSpec("never", None), RunSpec("dtr", "bm25", (("tau", "0"),))]
    seen = []

    def stop_after_first_batch_of_dtr(run, stored):
        seen.append((run.key, stored))
        if run.method == "dtr" and stored >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        evaluate(runtime, runs, EXAMPLES, store, batch_size=2, progress=False, on_batch=stop_after_first_batch_of_dtr)
    assert seen == [("never", 2), ("never", 4), ("never", 5), ("dtr[tau=0,retriever=bm25]", 2)]
    first = {k: dict(v) for k, v in ResultsStore(store.path).records.items()}
    assert len(first) == 7
    rec = first[("never", "q2")]
    assert set(rec) >= {"run", "id", "method", "question", "answers", "answer", "retrieved", "passages", "lm_calls",
                        "retrieval_calls", "generated_tokens", "gate_steps", "timings", "model", "em", "f1", "acc",
                        "latency_s", "batch_size"}
    assert rec["answers"] == ["William Shakespeare", "Shakespeare"] and rec["question"] == "Who wrote Hamlet?"
    assert rec["model"] == "tiny" and rec["retriever"] is None and rec["retrieved"] is False
    # a new store (a new process) resumes: only the 3 missing dtr questions are answered
    seen.clear()
    store2 = ResultsStore(store.path)
    summaries = evaluate(runtime, runs, EXAMPLES, store2, batch_size=2, progress=False,
                         on_batch=lambda run, n: seen.append((run.key, n)))
    assert seen == [("dtr[tau=0,retriever=bm25]", 4), ("dtr[tau=0,retriever=bm25]", 5)]
    lines = store.path.read_text().splitlines()
    assert len(lines) == 10  # every (run, question) exactly once
    for key, rec in first.items():  # finished records were not redone
        assert store2.records[key] == rec
    never, dtr = summaries
    assert never.n == dtr.n == 5
    assert never.retrieval_rate == 0 and dtr.retrieval_rate == 1 and dtr.retrievals_per_q == 1
    for r in store2.records.values():
        assert r["acc"] >= r["em"]  # an exact match contains the gold answer


def test_resume_refuses_records_made_with_other_calibrated_values(runtime, tmp_path, monkeypatch):
    from fastgate.methods import calibration

    monkeypatch.setitem(calibration.CALIBRATED, "tiny", {"dtr": {"tau": 0.5}})
    store = ResultsStore(tmp_path / "results.jsonl")
    run = RunSpec("dtr", "bm25")
    evaluate(runtime, [run], EXAMPLES[:2], store, batch_size=2, progress=False)
    assert {r["params"]["tau"] for r in store.records.values()} == {0.5}  # each record keeps its values
    evaluate(runtime, [run], EXAMPLES[:3], ResultsStore(store.path), batch_size=2, progress=False)  # same values
    assert len(store.path.read_text().splitlines()) == 3
    monkeypatch.setitem(calibration.CALIBRATED, "tiny", {"dtr": {"tau": 0.9}})  # a recalibration
    before = store.path.read_bytes()
    with pytest.raises(InputError, match=r"made with tau=0\.5, but this run would use tau=0\.9"):
        evaluate(runtime, [run], EXAMPLES, ResultsStore(store.path), batch_size=2, progress=False)
    assert store.path.read_bytes() == before  # nothing appended under the old key
    # naming the value makes a run of its own, which resumes nothing
    [s] = evaluate(runtime, [RunSpec("dtr", "bm25", (("tau", 0.9),))], EXAMPLES[:2], ResultsStore(store.path),
                   batch_size=2, progress=False)
    assert s.n == 2
    # the CLI gives values as text: "0.9" is the same value and resumes the same run
    seen = []
    evaluate(runtime, [RunSpec("dtr", "bm25", (("tau", "0.9"),))], EXAMPLES[:3], ResultsStore(store.path),
             batch_size=2, progress=False, on_batch=lambda run, n: seen.append(n))
    assert seen == [3]


def _rewrite_params(path, edit) -> None:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        r["params"] = edit(r["params"])
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_resume_refuses_records_made_with_another_default(runtime, tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    run = RunSpec("dtr", "bm25")
    evaluate(runtime, [run], EXAMPLES[:2], store, batch_size=2, progress=False)
    [rec] = list(store.records.values())[:1]
    assert rec["params"]["pseudo_tokens"] == 64 and rec["params"]["k"] == 3  # the whole config, not just tau
    # records from a version whose default differed (a paper default changed under the same run key)
    _rewrite_params(store.path, lambda p: {**p, "pseudo_tokens": 32})
    before = store.path.read_bytes()
    with pytest.raises(InputError, match=r"made with pseudo_tokens=32, but this run would use pseudo_tokens=64"):
        evaluate(runtime, [run], EXAMPLES[:3], ResultsStore(store.path), batch_size=2, progress=False)
    assert store.path.read_bytes() == before
    # records written before the whole config was kept name only the calibrated values: they still resume
    _rewrite_params(store.path, lambda p: {"tau": p["tau"]})
    seen = []
    evaluate(runtime, [run], EXAMPLES[:3], ResultsStore(store.path), batch_size=2, progress=False,
             on_batch=lambda run, n: seen.append(n))
    assert seen == [3]


def test_window_answers_as_batches_do_and_counts_each_second_once(runtime, tmp_path, monkeypatch):
    """The sliding window (the default) gives the batches' answers; each record's wall share sums to the run's time;
    no more than ``batch_size`` questions are in flight."""
    from fastgate.scheduler import Scheduler

    runs = [RunSpec("never", None), RunSpec("dtr", "bm25", (("tau", "0.5"),))]
    batches = ResultsStore(tmp_path / "b.jsonl")
    evaluate(runtime, runs, EXAMPLES, batches, batch_size=2, progress=False, schedule="batches")
    in_flight, submit = [], Scheduler.submit

    def counting_submit(self, *args, **kwargs):
        in_flight.append(self.live + 1)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "submit", counting_submit)
    window, seen = ResultsStore(tmp_path / "w.jsonl"), []
    summaries = evaluate(runtime, runs, EXAMPLES, window, batch_size=2, progress=False,
                         on_batch=lambda run, n: seen.append((run.method, n)))
    assert seen == [("never", 2), ("never", 4), ("never", 5), ("dtr", 2), ("dtr", 4), ("dtr", 5)]
    assert len(in_flight) == 10 + 2 and max(in_flight) == 2  # each run's warm-up question, on a scheduler of its own
    for key, rec in window.records.items():
        assert rec["answer"] == batches.records[key]["answer"] and rec["gate_steps"] == batches.records[key][
            "gate_steps"]
        assert rec["schedule"] == "window" and batches.records[key]["schedule"] == "batches"
        assert 0 < rec["wall_s"] and 0 < rec["latency_s"]
    for s in summaries:
        walls = [window.records[(s.run, ex.id)]["wall_s"] for ex in EXAMPLES]
        assert s.s_per_q == pytest.approx(sum(walls) / len(walls))
    with pytest.raises(InputError, match="schedule must be one of"):
        evaluate(runtime, runs, EXAMPLES, window, batch_size=2, progress=False, schedule="stream")


def test_window_keeps_what_ended_and_refuses_another_schedule(runtime, tmp_path, monkeypatch):
    import fastgate.eval.runner as runner

    huge = QAExample("big", "word " * 5000, ("x",))
    store = ResultsStore(tmp_path / "r.jsonl")
    [s] = evaluate(runtime, [RunSpec("never", None)], [EXAMPLES[0], huge, EXAMPLES[1]], store, batch_size=3,
                   progress=False)
    recs = [store.records[("never", q)] for q in ("q1", "big", "q2")]
    assert recs[1]["wall_s"] == 0.0 and "error" in recs[1]  # a rejected question takes no share of the time
    assert s.errors == 1 and s.s_per_q == pytest.approx((recs[0]["wall_s"] + recs[2]["wall_s"]) / 2)
    # an interrupt keeps the records that ended before it
    real, made = runner._record, []

    def interrupted(*args, **kwargs):
        made.append(1)
        if len(made) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_record", interrupted)
    store2 = ResultsStore(tmp_path / "r2.jsonl")
    with pytest.raises(KeyboardInterrupt):
        evaluate(runtime, [RunSpec("never", None)], EXAMPLES, store2, batch_size=4, progress=False)
    assert len(ResultsStore(store2.path).records) == 1
    monkeypatch.setattr(runner, "_record", real)
    # the rest of the run under another schedule is refused; under its own it resumes
    with pytest.raises(InputError, match="--schedule window"):
        evaluate(runtime, [RunSpec("never", None)], EXAMPLES, ResultsStore(store2.path), batch_size=4,
                 progress=False, schedule="batches")
    evaluate(runtime, [RunSpec("never", None)], EXAMPLES, ResultsStore(store2.path), batch_size=4, progress=False)
    assert len(ResultsStore(store2.path).records) == len(EXAMPLES)


def test_summarize_counts_a_windowed_records_wall_share():
    recs = [_record(qid="a", wall_s=0.5, latency=3.0), _record(qid="b", wall_s=1.5, latency=1.0)]
    s = summarize(RunSpec("dtr", "dense"), recs)
    assert s.s_per_q == pytest.approx(1.0) and s.questions_per_s == pytest.approx(1.0)
    assert s.latency_p50_s == pytest.approx(2.0)  # the questions' own times in flight


def test_rejected_question_is_recorded_not_fatal(runtime, tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    huge = QAExample("big", "word " * 5000, ("x",))
    [s] = evaluate(runtime, [RunSpec("never", None)], [EXAMPLES[0], huge, EXAMPLES[1]], store, batch_size=3,
                   progress=False)
    assert s.n == 3 and s.errors == 1
    assert "too long" in store.records[("never", "big")]["error"]
    assert store.records[("never", "q1")]["lm_calls"] == 1


def test_summary_files_and_plot(tmp_path):
    a = summarize(RunSpec("never", None), [_record("never", qid="a", retrieved=False)])
    b = summarize(RunSpec("always", "bm25"), [_record("always", qid="a")])
    md, cs = write_summary(tmp_path, [a, b], header="2 questions")
    assert md.read_text().startswith("2 questions\n\n| run |")
    assert cs.read_text().splitlines()[0].startswith("run,method,n,em,f1,acc,retrieval_rate")
    png = plot_accuracy_vs_retrieval([a, b], tmp_path / "p.png", "test", line=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_qa_heldout_is_the_documented_split():
    import importlib.util

    from fastgate.eval.datasets import is_held_out

    if importlib.util.find_spec("fanoutqa") is None:
        pytest.skip("the fanoutqa data package is not installed")

    held = load_qa("heldout")
    assert held and all(is_held_out(e) for e in held)
    assert len(held) == sum(is_held_out(e) for e in load_qa("default"))


# ---------------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv,message", [
    (["eval", "--all", "--method", "dtr"], "either --method M or --all, not both"),
    (["eval", "--method", " , "], "names no method"),
    (["eval", "--method", "never,magic"], "unknown method 'magic'"),
    (["eval", "--method", "dtr,flare", "--sweep", "tau=1"], "--sweep takes one --method"),
    (["eval", "--method", "magic"], "unknown method 'magic'"),
    (["eval", "--all", "--sweep", "tau=1"], "--sweep takes one --method"),
    (["eval", "--method", "dtr", "--sweep", "tau"], "--sweep expects param=v1,v2"),
    (["eval", "--method", "dtr", "--sweep", "theta=1,2"], "unknown parameter"),
    (["eval", "--method", "dtr", "--n", "0"], "--n must be >= 1"),
    (["eval", "--method", "dtr", "--data", "nowhere"], "neither a built-in set"),
    # a name that is a path: it does not exist, in those words
    (["eval", "--method", "dtr", "--data", "nowhere.jsonl"], "--data nowhere.jsonl: no such file"),
    (["eval", "--method", "dtr", "--data", "/tmp/no/such/qa"], "--data /tmp/no/such/qa: no such file"),
    (["eval", "--method", "never", "--index", "/nonexistent"], "--index /nonexistent does not exist"),
    # the sweep's values replaced --param's silently
    (["eval", "--method", "dtr", "--sweep", "tau=0.3", "--param", "tau=0.5"],
     "--sweep tau=0.3 and --param tau=0.5 both set tau: give one"),
    (["eval", "--method", "dtr", "--batch-size", "0", "--out", "/nonexistent/never-made"], "--batch-size must be"),
    (["eval", "--method", "never", "--data", "nq:test", "--split", "dev"], "names split 'test' and --split says"),
])
def test_eval_cli_rejects_bad_input_before_loading(capsys, argv, message):
    from fastgate.entrypoints.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_eval_cli_sweep_writes_table_plot_and_resumes(capsys, monkeypatch, tmp_path, tiny, small_index):
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": e.question, "answers": list(e.answers)}) + "\n" for e in EXAMPLES))
    out = tmp_path / "out"
    common = ["--data", str(data), "--index", str(small_index), "--out", str(out), "--model", "tiny", "--quiet",
              "--batch-size", "2"]
    assert main(["eval", "--method", "never", *common]) == 0
    assert main(["eval", "--method", "dtr", "--retriever", "bm25", "--sweep", "tau=0,inf", *common]) == 0
    captured = capsys.readouterr()
    assert "| never | 5 |" in captured.out and "| dtr[tau=0,retriever=bm25] | 5 |" in captured.out
    assert (out / "sweep-dtr-tau.png").read_bytes()[:4] == b"\x89PNG"
    rows = (out / "summary.csv").read_text().splitlines()
    assert len(rows) == 4  # header + never + two sweep points
    assert len((out / "results.jsonl").read_text().splitlines()) == 15
    # rerunning finds everything done
    assert main(["eval", "--method", "never", *common]) == 0
    captured = capsys.readouterr()
    assert "resuming: 5/5 already done" in captured.err
    # the table still names the earlier runs with their parameters
    assert "| dtr[tau=0,retriever=bm25] | 5 |" in captured.out and "| dtr[tau=inf,retriever=bm25] | 5 |" in captured.out
    assert len((out / "results.jsonl").read_text().splitlines()) == 15
    # no --method: the baselines and the default gate, all resumed or answered in one invocation
    assert main(["eval", *common]) == 0
    captured = capsys.readouterr()
    assert "no --method: evaluating never, always, dtr" in captured.err
    assert "| always | 5 |" in captured.out and "| dtr | 5 |" in captured.out
    assert len((out / "results.jsonl").read_text().splitlines()) == 25  # never was done; always and dtr added
    # other settings in the same directory are refused
    assert main(["eval", "--method", "never", *common, "--seed", "4"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_every_calibrated_value_is_a_valid_config():
    from fastgate.methods import make_config
    from fastgate.methods.calibration import CALIBRATED, CPU_EVAL_BUDGET, calibrated_params

    assert set(CALIBRATED) >= {"smollm2-135m", "qwen2.5-0.5b"}
    for model, methods in CALIBRATED.items():
        for method in methods:
            for budget in ({}, CPU_EVAL_BUDGET.get(method, {})):
                params = calibrated_params(model, method, budget)
                config = make_config(method, params)
                for key, value in methods[method].items():
                    if key != "delta":  # SeaKR's δ depends on the sample count
                        assert getattr(config, key) == value
    # qwen2.5-0.5b's SeaKR δ is calibrated for the CPU budget's 3 samples
    assert calibrated_params("qwen2.5-0.5b", "seakr", {"samples": 3})["delta"] == 2.56


# ---------------------------------------------------------------------------------------------------- resume safety
def test_a_qa_file_with_a_repeated_id_is_refused_and_null_ids_are_line_numbers(tmp_path):
    """Records are keyed by id: a repeated one made three questions score as the last one's record."""
    from fastgate.errors import CorpusError

    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"id": "x", "question": q, "answers": [a]}) + "\n"
                            for q, a in [("capital of France?", "Paris"), ("capital of Germany?", "Berlin")]))
    with pytest.raises(CorpusError, match="qa.jsonl:2: id 'x' is also line 1's"):
        load_qa(path)
    path.write_text("".join(json.dumps({"id": None, "question": q, "answers": ["a"]}) + "\n" for q in ("a?", "b?")))
    assert [e.id for e in load_qa(path)] == ["qa-1", "qa-2"]  # not "None" twice


def test_sample_examples_refuses_a_count_below_one():
    with pytest.raises(InputError, match="positive integer"):
        sample_examples(EXAMPLES, -2)  # [:-2] answered all but the last two


def test_resume_refuses_records_of_another_question_or_corpus(runtime, tmp_path, small_corpus_file):
    """An edited --data file (an id now names another question) or another --index under the same --out would mix
    answers made for other questions or from other passages into one summary."""
    from fastgate.retrieval import build_indexes

    store = ResultsStore(tmp_path / "results.jsonl")
    run = RunSpec("dtr", "bm25", (("tau", "0"),))
    evaluate(runtime, [run], EXAMPLES[:2], store, batch_size=2, progress=False)
    assert len({r["corpus"] for r in store.records.values()}) == 1  # each record names the corpus it searched
    edited = [QAExample("q1", "What is the capital of Italy?", ("Rome",)), *EXAMPLES[1:3]]
    with pytest.raises(InputError, match="answered id q1 of dtr.* for the question 'What is the capital of France"):
        evaluate(runtime, [run], edited, store, batch_size=2, progress=False)
    other = tmp_path / "other.jsonl"
    other.write_text(small_corpus_file.read_text().replace("Seine", "Seine river"))
    build_indexes(other, tmp_path / "other-index", kinds=("bm25",), progress=False)
    elsewhere = Runtime("tiny", index=str(tmp_path / "other-index"), engine=runtime.engine)
    with pytest.raises(InputError, match="searched another corpus"):
        evaluate(elsewhere, [run], EXAMPLES[:3], store, batch_size=2, progress=False)
    legacy = ResultsStore(tmp_path / "legacy.jsonl")  # records from before they named it are not checked
    legacy.append([{k: v for k, v in r.items() if k != "corpus"} for r in store.records.values()])
    evaluate(elsewhere, [run], EXAMPLES[:3], ResultsStore(legacy.path), batch_size=2, progress=False)
    evaluate(runtime, [run], EXAMPLES[:3], store, batch_size=2, progress=False)  # the same corpus resumes


def test_out_that_is_a_file_or_settings_that_are_not_an_object_are_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file: an evaluation writes a directory"):
        check_settings(tmp_path / "file", EvalSettings(model="tiny"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "eval.json").write_text("[]")
    with pytest.raises(InputError, match="eval.json is corrupt .not a JSON object"):
        check_settings(tmp_path / "d", EvalSettings(model="tiny"))


def test_a_qa_file_may_start_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question": "a?", "answers": ["b"]}).encode() + b"\r\n")
    assert [e.question for e in load_qa(path)] == ["a?"]


# ---------------------------------------------------------------------------------------------------- review fixes
def _retag(path, **fields) -> None:
    """Rewrite every record of ``path`` with ``fields`` (e.g. made in another dtype)."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, **fields}) + "\n" for r in recs))


def test_every_run_is_checked_before_any_run_answers(runtime, tmp_path):
    """`--method flare,never` under another dtype answered flare's questions, then refused never's records: the
    directory was left with records of two dtypes."""
    store = ResultsStore(tmp_path / "results.jsonl")
    evaluate(runtime, [RunSpec("never", None)], EXAMPLES[:2], store, batch_size=2, progress=False)
    _retag(store.path, dtype="bfloat16")
    before = store.path.read_bytes()
    with pytest.raises(InputError, match="run 'never'.*weights in bfloat16, but this run would use float32"):
        evaluate(runtime, [RunSpec("always", "bm25"), RunSpec("never", None)], EXAMPLES[:2],
                 ResultsStore(store.path), batch_size=2, progress=False)
    assert store.path.read_bytes() == before  # always answered nothing


def test_one_out_holds_one_model_engine_dtype_and_weights(runtime, tmp_path):
    from fastgate.eval.runner import check_form

    store = ResultsStore(tmp_path / "results.jsonl")
    evaluate(runtime, [RunSpec("never", None)], EXAMPLES[:2], store, batch_size=2, progress=False)
    check_form(ResultsStore(store.path), runtime)  # its own records: fine
    for fields, message in [({"dtype": "bfloat16"}, r"made with the weights in bfloat16 \(run 'never', e\.g\. "
                             r"question q1\), but this evaluation would use float32.*pass --dtype bfloat16"),
                            ({"weights": "int8"}, "made with int8 weights .*pass --weights int8"),
                            ({"engine": "openai:http://x/v1:m"}, "made on the engine openai:http://x/v1:m"),
                            # records of another model without their eval.json were adopted, labelled as this one's
                            ({"model": "smollm2-135m"}, "made by the model smollm2-135m .*pass --model smollm2-135m")]:
        _retag(store.path, **{"dtype": "float32", "weights": "float", "engine": "local", "model": "tiny", **fields})
        with pytest.raises(InputError, match=message):
            check_form(ResultsStore(store.path), runtime)


def test_the_form_check_loads_no_model_and_reaches_no_server(monkeypatch, tmp_path):
    """The model check read runtime.model_name, which loads the model (a resumed, finished evaluation loaded it for
    nothing) or connects to the remote server (down: the resume failed)."""
    import fastgate.assets.models as models
    from fastgate.engine.remote import RemoteConfig
    from fastgate.eval.runner import check_form
    from fastgate.serving.runtime import Runtime

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", no_load)
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"run": "never", "id": "q1", "model": "smollm2-135m", "dtype": "float32",
                                "weights": "float", "engine": "local"}) + "\n")
    local = Runtime("smollm2-135m", "cpu", dtype="float32", weights="float")
    check_form(ResultsStore(path), local)
    assert not local.loaded
    remote = Runtime("x", "cpu", remote=RemoteConfig("http://127.0.0.1:9/v1", "m"))  # nothing listens there
    path.write_text(json.dumps({"run": "never", "id": "q1", "model": "other", "engine": remote.engine_name}) + "\n")
    with pytest.raises(InputError, match="made by the model other .*pass --api-model other"):
        check_form(ResultsStore(path), remote)


def test_eval_cli_refuses_a_run_of_another_dtype_beside_the_others(eval_cli, capsys):
    """A finished `never` in bf16, then `always` in float32 into the same --out: refused before always answers, and
    a later summary never tables both."""
    out, run = eval_cli
    assert run("--method", "never") == 0
    _retag(out / "results.jsonl", dtype="bfloat16")
    before = (out / "results.jsonl").read_bytes()
    capsys.readouterr()
    assert run("--method", "always") == 2
    err = capsys.readouterr().err
    assert "holds records made with the weights in bfloat16 (run 'never'" in err and "Traceback" not in err
    assert (out / "results.jsonl").read_bytes() == before


def test_each_run_warms_up_untimed_before_its_clock_starts(runtime, tmp_path, monkeypatch):
    """The first run of an invocation was charged the engine's first-use work (never: 0.235 s a question first,
    0.020 s after always): each run with questions left answers one of them first, unrecorded, before its clock."""
    import fastgate.eval.runner as runner
    from fastgate.scheduler import Scheduler

    events, submit = [], Scheduler.submit
    window, batch = runner._answer_window, runner._answer_batch

    def spy_submit(self, method, question, *args, **kwargs):
        events.append(("answer", method, question))
        return submit(self, method, question, *args, **kwargs)

    def spy_window(method, *args, **kwargs):
        events.append(("clock", method, None))
        return window(method, *args, **kwargs)

    def spy_batch(method, *args, **kwargs):
        events.append(("clock", method, None))
        return batch(method, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "submit", spy_submit)
    monkeypatch.setattr(runner, "_answer_window", spy_window)
    monkeypatch.setattr(runner, "_answer_batch", spy_batch)
    store = ResultsStore(tmp_path / "w.jsonl")
    evaluate(runtime, [RunSpec("never", None)], EXAMPLES[:3], store, batch_size=2, progress=False)
    assert [e[0] for e in events] == ["answer", "clock", "answer", "answer", "answer"]
    (_, warm, question), (_, timed, _) = events[:2]
    assert question == EXAMPLES[0].question and warm is not timed  # the run's first question, on a method of its own
    assert all(e[1] is timed for e in events[2:])
    assert len(store.path.read_text().splitlines()) == 3  # the warm-up is not recorded
    events.clear()  # nothing left to answer: nothing warms up
    evaluate(runtime, [RunSpec("never", None)], EXAMPLES[:3], ResultsStore(store.path), batch_size=2, progress=False)
    assert events == []
    evaluate(runtime, [RunSpec("never", None)], EXAMPLES[:3], ResultsStore(tmp_path / "b.jsonl"), batch_size=2,
             progress=False, schedule="batches")
    assert [e[0] for e in events] == ["answer", "clock", "answer", "answer", "clock", "answer"]
    events.clear()  # a pass read for its answers only (training, calibration) is not timed: no warm-up
    evaluate(runtime, [RunSpec("never", None)], EXAMPLES[:2], ResultsStore(tmp_path / "t.jsonl"), batch_size=2,
             progress=False, timed=False)
    assert [e[0] for e in events] == ["clock", "answer", "answer"]


def test_resume_refuses_records_scored_against_other_gold_answers(runtime, tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    run = RunSpec("never", None)
    evaluate(runtime, [run], EXAMPLES[:2], store, batch_size=2, progress=False)
    corrected = [QAExample("q1", EXAMPLES[0].question, ("Paris", "Paris, France")), EXAMPLES[1]]
    with pytest.raises(InputError, match=r"scored question q1 of never against the gold answers \['Paris'\], but "
                                         r"the data now gives \['Paris', 'Paris, France'\].*new --out"):
        evaluate(runtime, [run], corrected, ResultsStore(store.path), batch_size=2, progress=False)
    reordered = [EXAMPLES[0], QAExample("q2", EXAMPLES[1].question, tuple(reversed(EXAMPLES[1].answers)))]
    evaluate(runtime, [run], reordered, ResultsStore(store.path), batch_size=2, progress=False)  # the same golds


def test_a_finished_run_is_not_summarised_for_another_corpus(runtime, tmp_path, small_corpus_file):
    from fastgate.retrieval import build_indexes

    store = ResultsStore(tmp_path / "results.jsonl")
    run = RunSpec("always", "bm25")
    evaluate(runtime, [run], EXAMPLES[:2], store, batch_size=2, progress=False)
    other = tmp_path / "other.jsonl"
    other.write_text(small_corpus_file.read_text().replace("Seine", "Seine river"))
    build_indexes(other, tmp_path / "other-index", kinds=("bm25",), progress=False)
    elsewhere = Runtime("tiny", index=str(tmp_path / "other-index"), engine=runtime.engine)
    with pytest.raises(InputError, match="searched another corpus"):  # nothing left to answer: checked all the same
        evaluate(elsewhere, [run], EXAMPLES[:2], ResultsStore(store.path), batch_size=2, progress=False)


def test_settings_without_records_beside_them_are_replaced(tmp_path):
    """A mistyped --model wrote eval.json before it failed; the corrected command was refused ("other settings")."""
    check_settings(tmp_path, EvalSettings(model="nosuch"))
    check_settings(tmp_path, EvalSettings(model="tiny"))
    assert json.loads((tmp_path / "eval.json").read_text())["model"] == "tiny"


def test_eval_cli_after_a_mistyped_model_runs_the_corrected_command(eval_cli, capsys, monkeypatch):
    import fastgate.assets.models
    from fastgate.errors import UnknownNameError

    def load(name, *args, **kwargs):  # as the real one: neither an embedded name nor a directory
        raise UnknownNameError("model", name, ["smollm2-135m"])

    out, run = eval_cli
    with monkeypatch.context() as m:
        m.setattr(fastgate.assets.models, "load", load)
        assert run("--method", "never", model="nosuch") == 2
    assert "unknown model 'nosuch'" in capsys.readouterr().err
    assert not out.exists()  # checked before --out is made (it left DIR/eval.json and DIR/.lock behind)
    (out / "eval.json").parent.mkdir()  # an eval.json left by an earlier version is replaced
    (out / "eval.json").write_text(json.dumps({"model": "nosuch"}))
    assert run("--method", "never") == 0
    assert "| never | 3 |" in capsys.readouterr().out


def test_eval_cli_holds_out_while_it_runs(eval_cli, capsys, monkeypatch):
    """Two evaluations into one --out answered every question twice: the second is refused in one line."""
    import fcntl
    import os

    import fastgate.eval.runner as runner

    out, run = eval_cli
    out.mkdir()
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242\n")
        assert run("--method", "never") == 2
        err = capsys.readouterr().err
        assert f"fastgate: error: {out} is in use by another fastgate eval (pid 4242)" in err
        assert len(err.strip().splitlines()) == 1 and not (out / "results.jsonl").exists()
    finally:
        os.close(fd)
    # released at the end, after an error and after an interrupt too: another can take it each time
    assert run("--method", "never") == 0
    assert run("--method", "never", "--seed", "3") == 2  # other settings: refused inside the lock
    assert "other settings" in capsys.readouterr().err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "evaluate", interrupted)  # the CLI imports it from the runner when it runs
    assert run("--method", "always") == 130
    fd = os.open(out / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free
    finally:
        os.close(fd)


@pytest.mark.parametrize("make", ["a file above", "no such place"])
def test_eval_cli_out_that_cannot_be_made_is_one_line(eval_cli, capsys, monkeypatch, tmp_path, make):
    from pathlib import Path

    _, run = eval_cli
    if make == "a file above":
        (tmp_path / "afile").write_text("x")
        out, why = tmp_path / "afile" / "sub", "a part of its path is a file"
    else:  # /proc/x: the file system takes no directory there
        import errno

        out, why = tmp_path / "proc" / "x", "no such file or directory"

        def refused(self, *args, **kwargs):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(self))

        monkeypatch.setattr(Path, "mkdir", refused)
    assert run("--method", "never", out=out) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"fastgate: error: --out {out}: cannot create the directory ({why})"


@pytest.fixture()
def eval_cli(monkeypatch, tmp_path, tiny, small_index):
    """``run(*flags, out=..., model=...)``: `fastgate eval` on three questions with the tiny model (the default --out:
    ``tmp_path/out``, returned beside it)."""
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": e.question, "answers": list(e.answers)}) + "\n"
                            for e in EXAMPLES[:3]))
    default = tmp_path / "out"

    def run(*flags: str, out=default, model="tiny") -> int:
        return main(["eval", "--data", str(data), "--index", str(small_index), "--out", str(out), "--model", model,
                     "--quiet", "--batch-size", "2", *flags])

    return default, run


def test_eval_header_says_how_the_records_were_answered(eval_cli, capsys):
    """The header named this invocation's flags: a rerun of a finished DIR with --batch-size 1 said "window 1" of
    records answered with 2, and --schedule batches "batch 32"."""
    out, run = eval_cli
    assert run("--method", "never") == 0  # the fixture's --batch-size 2
    assert "window 2;" in (out / "summary.md").read_text().splitlines()[0]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["in_flight"] for r in records} == {2}
    for flags in (("--batch-size", "1"), ("--schedule", "batches"), ("--schedule", "batches", "--batch-size", "7")):
        capsys.readouterr()
        assert run("--method", "never", *flags) == 0, flags  # nothing to answer: only summarised
        first = (out / "summary.md").read_text().splitlines()[0]
        assert "window 2;" in first and "window 1" not in first and "batch" not in first.split("budget")[1], flags
    # a run with questions left resumes only under its records' batch size, as under their schedule
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    capsys.readouterr()
    assert run("--method", "never", "--batch-size", "1") == 2
    err = capsys.readouterr().err
    assert "were answered with --batch-size 2, but this run would use 1: pass --batch-size 2" in err
    assert len((out / "results.jsonl").read_text().splitlines()) == 2  # nothing answered
    # runs answered otherwise beside each other: each way with its runs
    assert run("--method", "always", "--schedule", "batches", "--batch-size", "3") == 0
    assert run("--method", "never") == 0
    first = (out / "summary.md").read_text().splitlines()[0]
    assert "window 2 (never) and batch 3 (always);" in first


def test_schedule_line_of_records_from_before_they_named_their_batch_size():
    from fastgate.eval.runner import schedule_line

    assert schedule_line([{"run": "a", "schedule": "window", "in_flight": 8}]) == "window 8"
    # answered in batches (no schedule named): the largest batch; a window's groups are not its size
    legacy = [{"run": "a", "batch_size": 16}, {"run": "a", "batch_size": 4}]
    assert schedule_line(legacy) == "batch 16"
    assert schedule_line([{"run": "b", "schedule": "window", "batch_size": 5}]) == "window"
    mixed = [*legacy, {"run": "b", "schedule": "window", "in_flight": 2}]
    assert schedule_line(mixed) == "window 2 (b) and batch 16 (a)"
    assert schedule_line([]) == ""


def test_eval_without_matplotlib_writes_its_tables_and_says_no_plot(capsys, monkeypatch, tmp_path, tiny, small_index):
    """The sweep's and --all's plots stopped the command (rc 2) after the tables where matplotlib is missing; the
    cost and gate-quality plots were already skipped with a word."""
    import sys

    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, device="auto", **kw: tiny)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": e.question, "answers": list(e.answers)}) + "\n" for e in EXAMPLES))
    out = tmp_path / "out"
    common = ["--data", str(data), "--index", str(small_index), "--out", str(out), "--model", "tiny", "--quiet",
              "--batch-size", "2"]
    assert main(["eval", "--method", "dtr", "--retriever", "bm25", "--sweep", "tau=0,inf", *common]) == 0
    captured = capsys.readouterr()
    assert "no plot: plots need matplotlib" in captured.err and "| dtr[tau=0,retriever=bm25] | 5 |" in captured.out
    assert (out / "summary.csv").is_file() and not list(out.glob("*.png"))
