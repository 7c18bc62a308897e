"""Gates: retrieval triggers computed from the engine's taps."""

from fastgate.gates.base import Gate, GateStep
from fastgate.gates.uncertainty import AnswerNLLGate

__all__ = ["AnswerNLLGate", "Gate", "GateStep"]
