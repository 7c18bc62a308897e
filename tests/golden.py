"""Golden results of every method on the tiny model: recorded once from the batch-synchronous implementation (before
the step-program scheduler) and replayed by ``tests/test_golden.py``.

Record (only when a change is meant to alter results): ``python tests/golden.py --record``.
The probing, flare and scaar entries were recorded again on 2026-11-30 (only they: the others' scores carry the first
machine's last bits): their reading prompts overflowed the tiny model's 512-token context, which cut them on the
left; they now keep the best-ranked passages that fit (``Method.fit_passages``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "golden_tiny.json"

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "capital of Kyrgyzstan", "largest planet",
             "capital of Germany", "Eiffel Tower", "Burkina Faso", "planet Jupiter"]

FAST = {  # small settings so each method runs in about a second on the tiny model (as tests/test_methods.py)
    "flare": {"max_sentences": 2, "sentence_tokens": 8},
    "scaar": {"max_sentences": 2, "sentence_tokens": 8},
    "probing": {"max_iterations": 2, "max_rationale_tokens": 12},
    "seakr": {"samples": 3, "step_tokens": 6, "max_steps": 2, "n_candidates": 2, "answer_tokens": 8,
              "max_answer_tokens": 6},
    "cbdr": {"n_candidates": 4},
    "dtr": {"pseudo_tokens": 12},
}


def comparable(result) -> dict:
    """What must not change: answers, decisions, passages and counters (gate scores within a tolerance)."""
    d = result.to_dict()
    d.pop("timings")
    return d


def assert_same(got: dict, want: dict, where: str = "") -> None:
    """``got`` equals ``want`` exactly, except gate scores and passage scores (within 1e-4)."""
    import math

    for key in want:
        if key in ("gate_steps", "passages"):
            continue
        assert got[key] == want[key], f"{where}: {key}: {got[key]!r} != {want[key]!r}"
    assert [p["id"] for p in got["passages"]] == [p["id"] for p in want["passages"]], f"{where}: passages"
    for a, b in zip(got["passages"], want["passages"]):
        assert math.isclose(a["score"], b["score"], rel_tol=1e-4, abs_tol=1e-4), f"{where}: passage score"
    assert len(got["gate_steps"]) == len(want["gate_steps"]), f"{where}: gate steps"
    for a, b in zip(got["gate_steps"], want["gate_steps"]):
        assert (a["gate"], a["retrieve"]) == (b["gate"], b["retrieve"]), f"{where}: gate step {a} != {b}"
        for k in ("score", "threshold"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-4), f"{where}: gate {k} {a} != {b}"


def setups(root: Path):
    """Engine, retrievers and the tiny checkpoints (the same random weights every time)."""
    from conftest import SMALL_CORPUS

    from fastgate.engine.local import Engine
    from fastgate.gates.checkpoints import random_probe_params, save_probe_checkpoint
    from fastgate.retrieval import BM25Retriever, DenseRetriever, build_indexes
    from fastgate.testing import tiny_model

    tiny = tiny_model()
    corpus = root / "small.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in SMALL_CORPUS))
    build_indexes(corpus, root / "index", progress=False)
    probe = save_probe_checkpoint(root / "probe", random_probe_params(2, tiny.hidden_size, 16, seed=1),
                                  kind="probing", model=tiny, layers=(2, 4))
    conf = save_probe_checkpoint(root / "conf", random_probe_params(1, tiny.hidden_size, 16, seed=2),
                                 kind="confidence", model=tiny, layers=(2,))
    retrievers = {"bm25": BM25Retriever(root / "index" / "bm25"), "dense": DenseRetriever(root / "index" / "dense")}
    return Engine(tiny), retrievers, {"probing": str(probe), "cbdr": str(conf)}


def cases(checkpoints: dict[str, str]) -> list[tuple[str, str, dict]]:
    """(method, retriever, params) of every recorded run; thresholds sit between first-gate scores so that each run
    has questions that retrieve and questions that skip."""
    def p(name, **extra):
        out = dict(FAST.get(name, {}))
        if name in checkpoints:
            out["checkpoint"] = checkpoints[name]
        out.update(extra)
        return out

    return [
        ("never", "bm25", p("never")),
        ("always", "bm25", p("always", k=2)),
        ("dtr", "dense", p("dtr", tau=0.95)),
        ("dtr", "bm25", p("dtr", tau=0.95, n=3)),
        ("flare", "bm25", p("flare", theta=0.9)),
        ("scaar", "bm25", p("scaar", theta=0.845)),
        ("probing", "bm25", p("probing", theta=-0.4)),
        ("seakr", "bm25", p("seakr", delta=-0.9)),
        ("cbdr", "bm25", p("cbdr", beta=0.81)),
    ]


def record() -> None:
    import tempfile

    from fastgate.methods import build_method

    with tempfile.TemporaryDirectory() as tmp:
        engine, retrievers, ckpts = setups(Path(tmp))
        out = []
        for name, retriever, params in cases(ckpts):
            method = build_method(name, engine, retrievers[retriever], params)
            results = [comparable(r) for r in method.answer_batch(QUESTIONS)]
            shown = {k: v for k, v in params.items() if k != "checkpoint"}
            decisions = [s["gate_steps"][0]["retrieve"] if s["gate_steps"] else None for s in results]
            print(name, retriever, shown, decisions)
            out.append({"method": name, "retriever": retriever, "params": shown, "results": results})
    FIXTURE.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--record", action="store_true")
    if ap.parse_args().record:
        record()
