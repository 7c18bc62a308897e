"""Gate interface: turn the engine's taps into a score and a retrieve/skip decision for a whole batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from fastgate.config import TapSpec
from fastgate.engine import GenerationBatch

__all__ = ["Gate", "GateDecision", "GateStep"]


@dataclass(frozen=True)
class GateStep:
    """One gate evaluation for one question, as reported in results."""

    gate: str
    score: float
    threshold: float
    retrieve: bool

    def to_dict(self) -> dict[str, object]:
        return {"gate": self.gate, "score": self.score, "threshold": self.threshold, "retrieve": self.retrieve}


@dataclass(frozen=True)
class GateDecision:
    """Scores and decisions for a batch."""

    scores: torch.Tensor  # [N] float32
    retrieve: list[bool]  # [N]
    threshold: float
    gate: str

    def step(self, i: int) -> GateStep:
        return GateStep(self.gate, float(self.scores[i]), self.threshold, self.retrieve[i])


class Gate(Protocol):
    """A retrieval trigger. ``taps`` says what the engine must capture for :meth:`decide`."""

    name: str
    taps: TapSpec

    def decide(self, batch: GenerationBatch) -> GateDecision:
        ...
