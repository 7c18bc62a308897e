"""Pure-Python/numpy references of the C++ ops in ``csrc/ops.cpp``.

They are the specification the extension is tested against (``tests/test_ops_parity.py``), and the fallback when the
extension is not built. Keep the two in lock-step: same decoding, same word rule, same float64 accumulation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

AisMode = Literal["angle", "sum", "adaptive"]
AIS_MODES: tuple[str, ...] = ("angle", "sum", "adaptive")
# DTR's released reranker (agent/reranker.py, consider_adaptive=True): alpha = slope * arccos(q·p) + intercept
ADAPTIVE_SLOPE = 0.05848
ADAPTIVE_INTERCEPT = 0.45520

_REPLACEMENT = "\ufffd"

# (lead-byte range) -> (continuation bytes needed, allowed range of the first continuation byte); Unicode Table 3-7.
_LEADS: list[tuple[int, int, int, int, int]] = [
    (0xC2, 0xDF, 1, 0x80, 0xBF),
    (0xE0, 0xE0, 2, 0xA0, 0xBF),
    (0xE1, 0xEC, 2, 0x80, 0xBF),
    (0xED, 0xED, 2, 0x80, 0x9F),
    (0xEE, 0xEF, 2, 0x80, 0xBF),
    (0xF0, 0xF0, 3, 0x90, 0xBF),
    (0xF1, 0xF3, 3, 0x80, 0xBF),
    (0xF4, 0xF4, 3, 0x80, 0x8F),
]


def _lead_info(b: int) -> tuple[int, int, int] | None:
    for lo, hi, need, first_lo, first_hi in _LEADS:
        if lo <= b <= hi:
            return need, first_lo, first_hi
    return None


def decode_utf8_owned(data: bytes, byte_owner: Sequence[int]) -> tuple[str, list[int]]:
    """Decode UTF-8 with maximal-subpart replacement; return the text and each character's first-byte owner."""
    chars: list[str] = []
    owner: list[int] = []
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        start_owner = byte_owner[i]
        if b < 0x80:
            chars.append(chr(b))
            owner.append(start_owner)
            i += 1
            continue
        info = _lead_info(b)
        if info is None:
            chars.append(_REPLACEMENT)
            owner.append(start_owner)
            i += 1
            continue
        need, first_lo, first_hi = info
        cp = b & (0x1F if need == 1 else 0x0F if need == 2 else 0x07)
        j = i + 1
        ok = True
        for k in range(need):
            lo, hi = (first_lo, first_hi) if k == 0 else (0x80, 0xBF)
            if j >= n or not (lo <= data[j] <= hi):
                ok = False
                break
            cp = (cp << 6) | (data[j] & 0x3F)
            j += 1
        chars.append(chr(cp) if ok else _REPLACEMENT)
        owner.append(start_owner)
        i = j
    return "".join(chars), owner


def align_words(pieces: Sequence[str] | Sequence[bytes]) -> tuple[list[str], list[int]]:
    """Reference of op 4, docs/ARCHITECTURE.md; see ``CpuOps.align_words`` in :mod:`fastgate.ops._cpu`."""
    pieces = list(pieces)
    kinds = {type(p) for p in pieces}
    if kinds - {str, bytes}:
        bad = next(p for p in pieces if not isinstance(p, (str, bytes)))
        raise TypeError(f"align_words: pieces must all be str or all be bytes, got {type(bad).__name__}")
    if len(kinds) > 1:
        raise TypeError("align_words: pieces must all be str or all be bytes, not a mix")
    if kinds == {bytes}:
        data = b"".join(pieces)
        byte_owner = [t for t, p in enumerate(pieces) for _ in range(len(p))]
        text, owner = decode_utf8_owned(data, byte_owner)
    else:
        text = "".join(pieces)
        owner = [t for t, p in enumerate(pieces) for _ in range(len(p))]
    n = len(text)
    alnum = [c.isalnum() for c in text]
    words: list[str] = []
    word_ids = [-1] * len(pieces)
    in_word = False
    for i, c in enumerate(text):
        joiner = c in "'-" and 0 < i < n - 1 and alnum[i - 1] and alnum[i + 1]
        if not (alnum[i] or joiner):
            in_word = False
            continue
        if not in_word:
            words.append("")
            in_word = True
        words[-1] += c
        if word_ids[owner[i]] < 0:
            word_ids[owner[i]] = len(words) - 1
    return words, word_ids


