"""Gate interface: every gate turns signals into scores with one batched op, then applies one decision rule.

The scheduler batches scoring generically: the programs waiting on gates with the same ``batch_key`` get their
scores from one :meth:`Gate.scores` call (one eigenscore or prober launch), and each program's own gate applies its
rule (:meth:`Gate.step`) to its score.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastgate.config import TapSpec

__all__ = ["Gate", "GateStep"]


@dataclass(frozen=True)
class GateStep:
    """One gate evaluation for one question, as reported in results."""

    gate: str
    score: float
    threshold: float
    retrieve: bool

    def to_dict(self) -> dict[str, object]:
        return {"gate": self.gate, "score": self.score, "threshold": self.threshold, "retrieve": self.retrieve}


class Gate:
    """A retrieval trigger: ``signals → scores`` (batched) → one decision rule per signal.

    Subclasses set ``name`` and ``taps`` (what the engine must capture for the signal) and implement :meth:`scores`
    and :meth:`step`.
    """

    name: str = ""
    taps: TapSpec = TapSpec()

    @property
    def batch_key(self) -> Hashable:
        """Gates with equal keys score each other's signals in one call (default: this gate only)."""
        return id(self)

    def scores(self, signals: Sequence[Any]) -> torch.Tensor:  # pragma: no cover - abstract
        """One score per signal ``[N]`` (a row per signal for multi-part scores), from one batched op."""
        raise NotImplementedError

    def step(self, score: Any, signal: Any = None) -> GateStep:  # pragma: no cover - abstract
        """The decision rule for one score."""
        raise NotImplementedError

    def decide(self, signals: Sequence[Any]) -> list[GateStep]:
        """Scores for all signals at once, then the rule for each."""
        if not signals:
            return []
        scores = self.scores(signals)
        return [self.step(s.item() if s.ndim == 0 else s, x) for s, x in zip(scores, signals)]
