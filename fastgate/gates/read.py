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

Two modes decide at two points of a question's life (``ReadConfig.decide``, docs/DEVIATIONS.md):

- ``answer`` (:func:`read_features`): after the closed-book answer, from the base method's signal, the answer's
  token log-probabilities and the searches.
- ``prefill`` (:func:`prefill_features`): before any generation, from the closed-book prompt's pre-answer hidden
  state at one layer (the state CBDR's confidence model reads, from a prefill stopped at that layer), projected on its
  first ``rank`` principal components (:class:`StateProjection`, fitted on the training questions' states), and the
  same searches' scores; nothing that needs the closed-book answer (``answer_in``, ``cb_*``, ``base_score``).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastgate.errors import CheckpointError, InputError
from fastgate.gates.base import Gate, GateStep

__all__ = [
    "BM25_PASSAGE_FEATURES",
    "DECIDE_MODES",
    "FEATURE_SETS",
    "GainModel",
    "SCORES",
    "MODEL_FEATURES",
    "PREFILL_SEARCH_FEATURES",
    "ReadGate",
    "ReadCheckpoint",
    "ReadModel",
    "ReadStep",
    "ShiftGainModel",
    "adapt_gains",
    "StateProjection",
    "check_read_checkpoint",
    "fit_gain_model",
    "fit_read_model",
    "fit_shift_gain_model",
    "fit_state_projection",
    "load_prefill_checkpoint",
    "load_read_checkpoint",
    "open_read_checkpoint",
    "passage_features",
    "prefill_feature_names",
    "prefill_features",
    "read_features",
    "save_read_checkpoint",
    "shift_posterior",
]

# where the gate decides: after the closed-book answer (today's gate), or from the closed-book prompt's prefill
DECIDE_MODES = ("answer", "prefill")

# what a checkpoint's score is: ``gain``, the expected accuracy a read adds (P(read fixes) − P(read breaks)), judged
# against a price in accuracy per read; ``shift-gain``, the same expectation under the answerable share of the
# traffic the gate sees (:class:`ShiftGainModel`); ``log-odds``, the log-odds that a read fixes the answer
# (checkpoints made before the gain model; their threshold is a log-odds value calibrated to a reading rate)
SCORES = ("gain", "log-odds", "shift-gain")

# Model-side features: the method's own first score and the closed-book answer's token log-probabilities.
MODEL_FEATURES = ("base_score", "cb_nll", "cb_min_logprob", "cb_tokens", "q_words")
_SEARCH = ("top", "drop", "cover", "answer_in")
BM25_FEATURES = tuple(f"bm25_{f}" for f in _SEARCH)
DENSE_FEATURES = tuple(f"dense_{f}" for f in _SEARCH)
# What the passages' words say about whether they hold an answer (:func:`_passage_features`): a title that names the
# question's subject, the question's words across the passages and in one sentence, a year or number where the
# question asks for one, names the question does not hold. Read from the passages a read would put in the prompt.
_PASSAGE = ("title_in_q", "cover_all", "sent_cover", "type_match", "new_names", "top_names")
BM25_PASSAGE_FEATURES = tuple(f"bm25_{f}" for f in _PASSAGE) + ("q_typed",)
# "all": both searches; "dense": the dense search only (the benchmark's answerable / unanswerable split is defined
# from the BM25 top 3, so a gate that sees BM25 scores is partly told the split; the dense-only gate is not)
FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "all": MODEL_FEATURES + BM25_FEATURES + DENSE_FEATURES + ("agree",) + BM25_PASSAGE_FEATURES,
    "dense": MODEL_FEATURES + DENSE_FEATURES,
}

# The prefill gate's search features: those that need no closed-book answer, per feature set (``q_words`` too).
PREFILL_SEARCH_FEATURES: dict[str, tuple[str, ...]] = {
    "all": ("q_words", "bm25_top", "bm25_drop", "bm25_cover", "dense_top", "dense_drop", "dense_cover", "agree")
    + BM25_PASSAGE_FEATURES,
    "dense": ("q_words", "dense_top", "dense_drop", "dense_cover"),
}


def prefill_feature_names(features: str, rank: int) -> tuple[str, ...]:
    """The prefill gate's feature names: ``state_0 .. state_{rank-1}`` (the projected pre-answer state), then the
    search features of set ``features``."""
    return tuple(f"state_{i}" for i in range(rank)) + PREFILL_SEARCH_FEATURES[features]


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


_YEAR = re.compile(r"\b1\d{3}\b|\b20\d{2}\b")
_NUMBER = re.compile(r"\b\d+(?:[.,]\d+)?\b")
_NAME = re.compile(r"\b[A-Z][a-z]+\b")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
PASSAGE_WORDS = 120  # words of each passage the features read: the read method's default passage_words


def passage_features(question: str, hits: Sequence[Any], prefix: str) -> dict[str, float]:
    """What the passages' own words say about holding an answer, from the first :data:`PASSAGE_WORDS` words of each
    hit's title and text together, the title a sentence of its own (about what a read's prompt shows; not
    :func:`fastgate.prompts.passage_text`'s cut, which the shipped checkpoints were not trained on): the best share
    of a title's words found in the question (the corpus has the subject's page); the share of the question's words
    in any passage, and in its best sentence; whether that sentence holds a year (a "when" / "year" question) or a
    number ("how many / much"); how many capitalised words that sentence adds to the question (candidate names), and
    how many distinct ones the top passage adds (log1p of the counts). ``q_typed``: the question asks for a year or
    a number. Values for no hits: 0."""
    q = _content(question)
    words = _words(question)
    texts = [" ".join(f"{h.title}. {h.text}".split()[:PASSAGE_WORDS]) for h in hits]
    titles = [_content(h.title) for h in hits]
    in_q = max((len(t & q) / len(t) for t in titles if t), default=0.0)
    seen = set().union(*(_content(t) for t in texts)) if texts else set()
    best, sentence = 0.0, ""
    for text in texts:
        for sent in _SENTENCE.split(text):
            share = len(q & _content(sent)) / len(q) if q else 0.0
            if share > best:
                best, sentence = share, sent
    wants_year = (words[:1] == ["when"]) or "year" in words
    wants_number = "how" in words and ("many" in words or "much" in words)
    typed = (wants_year and bool(_YEAR.search(sentence))) or (wants_number and bool(_NUMBER.search(sentence)))
    names = [w for w in _NAME.findall(sentence) if w.lower() not in q]
    top_names = {w for w in _NAME.findall(texts[0]) if w.lower() not in q} if texts else set()
    return {f"{prefix}_title_in_q": in_q,
            f"{prefix}_cover_all": len(q & seen) / len(q) if q else 0.0,
            f"{prefix}_sent_cover": best,
            f"{prefix}_type_match": float(typed),
            f"{prefix}_new_names": math.log1p(len(names)),
            f"{prefix}_top_names": math.log1p(len(top_names)),
            "q_typed": float(wants_year or wants_number)}


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
    out.update(passage_features(question, bm25_hits or [], "bm25"))
    if bm25_hits and dense_hits:
        out["agree"] = len({h.id for h in bm25_hits} & {h.id for h in dense_hits}) / max(len(bm25_hits),
                                                                                         len(dense_hits))
    else:
        out["agree"] = 0.0
    return out


def prefill_features(question: str, state: Any, projection: StateProjection, bm25_hits: Sequence[Any] | None,
                     dense_hits: Sequence[Any] | None) -> dict[str, float]:
    """Every feature the prefill-mode read gate may use, for one question, before anything is generated.

    Args:
        question: the question.
        state: the closed-book prompt's pre-answer hidden state ``[d]`` at ``projection.layer`` (a ``PromptStates``
            result row: torch or numpy).
        projection: the checkpoint's :class:`StateProjection`.
        bm25_hits, dense_hits: top-k hits of each search (None: that search did not run; its features are 0).

    The search features are :func:`read_features`' own (same names, same values), so the records of the training
    pass of the ``answer`` mode train this mode too.
    """
    out = {f"state_{i}": float(v) for i, v in enumerate(projection.project(state))}
    full = read_features(question, _NO_ANSWER, math.nan, bm25_hits, dense_hits)
    out.update({k: full[k] for k in PREFILL_SEARCH_FEATURES["all"]})
    return out


class _NoAnswer:
    """A stand-in closed-book generation for :func:`prefill_features`: nothing generated."""

    text = ""
    token_logprobs: tuple[float, ...] = ()
    answer_tokens = 0


_NO_ANSWER = _NoAnswer()


@dataclass(frozen=True)
class StateProjection:
    """The pre-answer state's projection: ``components @ (state − mean)``, the first principal components of the
    training questions' states at ``layer`` (``mean [d]``, ``components [rank, d]``, each row a unit vector)."""

    layer: int
    mean: tuple[float, ...]
    components: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.components or any(len(c) != len(self.mean) for c in self.components):
            raise CheckpointError(f"state projection: {len(self.components)} components for a {len(self.mean)}-d "
                                  "state")

    @property
    def rank(self) -> int:
        return len(self.components)

    @property
    def dim(self) -> int:
        return len(self.mean)

    def project(self, states: Any) -> np.ndarray:
        """``[rank]`` of one state ``[d]``, or ``[N, rank]`` of ``[N, d]`` (float64)."""
        if isinstance(states, torch.Tensor):
            states = states.detach().to(device="cpu", dtype=torch.float64).numpy()
        x = np.asarray(states, dtype=np.float64)
        if x.shape[-1] != self.dim:
            raise InputError(f"read gate: a {x.shape[-1]}-d state for a projection of {self.dim}-d states")
        return (x - np.asarray(self.mean)) @ np.asarray(self.components).T


def fit_state_projection(states: Any, layer: int, rank: int) -> StateProjection:
    """The first ``rank`` principal components of ``states [N, d]`` (SVD of the centred matrix; each component's sign
    fixed so its largest entry is positive: deterministic)."""
    x = np.asarray(states, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise InputError(f"read gate: {len(x)} states to fit a projection")
    rank = min(rank, x.shape[0] - 1, x.shape[1])
    mean = x.mean(0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)  # [min(N, d), d]
    comps = vt[:rank]
    comps = comps * np.sign(comps[np.arange(rank), np.abs(comps).argmax(1)])[:, None]
    return StateProjection(int(layer), tuple(mean.tolist()), tuple(tuple(c) for c in comps.tolist()))


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
        # a NaN weight scored every question NaN: a gate that never read, and whose shared share it poisoned
        if not all(math.isfinite(float(v)) for v in (*self.mean, *self.std, *self.weights, self.bias)):
            raise CheckpointError("read model: its means, stds, weights and bias must be finite numbers")

    def matrix(self, rows: Sequence[Mapping[str, float]]) -> np.ndarray:
        """``[N, F]`` standardised features of ``rows``.

        Raises:
            InputError: a feature missing, or not a finite number (it would score NaN and move a shift-gain gate's
                share to NaN: no later question would read)."""
        missing = sorted({f for r in rows for f in self.features if f not in r})
        if missing:
            raise InputError(f"read gate: feature(s) missing: {', '.join(missing)}")
        x = np.array([[float(r[f]) for f in self.features] for r in rows], dtype=np.float64)  # [N, F]
        x = x.reshape(-1, len(self.features))
        if not np.isfinite(x).all():
            bad = sorted({f for j, f in enumerate(self.features) if not np.isfinite(x[:, j]).all()})
            raise InputError(f"read gate: feature(s) not a finite number: {', '.join(bad)}")
        return (x - np.asarray(self.mean)) / np.asarray(self.std)

    def logits(self, rows: Sequence[Mapping[str, float]]) -> np.ndarray:
        """``[N]`` log-odds of the label (reading fixes the answer)."""
        return self.matrix(rows) @ np.asarray(self.weights) + self.bias

    def probabilities(self, rows: Sequence[Mapping[str, float]]) -> np.ndarray:
        """``[N]`` probabilities of the label."""
        return 1.0 / (1.0 + np.exp(-self.logits(rows)))

    def score(self, rows: Sequence[Mapping[str, float]]) -> np.ndarray:
        """``[N]`` the gate's score of a ``log-odds`` checkpoint: :meth:`logits`."""
        return self.logits(rows)


@dataclass(frozen=True)
class GainModel:
    """What a read is expected to add: ``P(read fixes) − P(read breaks)``, two :class:`ReadModel` on one feature list.

    A question's accuracy changes by +1 when the passages' answer is right and the closed-book one wrong (``fix``),
    by −1 in the opposite case (``harm``), else by 0; so the difference of the two probabilities is the expected
    change of accuracy if this question reads. Read iff it is at least the price of a read (the gate's threshold):
    a rule in accuracy per read, which means the same on a set where half the questions can be answered from the
    corpus and on one where a twelfth can, where a reading rate cannot.
    """

    fix: ReadModel
    harm: ReadModel

    def __post_init__(self) -> None:
        if self.fix.features != self.harm.features:
            raise CheckpointError("gain model: its fix and harm models read different features")

    @property
    def features(self) -> tuple[str, ...]:
        return self.fix.features

    def score(self, rows: Sequence[Mapping[str, float]]) -> np.ndarray:
        """``[N]`` expected accuracy gain of reading, in [-1, 1]."""
        return self.fix.probabilities(rows) - self.harm.probabilities(rows)


def shift_posterior(p: np.ndarray, prior: float, share: float) -> np.ndarray:
    """``P(answerable | x)`` under an answerable share ``share`` of a model fitted where the share was ``prior``:
    the posterior's odds scaled by the ratio of the priors' odds (Saerens, Latinne and Decaestecker 2002)."""
    a = share * p / prior
    b = (1.0 - share) * (1.0 - p) / (1.0 - prior)
    return a / (a + b)


@dataclass(frozen=True)
class ShiftGainModel:
    """The expected gain of a read where the share of questions the corpus can answer changes from set to set.

    A read helps almost only where the passages hold an answer (on the training questions: fixes 28-41% of the
    answerable ones, 0-0.2% of the others), and that share is 50% on a balanced benchmark, 6-11% on the same
    questions as they come. A :class:`GainModel` fitted on a mix of both learns the mix's share and over-estimates
    every gain on the natural distribution (mean 0.06 predicted against 0.004 measured on NQ dev as it comes), so
    one price reads a third of a set where a twentieth can gain. This model splits the expectation:
    ``P(answerable | x) · gain_on(x) + (1 − P(answerable | x)) · gain_off(x)``, with ``P(answerable | x)`` from a
    model fitted at the training questions' share ``prior`` and re-weighted (:func:`shift_posterior`) to the share of
    the questions the gate has scored, which :class:`ReadGate` estimates as it goes (an online EM step of rate
    ``rate`` per question, no labels). The gain models' own inputs keep their meaning across shares.
    """

    answerable: ReadModel  # P(a gold answer is in the passages a read shows | x)
    on: GainModel  # the gain of a read on answerable questions
    off: GainModel  # ... and on the others
    prior: float  # the answerable share of the training questions
    rate: float  # the share estimate's step per scored question (0: the training share, always)

    def __post_init__(self) -> None:
        if not (self.answerable.features == self.on.features == self.off.features):
            raise CheckpointError("shift-gain model: its parts read different features")
        if not 0.0 < self.prior < 1.0 or not 0.0 <= self.rate < 1.0:
            raise CheckpointError(f"shift-gain model: prior {self.prior} must be in (0, 1), rate {self.rate} in [0, 1)")

    @property
    def features(self) -> tuple[str, ...]:
        return self.answerable.features

    def parts(self, rows: Sequence[Mapping[str, float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[N]`` each: P(answerable | x) at the training share, the gain if answerable, the gain if not."""
        return self.answerable.probabilities(rows), self.on.score(rows), self.off.score(rows)

    def score(self, rows: Sequence[Mapping[str, float]], share: float | None = None) -> np.ndarray:
        """``[N]`` expected accuracy gain of reading where the answerable share is ``share`` (None: the training
        share; no update: :meth:`ReadGate.scores` adapts the share as it scores)."""
        p, on, off = self.parts(rows)
        q = shift_posterior(p, self.prior, self.prior if share is None else share)
        return q * on + (1.0 - q) * off

    def adapt(self, rows: Sequence[Mapping[str, float]], share: float) -> tuple[np.ndarray, float]:
        """Score ``rows`` in order, the share estimate moving ``rate`` of the way to each row's posterior after it
        is scored (the online form of the prior's EM): the ``[N]`` gains and the share after the last row."""
        return adapt_gains(*self.parts(rows), self.prior, share, self.rate)


def adapt_gains(p: np.ndarray, on: np.ndarray, off: np.ndarray, prior: float | np.ndarray, share: float,
                rate: float) -> tuple[np.ndarray, float]:
    """The gains of rows scored in order under a moving answerable share: each row's posterior re-weighted from
    ``prior`` (the training share: one, or one per row ``[N]``) to ``share``, its gain ``q · on + (1 − q) · off``,
    then the share moved ``rate`` of the way to ``q`` (kept within [1e-4, 1 − 1e-4]). ``p``, ``on``, ``off`` ``[N]``
    as :meth:`ShiftGainModel.parts` gives them. Returns the ``[N]`` gains and the share after the last row: the one
    update rule of :class:`ReadGate` and of the training's out-of-fold estimate."""
    prior = np.broadcast_to(np.asarray(prior, dtype=np.float64), np.shape(p))  # [N]
    out = np.empty(len(p))
    for i in range(len(p)):
        q = float(shift_posterior(p[i:i + 1], prior[i], share)[0])
        out[i] = q * on[i] + (1.0 - q) * off[i]
        if q == q:  # a NaN posterior never moves the share (NaN would stay for good: no question would read again)
            share = min(max((1.0 - rate) * share + rate * q, 1e-4), 1.0 - 1e-4)
    return out, share


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
    if not (l2 >= 0 and math.isfinite(l2)):  # a negative penalty diverges (weights of 1e211, saved as they were)
        raise InputError(f"read gate: the L2 penalty must be a finite number >= 0, got {l2}")
    x = np.array([[float(r[f]) for f in features] for r in rows], dtype=np.float64)  # [N, F]
    y = np.asarray(labels, dtype=np.float64)  # [N]
    odd = ~np.isfinite(x)  # one NaN made every weight NaN: a gate that scores NaN never reads
    if odd.any():
        worst = int(odd.sum(0).argmax())
        raise InputError(f"read gate: feature {features[worst]} is not a finite number in {int(odd[:, worst].sum())} "
                         f"of {len(rows)} rows ({int(odd.any(1).sum())} rows with one): records of another fastgate, "
                         "or edited by hand?")
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


def fit_gain_model(rows: Sequence[Mapping[str, float]], fixed: Sequence[int], broken: Sequence[int],
                   features: Sequence[str], l2: float = 1.0) -> GainModel:
    """Fit :class:`GainModel`: one logistic model of ``fixed`` (read right, closed-book wrong), one of ``broken``
    (closed-book right, read wrong), on the same rows and features (:func:`fit_read_model` each)."""
    return GainModel(fit_read_model(rows, fixed, features, l2=l2), fit_read_model(rows, broken, features, l2=l2))


def fit_shift_gain_model(rows: Sequence[Mapping[str, float]], fixed: Sequence[int], broken: Sequence[int],
                         answerable: Sequence[int], features: Sequence[str], l2: float = 1.0,
                         rate: float = 0.02) -> ShiftGainModel:
    """Fit :class:`ShiftGainModel`: the answerable model on every row, a :class:`GainModel` on the answerable rows
    and one on the others (:func:`fit_gain_model`)."""
    a = np.asarray(answerable, dtype=int)
    if len(a) != len(rows) or not 0 < a.sum() < len(a):
        raise InputError(f"read gate: {int(a.sum())} answerable of {len(a)} rows: both kinds are needed")
    fixed, broken = np.asarray(fixed), np.asarray(broken)
    on, off = np.flatnonzero(a == 1), np.flatnonzero(a == 0)

    def gain(idx):
        return fit_gain_model([rows[i] for i in idx], fixed[idx], broken[idx], features, l2=l2)

    return ShiftGainModel(fit_read_model(rows, a, features, l2=l2), gain(on), gain(off), float(a.mean()), rate)


def save_read_checkpoint(out_dir: str | Path, models: Mapping[str, ReadModel | GainModel | ShiftGainModel], *,
                         model: Any,
                         base: str | None,
                         meta: Mapping[str, Any], decide: str = "answer",
                         projection: StateProjection | None = None) -> Path:
    """Write ``config.json`` of a read-gate checkpoint: one model per feature set, all :class:`GainModel` (score
    ``gain``) or all :class:`ReadModel` (``log-odds``); a ``prefill`` one also holds its :class:`StateProjection`
    (and no base: it reads no base method's signal)."""
    if decide not in DECIDE_MODES or (decide == "prefill") != (projection is not None):
        raise InputError(f"read gate: decide={decide!r} with{'out' if projection is None else ''} a state projection")
    kinds = {type(m) for m in models.values()}
    if len(kinds) != 1:
        raise InputError("read gate: a checkpoint's models are all of one kind (shift-gain, gain or log-odds)")
    score = {ShiftGainModel: "shift-gain", GainModel: "gain", ReadModel: "log-odds"}[kinds.pop()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"kind": "read", "decide": decide, "model": model.name,
           "model_fingerprint": getattr(model, "fingerprint", ""), "base": base if decide == "answer" else None,
           "score": score,
           **({"projection": asdict(projection)} if projection is not None else {}),
           "models": {name: asdict(m) for name, m in models.items()}, **dict(meta)}
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out / "config.json")
    return out


def load_read_checkpoint(path: str | Path, features: str, *, model: Any = None, base: str | None = None,
                         decide: str = "answer") -> ReadModel | GainModel | ShiftGainModel:
    """The model for feature set ``features`` from a checkpoint directory: a :class:`ShiftGainModel` (score
    ``shift-gain``), a :class:`GainModel` (``gain``) or a :class:`ReadModel` (``log-odds``, checkpoints made before
    the gain model).

    Raises:
        CheckpointError: missing or corrupt, made for the other ``decide`` mode, trained for another model or another
            base method, or without that set.
    """
    return _load(path, features, model=model, base=base, decide=decide)[0]


@dataclass(frozen=True)
class ReadCheckpoint:
    """A loaded ``answer``-mode read-gate checkpoint: the model for one feature set and the search it was trained on."""

    model: ReadModel | GainModel | ShiftGainModel
    k: int | None  # passages a search returned in training (None: checkpoints from before it was recorded)


def open_read_checkpoint(path: str | Path, features: str, *, model: Any = None, base: str | None = None
                         ) -> ReadCheckpoint:
    """:func:`load_read_checkpoint` with what else a method needs from ``config.json``, read once."""
    gate, doc = _load(path, features, model=model, base=base, decide="answer")
    k = doc.get("k")
    return ReadCheckpoint(gate, k if isinstance(k, int) and not isinstance(k, bool) else None)


def load_prefill_checkpoint(path: str | Path, features: str, *, model: Any = None
                            ) -> tuple[ReadModel | GainModel, StateProjection]:
    """The ``prefill``-mode gate of a checkpoint directory: its model for ``features`` and its
    :class:`StateProjection` (checked against ``model``'s hidden size and depth).

    Raises:
        CheckpointError: as :func:`load_read_checkpoint`, and a projection that does not fit the model.
    """
    m, doc = _load(path, features, model=model, base=None, decide="prefill")
    try:
        p = doc["projection"]
        proj = StateProjection(int(p["layer"]), tuple(p["mean"]), tuple(tuple(c) for c in p["components"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"read-gate checkpoint {path}: corrupt state projection ({exc})") from None
    if m.features[: proj.rank] != tuple(f"state_{i}" for i in range(proj.rank)):
        raise CheckpointError(f"read-gate checkpoint {path}: its {features!r} model does not read the {proj.rank} "
                              "projected state features first")
    if model is not None and (proj.dim != model.hidden_size or not 0 <= proj.layer <= model.n_layers):
        raise CheckpointError(f"read-gate checkpoint {path} projects {proj.dim}-d states of layer {proj.layer}; model "
                              f"{model.name} has hidden size {model.hidden_size} and {model.n_layers} layers")
    return m, proj


def _read_model(m: Mapping[str, Any]) -> ReadModel:
    return ReadModel(tuple(m["features"]), tuple(m["mean"]), tuple(m["std"]), tuple(m["weights"]), float(m["bias"]))


def check_read_checkpoint(path: str | Path, features: str, *, model: Any = None, model_name: str | None = None,
                          base: str | None = None, decide: str = "answer") -> dict[str, Any]:
    """A read-gate checkpoint's ``config.json``, checked for what a request asks of it without reading its models:
    made for the ``decide`` mode, for the model (``model``: its name and weights' fingerprint; or by ``model_name``
    alone, before the model loads), over the ``base`` method (``answer`` mode), and holding a model for the feature
    set ``features``. The calibration lookup calls it before saying a threshold is missing: a calibration pass over
    a checkpoint that fails here would fail the same way (``features=dense`` over a gate with only ``all``).

    Raises:
        CheckpointError: missing or corrupt, or any of the above does not hold.
    """
    cfg = Path(path) / "config.json"
    try:
        doc = json.loads(cfg.read_text())
        if doc.get("kind") != "read":
            raise CheckpointError(f"{cfg} is not a read-gate checkpoint (kind {doc.get('kind')!r})")
    except (OSError, ValueError, AttributeError) as exc:  # ValueError: not JSON, or not UTF-8 text at all
        raise CheckpointError(f"read-gate checkpoint {cfg} is missing or corrupt: {exc}") from None
    made = doc.get("decide", "answer")  # checkpoints from before the prefill mode decide after the answer
    if made != decide:
        raise CheckpointError(f"read-gate checkpoint {path} was made for decide={made}, not decide={decide}: pass "
                              f"--param decide={made}, or train one with `fastgate train read --decide {decide}`")
    name = model.name if model is not None else model_name
    if name is not None:
        fp = getattr(model, "fingerprint", "")
        if doc.get("model") != name or (doc.get("model_fingerprint") and fp and doc["model_fingerprint"] != fp):
            raise CheckpointError(f"read-gate checkpoint {path} was trained for model {doc.get('model')}, not "
                                  f"{name}: train one with `fastgate train read --model {name}`")
    if decide == "answer" and base is not None and doc.get("base") != base:
        raise CheckpointError(f"read-gate checkpoint {path} was trained over {doc.get('base')}, not {base}")
    models = doc.get("models", {})
    if features not in models:
        # the way out: a set it has, or a gate trained with this one (`fastgate train read` fits both by default)
        mode = f" --decide {decide}" if decide != "answer" else (f" --base {base}" if base else "")
        way = f"pass --param features={next(iter(models))}, or " if models else ""
        raise CheckpointError(f"read-gate checkpoint {path} has no {features!r} model (has: "
                              f"{', '.join(models) or 'none'}): {way}train one with `fastgate train read{mode} "
                              f"--features {features}`")
    return doc


def _load(path: str | Path, features: str, *, model: Any, base: str | None, decide: str
          ) -> tuple[ReadModel | GainModel | ShiftGainModel, dict[str, Any]]:
    doc = check_read_checkpoint(path, features, model=model, base=base, decide=decide)
    score = doc.get("score", "log-odds")  # checkpoints from before the gain model score log-odds
    if score not in SCORES:
        raise CheckpointError(f"read-gate checkpoint {path}: unknown score {score!r} (known: {', '.join(SCORES)})")
    known = set(FEATURE_SETS["all"]) if decide == "answer" else None

    def part(g: Mapping[str, Any]) -> ReadModel:
        """One logistic model of the set; every one goes through here. A feature this fastgate does not compute (a
        renamed or foreign one) loaded, then failed every question ("missing")."""
        model = _read_model(g)
        if known is not None and not set(model.features) <= known:
            raise CheckpointError(f"read-gate checkpoint {path}: its {features!r} model reads feature(s) this "
                                  f"fastgate does not compute: {', '.join(sorted(set(model.features) - known))}")
        return model

    try:
        m = doc["models"][features]
        if score == "shift-gain":
            def gain(g):
                return GainModel(part(g["fix"]), part(g["harm"]))

            return ShiftGainModel(part(m["answerable"]), gain(m["on"]), gain(m["off"]), float(m["prior"]),
                                  float(m["rate"])), doc
        if score == "gain":
            return GainModel(part(m["fix"]), part(m["harm"])), doc
        return part(m), doc
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"read-gate checkpoint {path}: corrupt {features!r} model ({exc})") from None


class ReadGate(Gate):
    """Read iff the model's score is ``>= threshold``: the expected accuracy gain of a read (a
    :class:`ShiftGainModel` or :class:`GainModel`) against the price of a read, or (older checkpoints) a
    :class:`ReadModel`'s log-odds that reading fixes the answer.

    The signal is a feature dict (:func:`read_features`, or :func:`prefill_features` in the ``prefill`` mode). Over a
    :class:`ShiftGainModel` the gate keeps one number of state, ``share``: its estimate of the answerable share of
    the questions it has scored, starting at the training share and moved by each question it scores
    (:meth:`ShiftGainModel.adapt`), under a lock (a server's requests share the gate).
    """

    name = "read"

    def __init__(self, model: ReadModel | GainModel | ShiftGainModel, threshold: float) -> None:
        self.model = model
        self.threshold = float(threshold)
        self.share = model.prior if isinstance(model, ShiftGainModel) else None
        self._lock = threading.Lock()

    @property
    def batch_key(self):
        return ("read", id(self.model))

    def scores(self, signals: Sequence[Mapping[str, float]]) -> torch.Tensor:
        return self._scores(signals)[0]

    def _scores(self, signals: Sequence[Mapping[str, float]]) -> tuple[torch.Tensor, float | None]:
        """``[N]`` scores and the share estimate right after them (None: not a shift-gain gate), read under the
        same lock: a server's other requests move ``self.share`` before this batch's programs resume."""
        if isinstance(self.model, ShiftGainModel):
            with self._lock:
                out, self.share = self.model.adapt(list(signals), self.share)
                share = self.share
            return torch.from_numpy(out), share  # [N] float64
        return torch.from_numpy(self.model.score(list(signals))), None  # [N] float64

    def step(self, score: float, signal=None, share: float | None = None) -> ReadStep:
        return ReadStep(self.name, float(score), self.threshold, bool(score >= self.threshold), share)

    def decide(self, signals: Sequence[Mapping[str, float]]) -> list[ReadStep]:
        if not signals:
            return []
        scores, share = self._scores(signals)
        return [self.step(float(s), x, share) for s, x in zip(scores, signals)]


@dataclass(frozen=True)
class ReadStep(GateStep):
    """A read-gate decision, with the gate's answerable-share estimate after the batch of scores it was made in
    (None: not a shift-gain gate). Reported in the answer's details, not in the gate step's dict."""

    share: float | None = None
