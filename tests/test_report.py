"""The report of `fastgate eval` (fastgate.eval.report): the time-matched coin worked out by hand, the oracle point,
the cost section, always answered again at the end of an invocation, and why a lone gate has no coin section."""

from __future__ import annotations

import json
import math

import pytest

from fastgate.errors import InputError
from fastgate.eval.report import NO_COIN, oracle_point, time_matched_coin


def _recs(accs, run="r"):
    return {f"q{i}": {"run": run, "id": f"q{i}", "acc": float(a)} for i, a in enumerate(accs)}


NEVER, ALWAYS, GATED = _recs([0, 0, 1, 0]), _recs([1, 1, 1, 0]), _recs([1, 0, 1, 0])
IDS = ["q0", "q1", "q2", "q3"]


def test_time_matched_coin_by_hand():
    t = time_matched_coin(GATED, NEVER, ALWAYS, IDS, s_run=0.6, s_never=0.1, s_always=[1.0, 1.2], run="g")
    # always costs the mean of its two passes, 1.1 s: p = (0.6 - 0.1) / (1.1 - 0.1) = 0.5
    assert t.always_s == pytest.approx(1.1) and t.share == pytest.approx(0.5)
    # per question the coin scores 0.5, 0.5, 1, 0 (mean 0.5); the run 1, 0, 1, 0: differences 0.5, -0.5, 0, 0
    assert t.coin_acc == pytest.approx(0.5) and t.acc == pytest.approx(0.5) and t.diff == pytest.approx(0.0)
    assert t.diff_se == pytest.approx(math.sqrt(0.5 / 3) / 2)
    assert t.coin_se == pytest.approx(math.sqrt(0.5 / 3) / 2)  # deviations 0, 0, 0.5, -0.5 from 0.5
    assert t.p_value == pytest.approx(1.0) and t.always_passes == (1.0, 1.2)
    # a run dearer than always is matched with always, a run cheaper than never with never (p clipped to [0, 1])
    dear = time_matched_coin(GATED, NEVER, ALWAYS, IDS, s_run=3.0, s_never=0.1, s_always=[1.1])
    assert dear.share == 1.0 and dear.coin_acc == pytest.approx(0.75) and dear.diff == pytest.approx(-0.25)
    cheap = time_matched_coin(GATED, NEVER, ALWAYS, IDS, s_run=0.05, s_never=0.1, s_always=[1.1])
    assert cheap.share == 0.0 and cheap.diff == pytest.approx(0.25)
    # ... and the table says so: the clipped share alone read as a coin that had cost what the run cost
    from fastgate.eval.report import time_matched_section

    assert dear.unclipped == pytest.approx(2.9) and "100.0% (costs 290%)" in time_matched_section([dear])
    assert "0.0% (costs -5%)" in time_matched_section([cheap])
    assert "(costs" not in time_matched_section([t])
    assert 0 < cheap.p_value < 1 and cheap.p_value == pytest.approx(math.erfc(0.25 / cheap.diff_se / math.sqrt(2)))
    # a gate that beats the coin clearly on many questions has a small p
    many = 50
    never, always = _recs([0, 1] * many), _recs([1, 1] * many)
    gated = _recs([1, 1] * many)
    ids = list(never)
    sharp = time_matched_coin(gated, never, always, ids, s_run=0.2, s_never=0.1, s_always=[1.1])
    assert sharp.share == pytest.approx(0.1) and sharp.diff == pytest.approx(0.45) and sharp.p_value < 1e-6
    with pytest.raises(InputError, match="no question"):
        time_matched_coin(GATED, NEVER, ALWAYS, ["zz"], s_run=0.6, s_never=0.1, s_always=[1.1])
    # always no dearer than never: no coin can be matched
    assert math.isnan(time_matched_coin(GATED, NEVER, ALWAYS, IDS, s_run=0.6, s_never=1.0, s_always=[1.0]).share)


def test_oracle_reads_only_where_reading_fixes_the_answer():
    o = oracle_point(NEVER, ALWAYS, IDS, 0.1, 1.1)
    assert o.rate == pytest.approx(0.5) and o.acc == pytest.approx(0.75) and o.s_per_q == pytest.approx(0.6)
    assert oracle_point(NEVER, ALWAYS, IDS + ["q0", "q0"], 0.1, 1.1) == o  # a question counted once


