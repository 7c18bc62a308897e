"""Gate quality against a coin: figures worked out by hand on synthetic records; the section of `fastgate eval`."""

from __future__ import annotations

import json
import math

import pytest

from fastgate.errors import InputError
from fastgate.eval.gate_quality import (
    GateQuality,
    auroc,
    coin_section,
    decision,
    gate_quality,
    gate_quality_for_runs,
    gate_quality_table,
    oriented_scores,
    plot_gate_quality,
    threshold_curve,
)

# five questions: q1, q2 fixed by retrieval, q3 right both ways, q4 wrong both ways, q5 broken by retrieval
NEVER = [0, 0, 1, 0, 1]  # ACC 0.4
ALWAYS = [1, 1, 1, 0, 0]  # ACC 0.6
IDS = ["q1", "q2", "q3", "q4", "q5"]


def _rec(run: str, qid: str, acc: float, retrieved: bool, score: float | None = None, threshold: float = 0.5,
         below: bool = False, **extra) -> dict:
    """A record; with ``score`` one gate step that retrieves above ``threshold`` (below it when ``below``)."""
    steps = [] if score is None else [{"gate": "g", "score": score, "threshold": threshold,
                                       "retrieve": (score < threshold) if below else (score > threshold)}]
    return {"run": run, "id": qid, "method": run.split("[")[0], "acc": float(acc), "retrieved": retrieved,
            "retrieval_calls": int(retrieved), "gate_steps": steps, **extra}


def _baselines() -> tuple[dict, dict]:
    never = {q: _rec("never", q, a, False) for q, a in zip(IDS, NEVER)}
    always = {q: _rec("always", q, a, True) for q, a in zip(IDS, ALWAYS)}
    return never, always


def _gated(scores, run="dtr", accs=None, below=False) -> dict:
    """A gate whose decisions follow its scores against 0.5; its answers are never's or always's by its decision."""
    out = {}
    for i, (q, s) in enumerate(zip(IDS, scores)):
        retrieve = (s < 0.5) if below else (s > 0.5)
        acc = accs[i] if accs is not None else (ALWAYS[i] if retrieve else NEVER[i])
        out[q] = _rec(run, q, acc, retrieve, s, below=below)
    return out


def test_an_oracle_gate_is_the_oracle():
    never, always = _baselines()
    g = gate_quality(_gated([0.9, 0.8, 0.3, 0.2, 0.1]), never, always, n_permutations=2000, seed=1)
    assert isinstance(g, GateQuality) and g.run == "dtr" and g.gate == "g" and g.n == 5 and g.n_scored == 5
    assert g.rate == pytest.approx(0.4) and g.acc == pytest.approx(0.8)
    assert g.never_acc == pytest.approx(0.4) and g.always_acc == pytest.approx(0.6)
    assert g.random_acc == pytest.approx(0.6 * 0.4 + 0.4 * 0.6)  # 0.48
    # per question: acc - (0.6 never + 0.4 always) = 0.6, 0.6, 0, 0, 0.4
    assert g.diff == pytest.approx(0.32)
    assert g.diff_se == pytest.approx(math.sqrt(0.368 / 4 / 5))
    assert g.replay_acc == pytest.approx(0.8) and g.replay_diff == pytest.approx(0.32)
    assert g.oracle_acc == pytest.approx(0.8)
    # 2 decisions of 5 over the gains (1, 1, 0, 0, -1): only the oracle's pair is 1.6 from a coin's 0.4 -> p = 1/10
    assert g.perm_p == pytest.approx(0.1, abs=0.02)
    assert g.auroc_wrong == pytest.approx(5 / 6)  # never wrong: 0.9, 0.8, 0.2 against right: 0.3, 0.1
    assert g.auroc_fixes == pytest.approx(1.0)
    assert math.isnan(g.auroc_answerable)
    assert g.curve_rates == pytest.approx((0, 0.2, 0.4, 0.6, 0.8, 1))
    assert g.curve_accs == pytest.approx((0.4, 0.6, 0.8, 0.8, 0.8, 0.6))
    assert g.oracle_accs == pytest.approx(g.curve_accs) and g.area == pytest.approx(1.0)


