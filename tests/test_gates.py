"""Gates on constructed inputs: probers, confidence, eigenscore, FLARE and SCAAR word confidence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastgate.config import TapSpec
from fastgate.engine.local import Generation, GenerationBatch
from fastgate.errors import InputError, ShapeError
from fastgate.gates.checkpoints import random_probe_params
from fastgate.gates.eigen import EigenScoreGate
from fastgate.gates.prober import ConfidenceGate, ProberGate
from fastgate.gates.words import FlareGate, ScaarGate, SentenceWords, sentence_words
from fastgate.ops import build_ops, reference

OPS = build_ops("auto", "cpu")


def _gen(text="x", ids=(1,), lps=(-0.1,), answer_tokens=None):
    return Generation(text, list(ids), list(lps), len(ids) if answer_tokens is None else answer_tokens, "eos", 3, False)


def test_word_of_two_tokens_gets_geometric_mean_probability():
    words, ids = OPS.align_words(["Ouaga", "dougou", " is"])
    assert words == ["Ouagadougou", "is"] and ids == [0, 0, 1]
    p = np.exp(OPS.word_logprobs(np.log([0.9, 0.5, 0.7]), ids).numpy())
    assert p[0] == pytest.approx(math.sqrt(0.45), rel=1e-6)
    assert p[1] == pytest.approx(0.7, rel=1e-6)


def test_sentence_words_on_real_tokens(tiny_engine):
    ids = tiny_engine.tokenizer(" The capital is Ouagadougou")["input_ids"]
    lps = [math.log(0.9)] * len(ids)
    (sw,) = sentence_words(tiny_engine, OPS, [_gen("", ids, lps)])
    assert sw.words == ["The", "capital", "is", "Ouagadougou"]
    assert sw.prob == pytest.approx([0.9] * 4, rel=1e-5)
    assert sw.without(1) == "The is Ouagadougou"
    assert [sw.text[a:b] for a, b in sw.spans] == sw.words


def _words(probs, words=None):
    words = words or [f"w{i}" for i in range(len(probs))]
    text = " ".join(words)
    spans, pos = [], 0
    for w in words:
        spans.append((pos, pos + len(w)))
        pos += len(w) + 1
    return SentenceWords(text, words, spans, np.asarray(probs, dtype=np.float64))


def test_flare_gate_threshold_and_masked_query():
    gate = FlareGate(theta=0.5)
    scores = gate.word_scores([_words([0.9, 0.4, 0.8]), _words([0.9, 0.6]), _words([])])
    assert [gate.step(x).retrieve for x in scores.tolist()] == [True, False, False]
    assert float(scores[0]) == pytest.approx(0.4) and float(scores[2]) == 1.0
    assert gate.query(_words([0.9, 0.4, 0.8], ["Paris", "Lyon", "France"])) == "Paris France"


class _FakeEmbedder:
    """Unit vectors whose similarity to the full sentence is set per removed word."""

    def __init__(self, sims: dict[str, float]) -> None:
        self.sims = sims

    def encode(self, texts):
        out = []
        for t in texts:
            missing = [w for w in self.sims if w not in t.split()]
            s = self.sims[missing[0]] if missing else 1.0
            out.append([s, math.sqrt(max(0.0, 1 - s * s))])
        return np.asarray(out)


def test_scaar_contribution_thresholds_and_pfq():
    sims = {"Paris": 0.2, "is": 0.99, "pretty": 0.9, "big": 0.7}  # contributions 0.8, 0.01, 0.1, 0.3
    gate = ScaarGate(_FakeEmbedder(sims), theta=0.5, alpha=0.5)
    sw = _words([0.95, 0.6, 0.6, 0.6], ["Paris", "is", "pretty", "big"])
    (r,) = gate.contributions(["q"], [sw])
    assert r == pytest.approx([0.8, 0.01, 0.1, 0.3], abs=1e-9)
    th = gate.thresholds(r)
    assert th == pytest.approx(0.5 * np.exp(r))  # eq. 3 as printed
    (score,) = gate.word_scores([sw], [r]).tolist()
    # "big": 0.6 < 0.5·e^0.3 = 0.675 -> hallucinated, triggers; "Paris": 0.95 < 0.5·e^0.8 = 1.11 too
    assert gate.step(score).retrieve
    # the score is the θ at which the rule flips, min_w P'(w)·e^{-r(w)}: whatever θ is, retrieve iff score < θ
    assert score == pytest.approx(min(np.array([0.95, 0.6, 0.6, 0.6]) * np.exp(-r)))
    assert gate.step(score).threshold == 0.5 and score == pytest.approx(0.95 * math.exp(-0.8))  # "Paris"
    for theta in (0.0, 0.3, score - 1e-9, score + 1e-9, 0.9):
        other = ScaarGate(_FakeEmbedder(sims), theta=theta, alpha=0.5)
        (x,) = other.word_scores([sw], [r]).tolist()
        rule = bool((np.array([0.95, 0.6, 0.6, 0.6]) < other.thresholds(r)).any())  # any P'(w) < θ_w
        assert x == score and other.step(x).retrieve == rule
    # PFQ: top 50% by contribution = Paris, big; both below their thresholds -> only the question stays
    assert gate.query("Q", sw, r) == "Q"
    confident = _words([1.0, 1.0, 1.0, 1.0], ["Paris", "is", "pretty", "big"])
    assert ScaarGate(_FakeEmbedder(sims), theta=0.3, alpha=0.5).query("Q", confident, r) == "Q Paris big"
    normalized = ScaarGate(_FakeEmbedder(sims), theta=0.5, weighting="normalized")
    assert normalized.thresholds(r) == pytest.approx(0.5 * np.exp(4 * r / r.sum()))


def test_scaar_rejects_bad_parameters():
    with pytest.raises(InputError):
        ScaarGate(None, theta=1.5)
    with pytest.raises(InputError):
        ScaarGate(None, weighting="other")


def test_prober_gate_rule():
    params = random_probe_params(2, 8, 4, seed=5)
    gate = ProberGate(params, (1, 2), theta=0.0)
    sums = torch.randn(4, 2, 8)
    count = torch.tensor([1.0, 2.0, 0.0, 3.0])
    s = gate.prober_scores(sums, count)
    probs = reference.probe_logits(sums[[0, 1, 3]], count[[0, 1, 3]], params).softmax(-1)
    want = probs[..., 0].sum(-1) - probs[..., 1].sum(-1)
    torch.testing.assert_close(s[[0, 1, 3]], want)
    assert math.isinf(float(s[2]))  # no generated tokens: retrieve
    signals = [GenerationBatch([_gen()], sums[i:i + 1], count[i:i + 1], layers=(1, 2)) for i in range(4)]
    torch.testing.assert_close(gate.scores(signals), s)  # one signal per answer, one launch for all
    for theta in (-0.3, 0.0, 0.7):
        steps = ProberGate(params, (1, 2), theta).decide(signals)
        assert [x.retrieve for x in steps] == [bool(x + theta > 0) for x in s.tolist()]
        assert all(x.threshold == -theta for x in steps)
    with pytest.raises(ShapeError):
        ProberGate(params, (1, 2, 3))
    with pytest.raises(InputError, match="running sums"):
        gate.decide([GenerationBatch([_gen()])])


def test_confidence_gate_rule():
    params = random_probe_params(1, 8, 4, seed=6)
    states = torch.randn(5, 8)
    conf = reference.probe_logits(states[:, None], torch.ones(5), params).softmax(-1)[:, 0, 1]
    beta = float(conf.median())
    steps = ConfidenceGate(params, layer=2, beta=beta).decide(list(states))
    assert [x.retrieve for x in steps] == [bool(c <= beta) for c in conf.tolist()]
    assert [x.score for x in steps] == pytest.approx(conf.tolist(), abs=1e-6)
    assert ConfidenceGate(params, 2, beta).taps == TapSpec(pre_answer=True, mid_layer=2)
    with pytest.raises(ShapeError):
        ConfidenceGate(random_probe_params(2, 8, 4), 2)
    with pytest.raises(ShapeError):
        ConfidenceGate(params, 2).confidence(torch.zeros(3, 9))


def test_eigen_gate_groups_samples_and_drops_empty_ones():
    k, d = 4, 16
    torch.manual_seed(0)
    z = torch.randn(2 * k, d)
    z[:k] = z[0]  # request 0: identical samples -> low score
    seqs = [_gen("a") for _ in range(2 * k)]
    seqs[k + 1] = _gen("  ")  # an empty sample of request 1 is dropped
    signals = [GenerationBatch(seqs[:k], eos_state=z[:k]), GenerationBatch(seqs[k:], eos_state=z[k:])]
    gate = EigenScoreGate(k=k, delta=-3.0)  # identical samples: (log(k·|zc|²+α) + 3·log α)/4 ≈ -4
    s = gate.scores(signals)
    valid = torch.tensor([[True] * k, [True, False, True, True]])
    torch.testing.assert_close(s, reference.eigenscore(z.view(2, k, d), valid=valid))
    assert [x.retrieve for x in gate.decide(signals)] == [False, True]
    # a signal with fewer samples is padded with dropped rows: its score is the one it has alone
    short = GenerationBatch(seqs[k:k + 3], eos_state=z[k:k + 3])
    torch.testing.assert_close(gate.scores([signals[0], short])[1], gate.scores([short])[0])
    with pytest.raises(InputError, match="EOS states"):
        gate.scores([GenerationBatch(seqs[:k])])
    with pytest.raises(InputError):
        EigenScoreGate(k=1)