def word_logprobs(token_logprobs: np.ndarray, word_ids: np.ndarray, n_words: int = -1) -> np.ndarray:
    """Reference of op 4's word log-probs, docs/ARCHITECTURE.md (mean token log-prob per word, float64 accumulation,
    float32 result)."""
    lp = np.asarray(token_logprobs, dtype=np.float64)
    ids = np.asarray(word_ids, dtype=np.int64)
    if lp.ndim != 1 or ids.ndim != 1:
        raise ValueError("word_logprobs: token_logprobs and word_ids must be 1-D")
    if lp.shape[0] != ids.shape[0]:
        raise ValueError(f"word_logprobs: token_logprobs has {lp.shape[0]} entries but word_ids has {ids.shape[0]}")
    W = int(ids.max(initial=-1)) + 1 if n_words < 0 else n_words
    sums = [0.0] * W
    counts = [0] * W
    for value, w in zip(lp.tolist(), ids.tolist()):
        if w < 0:
            continue
        if w >= W:
            raise ValueError(f"word_logprobs: word id {w} >= n_words {W}")
        sums[w] += value
        counts[w] += 1
    return np.array([s / c if c else 0.0 for s, c in zip(sums, counts)], dtype=np.float32)


def _check_mode(mode: str) -> None:
    if mode not in AIS_MODES:
        raise ValueError(f"ais_scores: mode must be 'angle', 'sum' or 'adaptive', got '{mode}'")


def _check_finite(name: str, *arrays: np.ndarray) -> None:
    for a in arrays:
        if not np.isfinite(a).all():
            raise ValueError(f"{name}: inputs contain NaN or inf")


def _ais(s1: np.ndarray, s2: np.ndarray, mode: str, s0: np.ndarray | float) -> np.ndarray:
    """The AIS score from ``s1 = cos(q, d)``, ``s2 = cos(p, d)`` and ``s0 = cos(q, p)`` (float64; all clipped)."""
    s1 = np.clip(s1, -1.0, 1.0)
    s2 = np.clip(s2, -1.0, 1.0)
    if mode == "angle":
        return s1 * s2 - np.sqrt(1.0 - s1 * s1) * np.sqrt(1.0 - s2 * s2)
    if mode == "adaptive":  # the angles to q and p, weighted by how far apart q and p are
        alpha = ADAPTIVE_SLOPE * np.arccos(np.clip(s0, -1.0, 1.0)) + ADAPTIVE_INTERCEPT
        return -(alpha * np.arccos(s1) + (1.0 - alpha) * np.arccos(s2))
    return s1 + s2


def ais_scores(q: np.ndarray, p: np.ndarray, docs: np.ndarray, mode: str = "angle") -> np.ndarray:
    """Reference of op 3, docs/ARCHITECTURE.md for one query: ``[n]`` float32."""
    _check_mode(mode)
    q64, p64, d64 = (np.asarray(a, dtype=np.float32).astype(np.float64) for a in (q, p, docs))
    if q64.ndim != 1 or p64.ndim != 1 or d64.ndim != 2:
        raise ValueError("ais_scores: expected q [d], p [d], docs [n, d]")
    if p64.shape[0] != q64.shape[0] or d64.shape[1] != q64.shape[0]:
        raise ValueError(
            f"ais_scores: dimension mismatch: q has d={q64.shape[0]}, p has d={p64.shape[0]}, docs has d={d64.shape[1]}"
        )
    _check_finite("ais_scores", q64, p64, d64)
    return _ais(d64 @ q64, d64 @ p64, mode, float(q64 @ p64)).astype(np.float32)