def test_no_p_where_the_paired_differences_do_not_vary():
    """Two questions, each +1 over the coin: the SE is 0 and the normal approximation said p 0."""
    gated, never, always = _recs([1, 1]), _recs([0, 0]), _recs([0, 0])
    t = time_matched_coin(gated, never, always, ["q0", "q1"], s_run=0.5, s_never=0.1, s_always=[1.1])
    assert t.diff == 1.0 and t.diff_se == 0.0 and math.isnan(t.p_value)


def test_metrics_skip_a_gold_that_normalises_to_nothing():
    from fastgate.eval.metrics import accuracy, exact_match

    assert exact_match("", ["*"]) == 0.0 and exact_match("*", ["*", "Paris"]) == 0.0  # SQuAD's rule said 1
    assert exact_match("the Paris.", ["*", "Paris"]) == 1.0 and accuracy("*", ["*"]) == 0.0
    assert accuracy("Sir Miles Davis", ["M"]) == 0.0 and accuracy("It was 12", ["2"]) == 0.0  # whole words


def test_a_permutation_p_at_its_floor_prints_as_a_bound():
    from fastgate.eval.gate_quality import _perm

    class G:
        n_permutations, perm_p = 10_000, 1 / 10_001

    assert _perm(G) == "≤ 1e-04"
    G.perm_p = 0.03
    assert _perm(G) == "0.03"


@pytest.fixture()
def eval_cli(monkeypatch, tmp_path, tiny, small_index):
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, *args, **kwargs: tiny)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in (
        ("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "Shakespeare"),
        ("What is the largest planet?", "Jupiter"))))

    def run(out, *extra: str) -> int:
        return main(["eval", "--data", str(data), "--index", str(small_index), "--out", str(out), "--model", "tiny",
                     "--quiet", "--batch-size", "4", *extra])

    return run


def test_a_lone_gate_says_why_there_is_no_coin_section(eval_cli, capsys, tmp_path):
    out = tmp_path / "alone"
    assert eval_cli(out, "--method", "dtr") == 0
    captured = capsys.readouterr()
    for text in (captured.out, (out / "summary.md").read_text()):
        assert "No coin section" in text and "`never` and `always`" in text and "beat a coin" not in text
        assert "## What each run cost" in text
    assert "No coin section" in captured.err
    doc = json.loads((out / "summary.json").read_text())
    assert doc["no_coin"] == NO_COIN and doc["coin"] == [] and doc["time_matched"] == []
    assert doc["runs"][0]["s_per_q"] > 0 and doc["runs"][0]["invocations"] == 1
    assert not (out / "always-again.jsonl").exists() and not (out / "cost.png").exists()


def test_one_invocation_times_always_twice_and_matches_a_coin_on_time(eval_cli, capsys, tmp_path):
    out = tmp_path / "three"
    assert eval_cli(out, "--method", "never,always,dtr") == 0
    captured = capsys.readouterr()
    assert "answering always again" in captured.err
    summary = (out / "summary.md").read_text()
    for text in (captured.out, summary):
        assert "| always (again, at the end) |" in text and "### Against a coin matched on time" in text
        assert "s/question" in text and "prompt tokens/q" in text
    again = [json.loads(line) for line in (out / "always-again.jsonl").read_text().splitlines()]
    first = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(again) == 3 and len(first) == 9  # the second pass never mixes into the records
    assert len({r["invocation"] for r in first + again}) == 1
    assert [r["answer"] for r in again] == [r["answer"] for r in first if r["run"] == "always"]
    doc = json.loads((out / "summary.json").read_text())
    (tm,) = doc["time_matched"]
    runs = {r["run"]: r for r in doc["runs"]}
    assert tm["run"] == "dtr" and tm["one_sitting"] is True
    assert tm["always_passes"] == pytest.approx([runs["always"]["s_per_q"], doc["always_again"]["s_per_q"]])
    assert tm["always_s"] == pytest.approx(sum(tm["always_passes"]) / 2)
    span = tm["always_s"] - runs["never"]["s_per_q"]
    if span > 0:
        share = (runs["dtr"]["s_per_q"] - runs["never"]["s_per_q"]) / span
        assert tm["share"] == pytest.approx(min(1.0, max(0.0, share)))
    else:  # three tiny-model questions on a busy machine: always may time no dearer than never, p is undefined
        assert tm["share"] is None
    assert runs["always"]["prompt_tokens_per_q"] > runs["never"]["prompt_tokens_per_q"] > 0
    assert doc["oracle"] is not None and len(doc["coin"]) == 1
    assert (out / "cost.png").read_bytes()[:4] == b"\x89PNG"
    # a rerun answers nothing: always is not timed again, and the report is the same figures
    assert eval_cli(out, "--method", "never,always,dtr") == 0
    assert "answering always again" not in capsys.readouterr().err
    assert len((out / "always-again.jsonl").read_text().splitlines()) == 3
    # re-rendered by an invocation of one run (`--method never`): the second pass on disk is still read (it was
    # dropped, and the time-matched coin moved with it)
    assert eval_cli(out, "--method", "never") == 0
    capsys.readouterr()
    again_doc = json.loads((out / "summary.json").read_text())
    assert again_doc["always_again"]["s_per_q"] == pytest.approx(doc["always_again"]["s_per_q"])
    assert again_doc["time_matched"][0]["always_passes"] == pytest.approx(tm["always_passes"])
    assert "| always (again, at the end) |" in (out / "summary.md").read_text()


