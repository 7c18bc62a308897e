"""SeaKR's self-aware uncertainty gate: the eigenscore of k sampled generations' EOS states."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.generation import GenerationBatch
from fastgate.errors import InputError
from fastgate.gates.base import Gate, GateStep
from fastgate.ops import Ops, build_ops

__all__ = ["EigenScoreGate", "PathChoice"]


class EigenScoreGate(Gate):
    """Retrieve iff ``eigenscore(H_EOS of k samples) > δ`` (SeaKR §3.4; op 2 in docs/ARCHITECTURE.md).

    The signal is the :class:`~fastgate.engine.local.GenerationBatch` of one context's k samples, generated with
    ``taps=gate.taps``. Signals with fewer samples are padded with invalid rows, so one launch scores them all.

    Args:
        k: samples per context (SeaKR: 20).
        delta: threshold (SeaKR: −6).
        alpha: Gram ridge (SeaKR: 1e-3).
        mid_layer: layer of the EOS state; None = ``n_layers // 2``.
        scale: None (SeaKR) or ``"cov"`` (INSIDE).
        ops: the gating ops to run on (an engine's ``ops``); default the torch reference.
    """

    name = "eigenscore"

    def __init__(self, k: int = 20, delta: float = -6.0, alpha: float = 1e-3, mid_layer: int | None = None,
                 scale: str | None = None, ops: Ops | None = None) -> None:
        if k < 2:
            raise InputError(f"the eigenscore needs k >= 2 samples, got {k}")
        self.ops = ops or build_ops("torch")
        self.k = int(k)
        self.delta = float(delta)
        self.alpha = float(alpha)
        self.scale = scale
        self.taps = TapSpec(eos_state=True, mid_layer=mid_layer)

    @property
    def batch_key(self):
        return ("eigenscore", self.alpha, self.scale, id(self.ops))

    def scores(self, signals: Sequence[GenerationBatch]) -> torch.Tensor:
        """``[B]`` eigenscores, one per k-sample batch, from one eigenscore launch."""
        if not signals:
            return torch.zeros(0)
        for b in signals:
            if b.eos_state is None:
                raise InputError("the eigenscore gate needs EOS states; generate with taps=gate.taps")
        k = max(b.eos_state.shape[0] for b in signals)
        d = signals[0].eos_state.shape[1]
        z = signals[0].eos_state.new_zeros((len(signals), k, d))  # [B, k, d]
        valid = torch.zeros((len(signals), k), dtype=torch.bool)  # [B, k]
        for i, b in enumerate(signals):
            n = b.eos_state.shape[0]
            z[i, :n] = b.eos_state
            # an empty sample carries no answer: SeaKR drops it from the Gram matrix
            valid[i, :n] = torch.tensor([bool(s.text.strip()) for s in b.sequences])
        return self.ops.eigenscore(z, self.alpha, valid.to(z.device), self.scale).cpu()

    def step(self, score: float, signal=None) -> GateStep:
        return GateStep(self.name, float(score), self.delta, bool(score > self.delta))

    @staticmethod
    def sampling(max_new_tokens: int, stop: tuple[str, ...], temperature: float = 1.0, top_k: int = 50,
                 top_p: float = 0.9, seed: int | None = 0) -> GenerationConfig:
        """SeaKR's sampling settings (T=1.0, top-k 50, top-p 0.9)."""
        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=stop)


class PathChoice(Gate):
    """SeaKR's self-aware reasoning: take the knowledge path iff its eigenscore is below the rationale path's.

    The signal is ``(knowledge_samples, rationale_samples)``; both eigenscores come from one launch of ``eigen``'s
    op. The step reports the knowledge path's score against the rationale path's as its threshold.
    """

    name = "knowledge_path_eigenscore"

    def __init__(self, eigen: EigenScoreGate) -> None:
        self.eigen = eigen
        self.taps = eigen.taps

    @property
    def batch_key(self):
        return ("path",) + self.eigen.batch_key

    def scores(self, signals: Sequence[tuple[GenerationBatch, GenerationBatch]]) -> torch.Tensor:
        flat = [b for pair in signals for b in pair]
        return self.eigen.scores(flat).view(len(signals), 2)  # [B, 2]: knowledge, rationale

    def step(self, score: torch.Tensor, signal=None) -> GateStep:
        k, r = float(score[0]), float(score[1])
        return GateStep(self.name, k, r, bool(k < r))
