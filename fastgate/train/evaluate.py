"""Held-out evaluation of a trained gate: CBDR confidence AUROC, Probing-RAG decision accuracy vs the majority class."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgate.ops.reference import probe_logits

__all__ = ["GateEvaluation", "auroc", "evaluate_gate"]


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the probability that a positive scores above a negative (ties count half)."""
    scores, labels = scores.double().flatten(), labels.flatten().bool()
    pos, neg = scores[labels], scores[~labels]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).double().sum()
    ties = (pos[:, None] == neg[None, :]).double().sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


@dataclass(frozen=True)
class GateEvaluation:
    """How a trained gate separates right from wrong answers on held-out questions."""

    n: int
    positive_rate: float  # share of rows whose answer was correct
    auroc: float  # of P(correct) against the labels
    decision_accuracy: float  # the gate's retrieve/skip decision vs "the answer was wrong/right"
    majority_accuracy: float  # always predicting the more frequent class

    def to_dict(self) -> dict[str, float]:
        return {"n": self.n, "positive_rate": self.positive_rate, "auroc": self.auroc,
                "decision_accuracy": self.decision_accuracy, "majority_accuracy": self.majority_accuracy}


def evaluate_gate(params, features: torch.Tensor, labels: torch.Tensor, *, kind: str, threshold: float
                  ) -> GateEvaluation:
    """Score held-out ``features [N, L, d]`` (``[N, 1, d]`` for the confidence model).

    ``probing``: the decision is Probing-RAG's, retrieve iff ``Σ p0 + θ > Σ p1``; it is right when it retrieves exactly
    for the wrong answers. ``confidence``: skip iff ``Conf > β``; right when it skips exactly the correct answers.
    AUROC uses ``Σ_l p1`` (probing) or Conf (confidence) as the score of "correct".
    """
    ones = torch.ones(features.shape[0])
    probs = probe_logits(features, ones, params).softmax(-1)  # [N, L, 2]
    if kind == "probing":
        p0, p1 = probs[..., 0].sum(-1), probs[..., 1].sum(-1)
        score, predicted_correct = p1, ~(p0 + threshold > p1)
    else:
        score = probs[:, 0, 1]
        predicted_correct = score > threshold
    y = labels.bool()
    rate = float(y.float().mean())
    return GateEvaluation(len(y), rate, auroc(score, y), float((predicted_correct == y).float().mean()),
                          max(rate, 1 - rate))
