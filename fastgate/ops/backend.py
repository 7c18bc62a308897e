"""The gating ops (tap accumulate, prober, eigenscore) as a :class:`GateOps`: a view of the ops registry.

The choice itself is :func:`fastgate.ops.registry.build_ops`'s (one parse of ``FASTGATE_BACKEND``, the reference as
fallback for inputs a fast implementation cannot run); this module keeps the older ``gate_ops(backend, device)`` entry
point and the ``GateOps`` record that gates and the reference engine are typed against. ``auto|triton|ext|torch``:
see :mod:`fastgate.ops.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastgate.errors import InputError
from fastgate.ops.registry import Ops, build_ops, gate_backend, triton_available

__all__ = ["GateOps", "gate_ops", "resolve_backend", "triton_available"]

GATE_BACKENDS = ("auto", "triton", "ext", "torch")


def _check(backend: str) -> None:
    if backend not in GATE_BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose auto, triton, ext or torch")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """``auto|triton|ext|torch`` -> the backend the gating ops will run on ``device``."""
    _check(backend)
    return gate_backend(backend, device)


@dataclass(frozen=True)
class GateOps:
    """The three gating ops bound to one backend."""

    backend: str  # "triton" | "ext" | "torch" (or "reference" for the reference engine's)
    accumulate: Callable[..., None]  # (running_sum [B,L,d], states [B,L,d], weight [B]) -> None, in place
    probe_logits: Callable[..., torch.Tensor]  # (sums [B,L,d], counts [B], ProbeParams) -> [B,L,2]
    eigenscore: Callable[..., torch.Tensor]  # (z [B,k,d], alpha, valid, scale) -> [B]

    @classmethod
    def of(cls, ops: Ops) -> GateOps:
        """The gating ops of a registry :class:`~fastgate.ops.registry.Ops`."""
        return cls(ops.backend, ops.accumulate, ops.probe_logits, ops.eigenscore)


def gate_ops(backend: str = "auto", device: torch.device | str = "cpu") -> GateOps:
    """Bind the gating ops for ``device``: the registry's choice, as a :class:`GateOps`."""
    _check(backend)
    return GateOps.of(build_ops(backend, device))
