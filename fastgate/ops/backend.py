"""Choose, once, whether the gating ops run as fused Triton kernels, C++ on CPU, or as their torch references.

``auto`` picks Triton when the tensors live on CUDA and ``triton`` imports; on CPU it picks ``ext`` when the C++
extension is built (its eigenscore; the tap accumulate and the prober stay torch, where they already cost ~nothing),
and torch otherwise or with ``FASTGATE_BACKEND=torch``. ``triton`` insists: it fails unless Triton imports and the
device is CUDA, or ``TRITON_INTERPRET=1`` is set (the interpreter runs the kernels on CPU tensors; CI tests them that
way). ``ext`` insists on the extension and a CPU device.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from fastgate.errors import BackendUnavailableError, InputError
from fastgate.ops import reference

__all__ = ["GateOps", "gate_ops", "resolve_backend", "triton_available"]

Backend = Literal["auto", "triton", "ext", "torch"]


def triton_available() -> bool:
    """Whether ``triton`` and the kernels import."""
    try:
        importlib.import_module("fastgate.kernels.probe")
        importlib.import_module("fastgate.kernels.gram")
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device | str) -> Literal["triton", "ext", "torch"]:
    """``auto|triton|ext|torch`` -> the backend that will run on ``device``."""
    from fastgate.ops import ext_available

    if backend not in ("auto", "triton", "ext", "torch"):
        raise InputError(f"unknown backend {backend!r}; choose auto, triton, ext or torch")
    device = torch.device(device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if os.environ.get("FASTGATE_BACKEND", "").lower() in ("torch", "python"):
            return "torch"
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "ext" if device.type == "cpu" and ext_available() else "torch"
    if backend == "ext":
        if device.type != "cpu":
            raise BackendUnavailableError(f"backend 'ext' runs on CPU tensors, not {device.type}; use 'auto'")
        if not ext_available():
            raise BackendUnavailableError("backend 'ext' needs the C++ extension fastgate._C: reinstall with `pip "
                                          "install -e .` (needs cmake and a C++ compiler), or use 'auto' or 'torch'")
        return "ext"
    if not triton_available():
        raise BackendUnavailableError("backend 'triton' needs the triton package: pip install triton (Linux), or "
                                      "use backend='auto' or 'torch'")
    if device.type != "cuda" and not interpret:
        raise BackendUnavailableError(f"backend 'triton' runs on CUDA tensors, not {device.type} (set "
                                      "TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)")
    return "triton"


@dataclass(frozen=True)
class GateOps:
    """The three gating ops bound to one backend."""

    backend: Literal["triton", "ext", "torch"]
    accumulate: Callable[..., None]  # (running_sum [B,L,d], states [B,L,d], weight [B]) -> None, in place
    probe_logits: Callable[..., torch.Tensor]  # (sums [B,L,d], counts [B], ProbeParams) -> [B,L,2]
    eigenscore: Callable[..., torch.Tensor]  # (z [B,k,d], alpha, valid, scale) -> [B]


def gate_ops(backend: str = "auto", device: torch.device | str = "cpu") -> GateOps:
    """Bind the gating ops for ``device`` (see :func:`resolve_backend`)."""
    chosen = resolve_backend(backend, device)
    if chosen == "torch":
        return GateOps("torch", reference.accumulate_taps, reference.probe_logits, reference.eigenscore)
    if chosen == "ext":
        from fastgate.ops import load

        return GateOps("ext", reference.accumulate_taps, reference.probe_logits, load("ext").eigenscore)
    from fastgate.kernels import gram, probe

    return GateOps("triton", probe.accumulate, probe.probe_logits, gram.eigenscore)