def test_a_baseline_whose_timing_holds_outliers_is_flagged():
    """gain-nq-balanced400's `never` spent 87% of its wall time in three batches of 27-39 s (against ~1.5 s), and its
    report led with a coin priced on it without a word. A baseline does the same work for every question: time in
    questions over 10x its median is the machine's, flagged in the cost section."""
    from fastgate.eval.report import cost_section
    from fastgate.eval.runner import RunSpec, summarize

    steady = [_full("never", f"q{i}", 0, False, latency=1.0) for i in range(20)]
    busy = [_full("never", f"q{i}", 0, False, latency=30.0 if i < 3 else 1.0) for i in range(20)]
    dtr = [_full("dtr", f"q{i}", 0, i < 3, latency=30.0 if i < 3 else 1.0) for i in range(20)]  # gated: its work
    quiet, noisy, gated = (summarize(RunSpec(r[0]["method"], None), r) for r in (steady, busy, dtr))
    assert quiet.slow_share == 0.0 and noisy.slow_share == pytest.approx(90 / 107) and gated.slow_share > 0.2
    assert "timing is suspect" not in cost_section([quiet, gated], None)  # a gated run's reads are its work
    text = cost_section([noisy], None)
    assert "**never's timing is suspect**: 84% of its wall time" in text and "over 10 times its median" in text


def _full(run, qid, acc, retrieved, *, method=None, retriever="bm25", params=None, latency=1.0, score=None):
    rec = {"run": run, "id": qid, "method": method or run.split("[")[0], "answer": "x", "acc": float(acc),
           "em": float(acc), "f1": float(acc), "retrieved": retrieved, "retrieval_calls": int(retrieved),
           "lm_calls": 1, "generated_tokens": 3, "prompt_tokens": 400 if retrieved else 80, "latency_s": latency,
           "batch_size": 1, "timings": {"total_s": latency}, "retriever": retriever, "params": params or {},
           "invocation": "inv-1", "gate_steps": []}
    if score is not None:
        rec["gate_steps"] = [{"gate": "g", "score": score, "threshold": 0.5, "retrieve": retrieved}]
    return rec