def test_an_anti_gate_is_below_the_coin():
    never, always = _baselines()
    g = gate_quality(_gated([0.1, 0.2, 0.3, 0.8, 0.9]), never, always, n_permutations=500)
    assert g.rate == pytest.approx(0.4) and g.acc == pytest.approx(0.2)  # retrieves where it breaks (q5) or is moot
    assert g.diff == pytest.approx(0.2 - 0.48) and g.replay_diff == pytest.approx(0.2 - 0.48)
    assert g.oracle_acc == pytest.approx(0.8)
    assert g.auroc_wrong == pytest.approx(1 / 6) and g.auroc_fixes == pytest.approx(0.0)
    assert g.curve_accs == pytest.approx((0.4, 0.2, 0.2, 0.2, 0.4, 0.6))
    assert g.area == pytest.approx(-1.0)  # as far below the random line as the oracle is above


def test_a_coin_gate_scores_like_a_coin():
    never, always = _baselines()
    # one tied score: a threshold cannot order the questions, and every shuffle of all-retrieve is itself
    g = gate_quality(_gated([0.7] * 5), never, always, n_permutations=300)
    assert g.rate == 1 and g.random_acc == pytest.approx(0.6) and g.diff == pytest.approx(0)
    assert g.replay_diff == pytest.approx(0) and g.perm_p == 1
    assert g.auroc_wrong == 0.5 and g.auroc_fixes == 0.5
    assert g.curve_accs == pytest.approx((0.4, 0.44, 0.48, 0.52, 0.56, 0.6)) and g.area == pytest.approx(0)
    # its own answers may differ from always's: the paired difference sees that, the replay does not
    g = gate_quality(_gated([0.7] * 5, accs=[1, 1, 1, 1, 0]), never, always, n_permutations=0)
    assert g.acc == pytest.approx(0.8) and g.diff == pytest.approx(0.2) and g.replay_diff == pytest.approx(0)
    assert math.isnan(g.perm_p)


def test_a_gate_retrieving_below_its_threshold_is_oriented():
    never, always = _baselines()
    up = gate_quality(_gated([0.9, 0.8, 0.3, 0.2, 0.1]), never, always, n_permutations=0)
    down = gate_quality(_gated([0.1, 0.2, 0.7, 0.8, 0.9], below=True), never, always, n_permutations=0)
    assert down.rate == up.rate and down.auroc_wrong == pytest.approx(up.auroc_wrong)
    assert down.curve_accs == pytest.approx(up.curve_accs) and down.area == pytest.approx(1.0)


def test_records_without_a_gate_step_rank_by_their_decision():
    recs = [_rec("dtr", "a", 0, True), _rec("dtr", "b", 0, False), _rec("dtr", "c", 0, True, 0.7)]
    scores, gate, scored = oriented_scores(recs)
    assert list(scores) == [math.inf, -math.inf, 0.7] and gate == "g" and scored == 1
    assert decision({"retrieval_calls": 2}) and not decision({"retrieval_calls": 0})
    # a run that fetched passages but did not use them (a read gate) did not retrieve
    assert not decision({"retrieved": False, "retrieval_calls": 1, "read": False})


def test_auroc_by_hand():
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([1, 1, 2], [0, 1, 1]) == pytest.approx(0.75)  # a tie counts one half
    assert auroc([3, 2, 1], [True, False, False]) == 1.0 and auroc([3, 2, 1], [False, True, True]) == 0.0
    assert math.isnan(auroc([1, 2], [1, 1])) and math.isnan(auroc([], []))
    with pytest.raises(InputError, match="2 scores but 1 labels"):
        auroc([1, 2], [1])


def test_threshold_curve_takes_ties_in_expectation():
    assert list(threshold_curve([1, 1], [0, 0], [1, 0])) == pytest.approx([0, 0.25, 0.5])
    assert list(threshold_curve([2, 1], [0, 0], [1, 0])) == pytest.approx([0, 0.5, 0.5])
    with pytest.raises(InputError):
        threshold_curve([1], [0, 1], [1, 1])


def test_subsets_and_the_answerable_split():
    never, always = _baselines()
    gated = _gated([0.9, 0.8, 0.3, 0.2, 0.1])
    split = {"q1": True, "q2": False, "q3": True, "q4": False, "q5": True}
    g = gate_quality(gated, never, always, ids=["q1", "q3", "q4"], answerable=split, n_permutations=0)
    assert g.n == 3 and g.rate == pytest.approx(1 / 3) and g.acc == pytest.approx(2 / 3)
    assert g.random_acc == pytest.approx(2 / 3 * 1 / 3 + 1 / 3 * 2 / 3)
    assert g.auroc_answerable == pytest.approx(1.0)  # answerable q1 0.9, q3 0.3 over unanswerable q4 0.2
    assert len(g.curve_accs) == 4
    every = gate_quality(gated, never, always, answerable=split, n_permutations=0)
    assert every.auroc_answerable == pytest.approx(3 / 6)  # q1 0.9, q3 0.3, q5 0.1 over q2 0.8, q4 0.2
    half = gate_quality(gated, never, always, ids=[q for q in IDS if split[q]], answerable=split, n_permutations=0)
    assert half.n == 3 and math.isnan(half.auroc_answerable)  # one class only


