"""SeaKR's self-aware uncertainty gate: the eigenscore of k sampled generations' EOS states."""

from __future__ import annotations

import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine import GenerationBatch
from fastgate.errors import InputError
from fastgate.gates.base import GateDecision
from fastgate.ops.backend import GateOps, gate_ops

__all__ = ["EigenScoreGate"]


class EigenScoreGate:
    """Retrieve iff ``eigenscore(H_EOS of k samples) > δ`` (SeaKR §3.4, SPEC §4 op 2).

    Args:
        k: samples per context (SeaKR: 20).
        delta: threshold (SeaKR: −6).
        alpha: Gram ridge (SeaKR: 1e-3).
        mid_layer: layer of the EOS state; None = ``n_layers // 2``.
        scale: None (SeaKR) or ``"cov"`` (INSIDE).
        ops: the gating ops to run on (an engine's ``gate_ops``); default the torch reference.
    """

    name = "eigenscore"

    def __init__(self, k: int = 20, delta: float = -6.0, alpha: float = 1e-3, mid_layer: int | None = None,
                 scale: str | None = None, ops: GateOps | None = None) -> None:
        if k < 2:
            raise InputError(f"the eigenscore needs k >= 2 samples, got {k}")
        self.ops = ops or gate_ops("torch")
        self.k = int(k)
        self.delta = float(delta)
        self.alpha = float(alpha)
        self.scale = scale
        self.taps = TapSpec(eos_state=True, mid_layer=mid_layer)

    def scores(self, batch: GenerationBatch) -> torch.Tensor:
        """``[B]`` eigenscores of a batch generated with ``k=self.k`` samples per prompt and ``taps=self.taps``."""
        if batch.eos_state is None:
            raise InputError("the eigenscore gate needs EOS states; generate with taps=gate.taps")
        n, d = batch.eos_state.shape
        if n % self.k:
            raise InputError(f"{n} sequences is not a multiple of k={self.k}")
        z = batch.eos_state.view(n // self.k, self.k, d)  # [B, k, d]
        # an empty sample carries no answer: SeaKR drops it from the Gram matrix
        valid = torch.tensor([bool(s.text.strip()) for s in batch.sequences], device=z.device).view(-1, self.k)
        return self.ops.eigenscore(z, self.alpha, valid, self.scale).cpu()

    def decide(self, batch: GenerationBatch) -> GateDecision:
        s = self.scores(batch)
        return GateDecision(s, [bool(x > self.delta) for x in s.tolist()], self.delta, self.name)

    @staticmethod
    def sampling(max_new_tokens: int, stop: tuple[str, ...], temperature: float = 1.0, top_k: int = 50,
                 top_p: float = 0.9, seed: int | None = 0) -> GenerationConfig:
        """SeaKR's sampling settings (T=1.0, top-k 50, top-p 0.9)."""
        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=stop)
