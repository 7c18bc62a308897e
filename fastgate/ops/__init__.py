"""Functional ops of SPEC §4, and the registry that binds each of them to an implementation.

Every consumer gets its ops from :func:`build_ops` (:mod:`fastgate.ops.registry`): one frozen :class:`Ops` holding
every op (accumulate, probe_logits, eigenscore, answer_nll, align_words, word_logprobs, align_word_logprobs_batch,
ais_scores, ais_scores_batch, ais_topk_batch), chosen once for a requested backend and a device, with the choice of
each op recorded in ``ops.backends``::

    ops = fastgate.ops.build_ops("auto", engine.device)   # or engine.ops
    words, ids = ops.align_words(pieces)

Implementations: the C++ extension ``fastgate._C`` (``ext``), the fused Triton kernels in ``kernels/`` (``triton``),
and the references: torch for the tensor ops (:mod:`fastgate.ops.reference`), numpy for the CPU ops
(:mod:`fastgate.ops._python`). ``FASTGATE_BACKEND`` (read once per build, by :func:`env_backend`) applies where
``auto`` is asked; ``torch`` or ``python`` forces the references.

:func:`load` (the CPU ops as a :class:`CpuOps`) and :func:`fastgate.ops.backend.gate_ops` (the gating ops as a
``GateOps``) are the older entry points, kept as thin views of the registry's choice. The module-level
``probe_logits``, ``eigenscore`` and ``answer_nll`` are the torch references; the module-level CPU ops run on the
``auto`` choice, made on first use.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fastgate.ops._cpu import CpuOps
from fastgate.ops._python import AIS_MODES, AisMode
from fastgate.ops.reference import ProbeParams, answer_nll, eigenscore, probe_logits
from fastgate.ops.registry import Ops, build_ops, cpu_backend, cpu_ops, env_backend, ext_available

__all__ = [
    "AIS_MODES",
    "AisMode",
    "CpuOps",
    "Ops",
    "ProbeParams",
    "ais_scores",
    "ais_scores_batch",
    "align_words",
    "answer_nll",
    "build_ops",
    "eigenscore",
    "env_backend",
    "ext_available",
    "load",
    "probe_logits",
    "word_logprobs",
]


def load(backend: str = "auto") -> CpuOps:
    """The CPU ops (align_words, word_logprobs, AIS, the C++ eigenscore) on the registry's choice for ``backend``.

    Args:
        backend: ``ext`` (C++; raises if the extension is not built), ``python``, or ``auto`` (``ext`` when
            importable; ``FASTGATE_BACKEND=python|torch`` forces ``python``).
    """
    if backend not in ("auto", "ext", "python"):
        raise ValueError(f"unknown CPU ops backend {backend!r}; choose auto, ext or python")
    return cpu_ops(cpu_backend(backend))


_DEFAULT: CpuOps | None = None


def _default() -> CpuOps:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = load("auto")
    return _DEFAULT


def align_words(pieces: Sequence[str] | Sequence[bytes]) -> tuple[list[str], list[int]]:
    """:meth:`CpuOps.align_words` on the default backend."""
    return _default().align_words(pieces)


def word_logprobs(
    token_logprobs: torch.Tensor | np.ndarray, word_ids: Sequence[int], n_words: int | None = None
) -> torch.Tensor:
    """:meth:`CpuOps.word_logprobs` on the default backend."""
    return _default().word_logprobs(token_logprobs, word_ids, n_words)


def ais_scores(q: torch.Tensor, p: torch.Tensor, docs: torch.Tensor, mode: AisMode = "angle") -> torch.Tensor:
    """:meth:`CpuOps.ais_scores` on the default backend."""
    return _default().ais_scores(q, p, docs, mode)


def ais_scores_batch(Q: torch.Tensor, P: torch.Tensor, D: torch.Tensor, mode: AisMode = "angle") -> torch.Tensor:
    """:meth:`CpuOps.ais_scores_batch` on the default backend."""
    return _default().ais_scores_batch(Q, P, D, mode)