def test_questions_missing_from_one_run_are_left_out():
    never, always = _baselines()
    gated = _gated([0.9, 0.8, 0.3, 0.2, 0.1])
    del gated["q5"], never["q4"]
    g = gate_quality(gated, never, always, n_permutations=0)
    assert g.n == 3 and g.acc == pytest.approx(1.0) and g.never_acc == pytest.approx(1 / 3)
    with pytest.raises(InputError, match="no question"):
        gate_quality(gated, never, always, ids=["q4", "q5", "zz"])


def test_runs_of_a_store_table_and_plot(tmp_path):
    never, always = _baselines()
    store = {}
    for recs in (never, always, _gated([0.9, 0.8, 0.3, 0.2, 0.1], run="dtr"),
                 _gated([0.1, 0.2, 0.3, 0.8, 0.9], run="cbdr[n_candidates=5]"),
                 {q: r for q, r in _gated([0.5] * 5, run="flare").items() if q != "q3"},
                 {"q1": _rec("always[retriever=dense]", "q1", 1, True)}):
        store.update({(r["run"], q): r for q, r in recs.items()})
    results = gate_quality_for_runs(store, n_permutations=100)
    assert [g.run for g in results] == ["dtr", "cbdr[n_candidates=5]"]  # flare lacks q3; baselines are no gates
    assert [g.run for g in gate_quality_for_runs(store, complete=False, n_permutations=0)] == [
        "dtr", "cbdr[n_candidates=5]", "flare"]
    assert gate_quality_for_runs(store, runs=["cbdr[n_candidates=5]"], n_permutations=0)[0].area == pytest.approx(-1)
    assert gate_quality_for_runs({k: v for k, v in store.items() if k[0] != "always"}) == []
    assert gate_quality_for_runs(store, ids=["q1", "nowhere"]) == []  # a question the baselines lack
    table = gate_quality_table(results, labels=["DTR", "CBDR"])
    lines = table.splitlines()
    assert lines[0].startswith("| run | first score | n | retrieves | ACC | random gate at that rate |")
    assert lines[2].startswith("| DTR | g | 5 | 40.0% | 0.800 | 0.480 | +32.0 ± 13.6 | +32.0 (")
    assert lines[2].endswith("| 0.800 | 0.83 | 1.00 | – | +1.00 |")
    assert lines[3].startswith("| CBDR | g | 5 | 40.0% | 0.200 | 0.480 | -28.0 ± ")
    assert coin_section(results).startswith("## Do the gates beat a coin?\n\n")
    png = plot_gate_quality(results, tmp_path / "g.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(InputError, match="no gated run"):
        plot_gate_quality([], tmp_path / "h.png", "test")


def test_eval_cli_summary_says_whether_the_gates_beat_a_coin(capsys, monkeypatch, tmp_path, tiny, small_index):
    import fastgate.assets.models
    from fastgate.entrypoints.cli import main

    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, *args, **kwargs: tiny)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in (
        ("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "Shakespeare"),
        ("What is the largest planet?", "Jupiter"), ("When was the Eiffel Tower completed?", "1889"))))
    out = tmp_path / "out"
    common = ["--data", str(data), "--index", str(small_index), "--out", str(out), "--model", "tiny", "--quiet",
              "--batch-size", "4"]
    assert main(["eval", "--method", "never,dtr", *common]) == 0  # no always yet: no section
    assert "beat a coin" not in capsys.readouterr().out
    assert "beat a coin" not in (out / "summary.md").read_text() and not (out / "gate-quality.png").exists()
    assert main(["eval", "--method", "always", *common]) == 0  # dtr comes from the earlier invocation
    printed = capsys.readouterr().out
    summary = (out / "summary.md").read_text()
    for text in (printed, summary):
        assert "## Do the gates beat a coin?" in text and "| dtr | answer_nll | 4 |" in text
        assert "| never |" not in text.split("beat a coin?")[1]
    assert (out / "gate-quality.png").read_bytes()[:4] == b"\x89PNG"
