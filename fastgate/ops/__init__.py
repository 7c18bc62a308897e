"""The gates' functional ops (docs/ARCHITECTURE.md, Ops), and the one entry point that binds each of them to an
implementation.

Every consumer gets its ops from :func:`build_ops` (:mod:`fastgate.ops.registry`): one frozen :class:`Ops` holding
every op (accumulate, probe_logits, eigenscore, answer_nll, align_words, word_logprobs, align_word_logprobs_batch,
ais_scores, ais_scores_batch, ais_topk_batch), chosen once for a requested backend and a device, with the choice of
each op recorded in ``ops.backends``::

    ops = fastgate.ops.build_ops("auto", engine.device)   # or engine.ops
    words, ids = ops.align_words(pieces)

Implementations: the C++ extension ``fastgate._C`` (``ext``), the fused Triton kernels in ``kernels/`` (``triton``),
and the references: torch for the tensor ops (:mod:`fastgate.ops.reference`), numpy for the CPU ops
(:mod:`fastgate.ops._python`). ``FASTGATE_BACKEND`` (read once per build, by :func:`env_backend`) applies where
``auto`` is asked; ``torch`` or ``python`` forces the references. A test or benchmark that wants one reference op by
itself imports it from :mod:`fastgate.ops.reference` (torch) or :mod:`fastgate.ops._python` (numpy).
"""

from __future__ import annotations

from fastgate.ops._python import AIS_MODES, AisMode
from fastgate.ops.reference import ProbeParams
from fastgate.ops.registry import Ops, build_ops, env_backend, ext_available

__all__ = ["AIS_MODES", "AisMode", "Ops", "ProbeParams", "build_ops", "env_backend", "ext_available"]
