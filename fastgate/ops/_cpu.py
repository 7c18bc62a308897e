"""The CPU ops (word alignment, word log-probs, AIS, the C++ eigenscore; docs/ARCHITECTURE.md, Ops) bound to one
implementation.

:class:`CpuOps` adapts an implementation module, the C++ extension ``fastgate._C`` or its numpy reference
:mod:`fastgate.ops._python` (both take numpy arrays and raise ``ValueError``), to the tensor API of
docs/ARCHITECTURE.md's ops: tensors
in, float32 tensors out, :class:`~fastgate.errors.ShapeError` for bad shapes. It makes no choice itself: the registry
(:mod:`fastgate.ops.registry`) decides which module each op runs on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import numpy as np
import torch

from fastgate.errors import ShapeError
from fastgate.ops._python import AisMode
from fastgate.ops.reference import check_eigenscore_args

__all__ = ["CpuOps"]


def _to_numpy_f32(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A contiguous float32 numpy view of ``x`` (no copy when it already is one). Both backends reject NaN/inf."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
            x = x.detach().to("cpu", torch.float32)
        x = x.numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


@dataclass(frozen=True)
class CpuOps:
    """The CPU ops bound to one implementation module (``ext``: ``fastgate._C``, ``python``: the numpy reference);
    :func:`fastgate.ops.registry.build_ops` chooses which and binds its methods into an ``Ops``."""

    backend: Literal["ext", "python"]
    _impl: ModuleType

    def _float_op(self, name: str, *args) -> torch.Tensor:
        """Call a numeric op of the backend; its ValueErrors are shape errors. Returns a float32 tensor."""
        try:
            out = getattr(self._impl, name)(*args)
        except ValueError as exc:
            raise ShapeError(str(exc)) from None
        return torch.from_numpy(np.asarray(out, dtype=np.float32))

    def align_words(self, pieces: Sequence[str] | Sequence[bytes]) -> tuple[list[str], list[int]]:
        """Group token pieces into words (op 4, docs/ARCHITECTURE.md).

        Args:
            pieces: text of each generated token, all ``str``, or all ``bytes`` for byte-level pieces that may split a
                UTF-8 character (the concatenation is decoded once; a token owns the characters whose first byte
                lies in it).

        Returns:
            ``(words, word_ids)``: the words in order, and per token the index of the word holding its first word
            character, or -1 for a token without one.
        """
        return self._impl.align_words(list(pieces))

    def word_logprobs(
        self, token_logprobs: torch.Tensor | np.ndarray, word_ids: Sequence[int], n_words: int | None = None
    ) -> torch.Tensor:
        """Mean token log-prob per word (SCAAR eq. 5, the log of the geometric-mean probability).

        Args:
            token_logprobs: ``[T]`` log-probs of the generated tokens.
            word_ids: ``[T]`` from :meth:`align_words`.
            n_words: number of words; default ``max(word_ids) + 1``. A word that owns no token (all its characters
                lie in a token that starts inside an earlier word) gets 0.

        Returns:
            ``[W]`` float32 tensor.
        """
        if isinstance(token_logprobs, torch.Tensor):
            token_logprobs = token_logprobs.detach().cpu().double().numpy()
        lp = np.asarray(token_logprobs, dtype=np.float64)
        ids = np.asarray(word_ids, dtype=np.int64)
        return self._float_op("word_logprobs", lp, ids, -1 if n_words is None else n_words)

    def ais_scores(
        self, q: torch.Tensor, p: torch.Tensor, docs: torch.Tensor, mode: AisMode = "angle"
    ) -> torch.Tensor:
        """Dual-path AIS of ``docs [n, d]`` for one question embedding ``q [d]`` and pseudo-context ``p [d]``.

        Inputs are L2-normalised; ``s1 = docs@q``, ``s2 = docs@p`` and ``s0 = q@p`` are clipped to [-1, 1].
        ``angle``: ``s1*s2 - sqrt(1-s1²)*sqrt(1-s2²)`` = cos(θ1+θ2) (DTR eq. 7); ``sum``: ``s1 + s2`` (DTR's released
        code); ``adaptive``: ``-(α·arccos s1 + (1-α)·arccos s2)`` with ``α = 0.05848·arccos s0 + 0.45520`` (DTR's
        released code, ``consider_adaptive=True``).
        """
        args = (_to_numpy_f32(q), _to_numpy_f32(p), _to_numpy_f32(docs))
        return self._float_op("ais_scores", *args, mode)

    def ais_scores_batch(
        self, Q: torch.Tensor, P: torch.Tensor, D: torch.Tensor, mode: AisMode = "angle"
    ) -> torch.Tensor:
        """Batched :meth:`ais_scores`: ``Q [B,d], P [B,d], D [B,n,d] -> [B,n]``."""
        args = (_to_numpy_f32(Q), _to_numpy_f32(P), _to_numpy_f32(D))
        return self._float_op("ais_scores_batch", *args, mode)

    def align_word_logprobs_batch(self, batch_pieces: Sequence[Sequence[str] | Sequence[bytes]],
                                  batch_logprobs: Sequence[torch.Tensor | np.ndarray | Sequence[float]]
                                  ) -> list[tuple[list[str], list[int], torch.Tensor]]:
        """:meth:`align_words` + :meth:`word_logprobs` for many sequences in one call (the C++ backend releases the
        GIL for the work between reading the inputs and building the results).

        Returns:
            Per sequence ``(words, word_ids, word_logprobs [W] float32)``.
        """
        try:
            out = self._impl.align_word_logprobs_batch([list(p) for p in batch_pieces],
                                                       [_lp_array(x) for x in batch_logprobs])
        except ValueError as exc:
            raise ShapeError(str(exc)) from None
        return [(w, ids, torch.from_numpy(np.asarray(lp, dtype=np.float32))) for w, ids, lp in out]

    def eigenscore(self, z: torch.Tensor, alpha: float = 1e-3, valid: torch.Tensor | None = None,
                   scale: Literal["cov"] | None = None) -> torch.Tensor:
        """SeaKR's eigenscore (op 2, docs/ARCHITECTURE.md) of ``z [B, k, d]`` on CPU: the same semantics and errors as
        :func:`fastgate.ops.reference.eigenscore`. The C++ backend forms each request's float64 Gram matrix with SIMD
        and factors it in place, threads over requests and releases the GIL; ``python`` is the torch reference.

        Returns:
            ``[B]`` float32 (+inf for a request with no valid sample).
        """
        valid = check_eigenscore_args(z, alpha, valid, scale)  # [B, k] bool
        if z.shape[0] == 0:
            return torch.empty(0, dtype=torch.float32)
        mask = np.ascontiguousarray(valid.cpu().numpy()).view(np.uint8)  # bool -> uint8 without a copy
        return self._float_op("eigenscore", _to_numpy_f32(z), mask, float(alpha), scale == "cov")

    def ais_topk_batch(self, Q: torch.Tensor, P: torch.Tensor, D: torch.Tensor, k: int,
                       mode: AisMode = "angle") -> tuple[torch.Tensor, torch.Tensor]:
        """AIS scores of ``D [B,n,d]`` and the top-k per row, best first: ``(scores [B,k'], idx [B,k'])`` with
        ``k' = min(k, n)``; ties keep the lower index first."""
        args = (_to_numpy_f32(Q), _to_numpy_f32(P), _to_numpy_f32(D))
        try:
            s, i = self._impl.ais_topk_batch(*args, int(k), mode)
        except ValueError as exc:
            raise ShapeError(str(exc)) from None
        return torch.from_numpy(np.asarray(s, dtype=np.float32)), torch.from_numpy(np.asarray(i, dtype=np.int64))


def _lp_array(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)