def test_a_run_reading_dense_passages_is_measured_against_always_reading_dense(tmp_path, capsys, monkeypatch):
    import fastgate.eval.report as report
    from fastgate.eval.datasets import QAExample
    from fastgate.eval.report import write_report
    from fastgate.eval.runner import ResultsStore, RunSpec

    plotted, real_plot = {}, report.plot_cost

    def spy(*args, **kwargs):
        plotted.update(kwargs)
        return real_plot(*args, **kwargs)

    monkeypatch.setattr(report, "plot_cost", spy)

    examples = [QAExample(f"q{i}", f"question {i}?", ("a",)) for i in range(4)]
    store = ResultsStore(tmp_path / "results.jsonl")
    recs = []
    for i, ex in enumerate(examples):
        recs += [_full("never", ex.id, i == 3, False, latency=0.1),
                 _full("always", ex.id, i in (0, 3), True, latency=1.0),
                 _full("always[retriever=dense]", ex.id, i in (1, 2, 3), True, retriever="dense", latency=2.0),
                 _full("read[features=dense]", ex.id, i in (1, 3), i == 1, params={"features": "dense"},
                       latency=0.5, score=1.0 if i == 1 else 0.0),
                 _full("flare", ex.id, i in (0, 3), i == 0, latency=0.5, score=1.0 if i == 0 else 0.0)]
    store.append(recs)
    write_report(tmp_path, store, examples, [RunSpec("never", None)], [], header="h")
    text = (tmp_path / "summary.md").read_text()
    assert "| read[features=dense] (vs always[retriever=dense]) |" in text and "| flare |" in text
    doc = json.loads((tmp_path / "summary.json").read_text())
    coins = {c["run"]: c for c in doc["coin"]}
    # against dense always (right on q1, q2, q3, not BM25's q0 and q3): reading q1 is what the oracle does at that rate
    assert coins["read[features=dense]"]["always_acc"] == pytest.approx(0.75)
    assert coins["read[features=dense]"]["oracle_acc"] == pytest.approx(0.5)
    assert coins["read[features=dense]"]["replay_acc"] == pytest.approx(0.5)
    assert coins["flare"]["always_acc"] == pytest.approx(0.5) and coins["flare"]["acc"] == pytest.approx(0.5)
    timed = {t["run"]: t for t in doc["time_matched"]}
    dense = timed["read[features=dense] (vs always[retriever=dense])"]
    assert dense["always_passes"] == [2.0] and dense["share"] == pytest.approx(0.4 / 1.9)
    assert timed["flare"]["always_passes"] == [1.0] and timed["flare"]["share"] == pytest.approx(0.4 / 0.9)
    assert timed["flare"]["one_sitting"] is True
    assert plotted["dense"] == (2.0, pytest.approx(0.75))  # cost.png draws the line the dense run's coin lies on
    capsys.readouterr()


def test_summary_cost_fields():
    from fastgate.eval.runner import RunSpec, markdown_table, summarize

    recs = [_full("read", "q0", 1, True, latency=2.0), _full("read", "q1", 0, False, latency=2.0)]
    for r in recs:
        r["batch_size"] = 2  # one batch of two questions in 2 s
    s = summarize(RunSpec("read", "bm25"), recs)
    assert s.s_per_q == pytest.approx(1.0) and s.questions_per_s == pytest.approx(1.0)
    assert s.prompt_tokens_per_q == pytest.approx(240) and s.invocations == 1
    assert "| s/question |" in markdown_table([s]) and "| prompt tokens/q |" in markdown_table([s])
    recs[1]["invocation"] = "inv-2"
    assert summarize(RunSpec("read", "bm25"), recs).invocations == 2
    del recs[1]["invocation"]  # a record from before records named their invocation: a sitting of its own
    assert summarize(RunSpec("read", "bm25"), recs).invocations == 2
    for r in recs:
        r.pop("invocation", None)
    assert summarize(RunSpec("read", "bm25"), recs).invocations == 0


def _coin_store(tmp_path):
    """never, always and a gated flare on four questions, all answered by invocation inv-1."""
    from fastgate.eval.datasets import QAExample
    from fastgate.eval.runner import ResultsStore

    examples = [QAExample(f"q{i}", f"question {i}?", ("a",)) for i in range(4)]
    store = ResultsStore(tmp_path / "results.jsonl")
    store.append([rec for i, ex in enumerate(examples) for rec in (
        _full("never", ex.id, i == 3, False, latency=0.1), _full("always", ex.id, i in (0, 3), True, latency=1.0),
        _full("flare", ex.id, i in (0, 3), i == 0, latency=0.5, score=1.0 if i == 0 else 0.0))])
    return examples, store


def test_a_second_pass_of_always_over_two_invocations_is_not_one_sitting(tmp_path, capsys):
    """always's second pass cut short and finished by a later invocation: the coin pays its timing, so the coin was
    not timed in one sitting (it said "yes")."""
    from fastgate.eval.report import AGAIN_FILE, write_report
    from fastgate.eval.runner import ResultsStore, RunSpec, summarize

    examples, store = _coin_store(tmp_path)
    again = ResultsStore(tmp_path / AGAIN_FILE)
    again.append([{**_full("always", ex.id, i in (0, 3), True, latency=1.2), "invocation": f"inv-{1 + (i > 1)}"}
                  for i, ex in enumerate(examples)])
    second = summarize(RunSpec("always", "bm25"), [again.records[("always", ex.id)] for ex in examples])
    write_report(tmp_path, store, examples, [RunSpec("flare", "bm25")], [], header="h", again=second)
    doc = json.loads((tmp_path / "summary.json").read_text())
    (tm,) = doc["time_matched"]
    assert tm["always_passes"] == [1.0, 1.2] and tm["one_sitting"] is False
    summary = (tmp_path / "summary.md").read_text()
    assert "| always (again, at the end) | 1.200 | 2 invocations |" in summary
    assert "second pass was answered over 2 invocations" in summary and "not from one sitting" in summary
    # the same pass in one invocation is one sitting
    again.path.unlink()
    again = ResultsStore(tmp_path / AGAIN_FILE)
    again.append([_full("always", ex.id, i in (0, 3), True, latency=1.2) for i, ex in enumerate(examples)])
    second = summarize(RunSpec("always", "bm25"), [again.records[("always", ex.id)] for ex in examples])
    write_report(tmp_path, store, examples, [RunSpec("flare", "bm25")], [], header="h", again=second)
    assert json.loads((tmp_path / "summary.json").read_text())["time_matched"][0]["one_sitting"] is True
    assert "second pass was answered over" not in (tmp_path / "summary.md").read_text()
    capsys.readouterr()


