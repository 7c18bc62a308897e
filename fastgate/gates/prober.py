"""Learned gates on hidden states: Probing-RAG's per-layer probers and CBDR's pre-answer confidence model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastgate.config import TapSpec
from fastgate.engine.generation import GenerationBatch
from fastgate.errors import InputError, ShapeError
from fastgate.gates.base import Gate, GateStep
from fastgate.ops import Ops, ProbeParams, build_ops

__all__ = ["ConfidenceGate", "ProberGate"]


class ProberGate(Gate):
    """Probing-RAG (Baek et al., 2025): retrieve iff ``Σ_l softmax(prober_l)[0] + θ > Σ_l softmax(prober_l)[1]``.

    Each prober reads the mean hidden state of the generated rationale+answer tokens at its layer, which the engine
    keeps as a running sum, so the decision costs one small MLP per layer. The reported score is
    ``Σ p0 − Σ p1`` and the threshold ``−θ``: retrieve iff score > threshold.

    Args:
        params: the stacked probers, one per entry of ``layers``.
        layers: HF ``hidden_states`` indices the probers read.
        theta: Probing-RAG's threshold (paper default 0; higher retrieves more).
        ops: the gating ops to run on (an engine's ``ops``: fused Triton on CUDA); default the torch reference.
    """

    name = "prober"

    def __init__(self, params: ProbeParams, layers: tuple[int, ...], theta: float = 0.0,
                 ops: Ops | None = None) -> None:
        params.validate()
        self.ops = ops or build_ops("torch")
        if len(layers) != params.n_layers:
            raise ShapeError(f"{params.n_layers} probers for {len(layers)} layers {list(layers)}")
        self.params = params
        self.theta = float(theta)
        self.taps = TapSpec(layers=tuple(layers))

    @property
    def batch_key(self):
        return ("prober", id(self.params), id(self.ops))

    def prober_scores(self, running_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """``Σ p0 − Σ p1`` per sequence ``[N]``; a sequence without generated tokens gets +inf (retrieve)."""
        out = torch.full((running_sum.shape[0],), float("inf"), dtype=torch.float32)
        ok = count > 0
        if bool(ok.any()):
            probs = self.ops.probe_logits(running_sum[ok], count[ok], self.params).softmax(-1)  # [n, L, 2]
            out[ok.cpu()] = (probs[..., 0].sum(-1) - probs[..., 1].sum(-1)).float().cpu()
        return out

    def scores(self, signals: Sequence[GenerationBatch]) -> torch.Tensor:
        """One score per generated answer (the signal: its one-sequence batch with running sums at the probers'
        layers), from one prober launch."""
        for b in signals:
            if b.running_sum is None or b.layers != self.taps.layers:
                raise InputError(f"the prober gate needs running sums at layers {list(self.taps.layers)}; generate "
                                 "with taps=gate.taps")
        sums = torch.cat([b.running_sum for b in signals])  # [N, L, d]
        return self.prober_scores(sums, torch.cat([b.count for b in signals]))

    def step(self, score: float, signal=None) -> GateStep:
        return GateStep(self.name, float(score), -self.theta, bool(score > -self.theta))


class ConfidenceGate(Gate):
    """CBDR (2025): ``Conf = softmax(E(pre_answer))[1]``; skip retrieval iff ``Conf > β``.

    ``E`` is the probe MLP with one layer; ``pre_answer`` is the mid-layer state of the prompt's last token, so the
    decision needs only a prefill. The reported score is Conf; retrieve iff Conf <= β.
    """

    name = "confidence"

    def __init__(self, params: ProbeParams, layer: int, beta: float = 0.95, ops: Ops | None = None) -> None:
        params.validate()
        self.ops = ops or build_ops("torch")
        if params.n_layers != 1:
            raise ShapeError(f"the confidence model has one layer, got {params.n_layers}")
        if not 0.0 <= beta <= 1.0:
            raise InputError(f"beta must be in [0, 1], got {beta}")
        self.params = params
        self.layer = int(layer)
        self.beta = float(beta)
        self.taps = TapSpec(pre_answer=True, mid_layer=self.layer)

    def confidence(self, states: torch.Tensor) -> torch.Tensor:
        """``states [N, d]`` pre-answer states -> Conf ``[N]`` float32 (CPU)."""
        if states.ndim != 2 or states.shape[1] != self.params.d:
            raise ShapeError(f"confidence: states must be [N, {self.params.d}], got {tuple(states.shape)}")
        ones = torch.ones(states.shape[0], dtype=torch.float32, device=states.device)
        return self.ops.probe_logits(states[:, None, :], ones, self.params).softmax(-1)[:, 0, 1].float().cpu()  # [N]

    @property
    def batch_key(self):
        return ("confidence", id(self.params), id(self.ops))

    def scores(self, signals: Sequence[torch.Tensor]) -> torch.Tensor:
        """Conf per pre-answer state (the signal: a ``[d]`` state), from one launch."""
        return self.confidence(torch.stack(list(signals)))

    def step(self, score: float, signal=None) -> GateStep:
        return GateStep(self.name, float(score), self.beta, bool(score <= self.beta))
