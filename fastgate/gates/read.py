"""The read gate: after the search has run, decide whether reading its passages is worth a long prefill.

fastgate's own extension beyond the papers (docs/DEVIATIONS.md). The papers' gates look only at the model: they know
when the closed-book answer is likely wrong, but not whether the corpus holds a better one, and on small models they
do no better than a coin that retrieves at the same rate. A search costs a fraction of a millisecond (BM25) to a few
milliseconds (dense); reading its passages costs a ~430-token prompt, about five times the closed-book prompt
(~80 tokens; the committed records' prompt_tokens). So the search runs first, and a small logistic
model combines the method's own signal and the closed-book answer's token log-probabilities (free in the decode
loop) with what the search returned: top scores, the drop from the first to the k-th, how much of the question the
top passage covers, whether the closed-book answer already appears in the passages, agreement of BM25 and dense.

It is a logistic regression on standardised features, written here because it is ten lines of numpy: fitting and
scoring need no library beyond what fastgate already imports, and the checkpoint is a readable JSON file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastgate.errors import CheckpointError, InputError
from fastgate.gates.base import Gate, GateStep

__all__ = [
    "FEATURE_SETS",
    "MODEL_FEATURES",
    "ReadGate",
    "ReadModel",
    "fit_read_model",
    "load_read_checkpoint",
    "read_features",
    "save_read_checkpoint",
]

# Model-side features: the method's own first score and the closed-book answer's token log-probabilities.
MODEL_FEATURES = ("base_score", "cb_nll", "cb_min_logprob", "cb_tokens", "q_words")
_SEARCH = ("top", "drop", "cover", "answer_in")
BM25_FEATURES = tuple(f"bm25_{f}" for f in _SEARCH)
DENSE_FEATURES = tuple(f"dense_{f}" for f in _SEARCH)
# "all": both searches; "dense": the dense search only (the benchmark's answerable / unanswerable split is defined
# from the BM25 top 3, so a gate that sees BM25 scores is partly told the split; the dense-only gate is not)
FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "all": MODEL_FEATURES + BM25_FEATURES + DENSE_FEATURES + ("agree",),
    "dense": MODEL_FEATURES + DENSE_FEATURES,
}

_STOP = frozenset("""a an the of in on at to for from by with and or is are was were be been who whom whose what which
when where why how did does do has have had it its this that these those as into than then there their his her he she
they them we you i me my our your not no name named called first last one""".split())


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _content(text: str) -> set[str]:
    return {w for w in _words(text) if w not in _STOP and len(w) > 1}


def _search_features(question: str, answer: str, hits: Sequence[Any], prefix: str) -> dict[str, float]:
    """Top score, drop from first to last hit, question coverage of the top passage, closed-book answer in hits."""
    scores = [float(h.score) for h in hits]
    q = _content(question)
    top_text = f"{hits[0].title} {hits[0].text}" if hits else ""
    cover = len(q & _content(top_text)) / len(q) if q else 0.0
    norm = " ".join(_words(answer))
    joined = " ".join(" ".join(_words(f"{h.title} {h.text}")) for h in hits)
    answer_in = float(bool(norm) and f" {norm} " in f" {joined} ")
    return {f"{prefix}_top": scores[0] if scores else 0.0,
            f"{prefix}_drop": scores[0] - scores[-1] if scores else 0.0,
            f"{prefix}_cover": cover,
            f"{prefix}_answer_in": answer_in}


def read_features(question: str, closed_book: Any, base_score: float, bm25_hits: Sequence[Any] | None,
                  dense_hits: Sequence[Any] | None) -> dict[str, float]:
    """Every feature the read gate may use, for one question.

    Args:
        question: the question.
        closed_book: the greedy closed-book answer's :class:`~fastgate.engine.local.Generation`.
        base_score: the wrapped method's first gate score (DTR: answer NLL; CBDR: confidence; ...).
        bm25_hits, dense_hits: top-k hits of each search (None: that search did not run; its features are 0).
    """
    lps = list(closed_book.token_logprobs[: closed_book.answer_tokens]) or [0.0]
    answer = closed_book.text.strip()
    out = {"base_score": float(base_score) if math.isfinite(base_score) else 0.0,
           "cb_nll": -sum(lps) / len(lps), "cb_min_logprob": min(lps),
           "cb_tokens": math.log1p(closed_book.answer_tokens), "q_words": math.log1p(len(question.split()))}
    out.update(_search_features(question, answer, bm25_hits or [], "bm25"))
    out.update(_search_features(question, answer, dense_hits or [], "dense"))
    if bm25_hits and dense_hits:
        out["agree"] = len({h.id for h in bm25_hits} & {h.id for h in dense_hits}) / max(len(bm25_hits),
                                                                                         len(dense_hits))
    else:
        out["agree"] = 0.0
    return out


@dataclass(frozen=True)
class ReadModel:
    """A logistic model of "reading the passages fixes the closed-book answer": ``w · (x − mean) / std + b``."""

    features: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float

    def __post_init__(self) -> None:
        n = len(self.features)
        if not (len(self.mean) == len(self.std) == len(self.weights) == n) or n == 0:
            raise CheckpointError(f"read model: {n} features but {len(self.mean)} means, {len(self.std)} stds and "
                                  f"{len(self.weights)} weights")

    def matrix(self, rows: Sequence[Mapping[str, float]]) -> np.ndarray:
        """``[N, F]`` standardised features of ``rows``."""
        missing = sorted({f for r in rows for f in self.features if f not in r})
        if missing:
            raise InputError(f"read gate: feature(s) missing: {', '.join(missing)}")
        x = np.array([[float(r[f]) for f in self.features] for r in rows], dtype=np.float64)  # [N, F]
        x = x.reshape(-1, len(self.features))
        return (x - np.asarray(self.mean)) / np.asarray(self.std)

    def logits(self, rows: Sequence[Mapping[str, float]]) -> np.ndarray:
        """``[N]`` log-odds that reading fixes the answer."""
        return self.matrix(rows) @ np.asarray(self.weights) + self.bias


def fit_read_model(rows: Sequence[Mapping[str, float]], labels: Sequence[int], features: Sequence[str],
                   l2: float = 1.0, iterations: int = 2000) -> ReadModel:
    """Fit the logistic model by gradient descent on the L2-penalised log-loss (deterministic: no random start).

    Args:
        rows: feature dicts (:func:`read_features`).
        labels: 1 where reading fixed the closed-book answer, else 0.
        features: the names to use (a :data:`FEATURE_SETS` value).
        l2: penalty on the weights (not the bias), in units of one example.
    """
    if len(rows) != len(labels) or not rows:
        raise InputError(f"read gate: {len(rows)} feature rows and {len(labels)} labels")
    x = np.array([[float(r[f]) for f in features] for r in rows], dtype=np.float64)  # [N, F]
    y = np.asarray(labels, dtype=np.float64)  # [N]
    mean, std = x.mean(0), x.std(0)
    std[std < 1e-9] = 1.0  # a constant feature: left at 0 after centring
    z = (x - mean) / std
    w, b, n = np.zeros(z.shape[1]), 0.0, len(y)
    lr = 1.0
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(z @ w + b)))
        w -= lr * (z.T @ (p - y) / n + l2 * w / n)
        b -= lr * float((p - y).mean())
    return ReadModel(tuple(features), tuple(mean.tolist()), tuple(std.tolist()), tuple(w.tolist()), float(b))


def save_read_checkpoint(out_dir: str | Path, models: Mapping[str, ReadModel], *, model: Any, base: str,
                         meta: Mapping[str, Any]) -> Path:
    """Write ``config.json`` of a read-gate checkpoint: one :class:`ReadModel` per feature set."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"kind": "read", "model": model.name, "model_fingerprint": getattr(model, "fingerprint", ""), "base": base,
           "models": {name: asdict(m) for name, m in models.items()}, **dict(meta)}
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out / "config.json")
    return out