def ais_scores_batch(Q: np.ndarray, P: np.ndarray, D: np.ndarray, mode: str = "angle") -> np.ndarray:
    """Reference of op 3, docs/ARCHITECTURE.md batched: ``Q [B,d], P [B,d], D [B,n,d] -> [B,n]`` float32."""
    _check_mode(mode)
    Q64, P64, D64 = (np.asarray(a, dtype=np.float32).astype(np.float64) for a in (Q, P, D))
    if Q64.ndim != 2 or P64.ndim != 2 or D64.ndim != 3:
        raise ValueError("ais_scores_batch: expected Q [B, d], P [B, d], D [B, n, d]")
    B, d = Q64.shape
    if P64.shape[0] != B or D64.shape[0] != B:
        raise ValueError(f"ais_scores_batch: batch mismatch: Q has B={B}, P has {P64.shape[0]}, D has {D64.shape[0]}")
    if P64.shape[1] != d or D64.shape[2] != d:
        raise ValueError(
            f"ais_scores_batch: dimension mismatch: Q has d={d}, P has {P64.shape[1]}, D has {D64.shape[2]}"
        )
    _check_finite("ais_scores_batch", Q64, P64, D64)
    s1 = np.einsum("bnd,bd->bn", D64, Q64)  # [B, n]
    s2 = np.einsum("bnd,bd->bn", D64, P64)  # [B, n]
    s0 = np.einsum("bd,bd->b", Q64, P64)[:, None]  # [B, 1]
    return _ais(s1, s2, mode, s0).astype(np.float32)


def align_word_logprobs_batch(batch_pieces: Sequence[Sequence[str] | Sequence[bytes]],
                              batch_logprobs: Sequence[np.ndarray]) -> list[tuple[list[str], list[int], np.ndarray]]:
    """``align_words`` + ``word_logprobs`` for many sequences: ``[(words, word_ids, word_logprobs [W])]``."""
    if len(batch_pieces) != len(batch_logprobs):
        raise ValueError(f"align_word_logprobs_batch: {len(batch_pieces)} piece lists but {len(batch_logprobs)} "
                         "log-prob arrays")
    out = []
    for b, (pieces, lp) in enumerate(zip(batch_pieces, batch_logprobs)):
        lp = np.asarray(lp, dtype=np.float64)
        if lp.ndim != 1:
            raise ValueError(f"align_word_logprobs_batch: log-probs of sequence {b} must be a 1-D array")
        if lp.shape[0] != len(pieces):
            raise ValueError(f"align_word_logprobs_batch: sequence {b} has {len(pieces)} pieces but {lp.shape[0]} "
                             "log-probs")
        words, ids = align_words(list(pieces))
        out.append((words, ids, word_logprobs(lp, np.asarray(ids, dtype=np.int64), len(words))))
    return out


def ais_topk_batch(Q: np.ndarray, P: np.ndarray, D: np.ndarray, k: int, mode: str = "angle"
                   ) -> tuple[np.ndarray, np.ndarray]:
    """AIS scores and the top-k documents per row, best first (ties: lower index first)."""
    if k < 1:
        raise ValueError(f"ais_topk_batch: k must be >= 1, got {k}")
    scores = ais_scores_batch(Q, P, D, mode)  # [B, n]
    kk = min(k, scores.shape[1])
    order = np.argsort(-scores, axis=1, kind="stable")[:, :kk]  # [B, kk]
    return np.take_along_axis(scores, order, axis=1), order.astype(np.int64)


def eigenscore(z: np.ndarray, valid: np.ndarray, alpha: float, cov: bool = False) -> np.ndarray:
    """SeaKR's eigenscore of ``z [B, k, d]`` over the ``valid [B, k]`` samples (``cov``: INSIDE's covariance form);
    the torch reference does the work."""
    import torch

    from fastgate.ops.reference import eigenscore as reference

    out = reference(torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32)), alpha,
                    torch.from_numpy(np.asarray(valid, dtype=bool)), "cov" if cov else None)
    return out.numpy()