def test_the_summary_never_tables_records_of_two_dtypes(tmp_path, capsys):
    from fastgate.eval.report import write_report
    from fastgate.eval.runner import ResultsStore, RunSpec

    examples, store = _coin_store(tmp_path)
    lines = [json.loads(line) for line in store.path.read_text().splitlines()]
    store.path.write_text("".join(json.dumps({**r, "dtype": "float32" if r["run"] == "flare" else "bfloat16"}) + "\n"
                                  for r in lines))
    with pytest.raises(InputError, match=r"more than one dtype: bfloat16 \(run 'never', e\.g\. question q0\), "
                                         r"float32 \(run 'flare'"):
        write_report(tmp_path, ResultsStore(store.path), examples, [RunSpec("never", None)], [], header="h")
    assert not (tmp_path / "summary.md").exists()
    capsys.readouterr()


def test_baselines_given_the_invocations_parameters_are_the_baselines(eval_cli, capsys, tmp_path):
    """`--method never,always,dtr --param k=2` named the runs never[k=2] and always[k=2], then found no `never` or
    `always` (exact keys): no coin section, no second always pass."""
    out = tmp_path / "k2"
    assert eval_cli(out, "--method", "never,always,dtr", "--param", "k=2") == 0
    captured = capsys.readouterr()
    assert "answering always[k=2] again" in captured.err and "No coin section" not in captured.err
    summary = (out / "summary.md").read_text()
    assert "## Do the gates beat a coin?" in summary and "### Against a coin matched on time" in summary
    assert "The baselines are `never[k=2]` and `always[k=2]`" in summary
    assert "| always[k=2] (again, at the end) |" in summary
    again = [json.loads(line) for line in (out / "always-again.jsonl").read_text().splitlines()]
    assert [r["run"] for r in again] == ["always[k=2]"] * 3 and {r["params"]["k"] for r in again} == {2}
    doc = json.loads((out / "summary.json").read_text())
    assert [c["run"] for c in doc["coin"]] == ["dtr[k=2]"] and doc["time_matched"][0]["run"] == "dtr[k=2]"
    assert doc["no_coin"] is None


def test_baseline_keys_take_the_shared_parameters_where_they_are_held():
    from fastgate.eval.report import baseline_keys, dense_always_key
    from fastgate.eval.runner import RunSpec

    k2 = (("k", "2"),)
    invocation = [RunSpec("never", None, k2), RunSpec("always", "bm25", k2), RunSpec("dtr", "dense", k2)]
    assert baseline_keys(invocation) == ("never[k=2]", "always[k=2]")
    # a gate alone: the baselines with its parameters where DIR holds them (an earlier invocation's), else plain
    alone = [RunSpec("dtr", "dense", k2)]
    assert baseline_keys(alone, {"never[k=2]", "always[k=2]", "never", "always"}) == ("never[k=2]", "always[k=2]")
    assert baseline_keys(alone, {"never", "always"}) == ("never", "always")
    assert dense_always_key(alone, {"always[k=2,retriever=dense]"}) == "always[k=2,retriever=dense]"
    assert dense_always_key(alone) == "always[retriever=dense]"
    # a sweep's parameter is no run's but one point's: the plain baselines
    sweep = [RunSpec("dtr", "dense", (("tau", "0.1"),)), RunSpec("dtr", "dense", (("tau", "0.2"),))]
    assert baseline_keys(sweep, {"never[tau=0.1]"}) == ("never", "always")