def load_read_checkpoint(path: str | Path, features: str, *, model: Any = None, base: str | None = None) -> ReadModel:
    """The :class:`ReadModel` for feature set ``features`` from a checkpoint directory.

    Raises:
        CheckpointError: missing or corrupt, trained for another model or another base method, or without that set.
    """
    cfg = Path(path) / "config.json"
    try:
        doc = json.loads(cfg.read_text())
        if doc.get("kind") != "read":
            raise CheckpointError(f"{cfg} is not a read-gate checkpoint (kind {doc.get('kind')!r})")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(f"read-gate checkpoint {cfg} is missing or corrupt: {exc}") from None
    if model is not None:
        fp = getattr(model, "fingerprint", "")
        if doc.get("model") != model.name or (doc.get("model_fingerprint") and fp and doc["model_fingerprint"] != fp):
            raise CheckpointError(f"read-gate checkpoint {path} was trained for model {doc.get('model')}, not "
                                  f"{model.name}: train one with `fastgate train read --model {model.name}`")
    if base is not None and doc.get("base") != base:
        raise CheckpointError(f"read-gate checkpoint {path} was trained over {doc.get('base')}, not {base}")
    if features not in doc.get("models", {}):
        raise CheckpointError(f"read-gate checkpoint {path} has no {features!r} model (has: "
                              f"{', '.join(doc.get('models', {})) or 'none'})")
    try:
        m = doc["models"][features]
        return ReadModel(tuple(m["features"]), tuple(m["mean"]), tuple(m["std"]), tuple(m["weights"]),
                         float(m["bias"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"read-gate checkpoint {path}: corrupt {features!r} model ({exc})") from None


class ReadGate(Gate):
    """Read iff the log-odds that reading fixes the closed-book answer are ``>= threshold``.

    The signal is a feature dict (:func:`read_features`).
    """

    name = "read"

    def __init__(self, model: ReadModel, threshold: float) -> None:
        self.model = model
        self.threshold = float(threshold)

    @property
    def batch_key(self):
        return ("read", id(self.model))

    def scores(self, signals: Sequence[Mapping[str, float]]) -> torch.Tensor:
        return torch.from_numpy(self.model.logits(list(signals)))  # [N] float64

    def step(self, score: float, signal=None) -> GateStep:
        return GateStep(self.name, float(score), self.threshold, bool(score >= self.threshold))
