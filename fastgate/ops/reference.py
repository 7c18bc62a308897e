"""Torch references of ops 1, 2, 5, 6, 7 and 8 (docs/ARCHITECTURE.md, Ops): the prober MLP, SeaKR's eigenscore and
DTR's answer NLL; the engine's decode attention over a bf16 store, its norm and rotary embedding, and its prompt
chunks' attention.

They define the semantics the fused Triton kernels (``kernels/``) and the C++ ops are tested against. The gating ops
return float32; the layer ops (``rms_norm``, ``rope``, ``decode_attention_step``, ``prefill_attention``) keep their
inputs' dtype.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from fastgate.errors import ShapeError

__all__ = ["NON_FINITE_Z", "ProbeParams", "accumulate_taps", "answer_nll", "check_decode_attention_args",
           "check_eigenscore_args", "decode_attention", "decode_attention_step", "eigenscore", "prefill_attention",
           "prefill_mask", "probe_logits", "rms_norm", "rope", "token_logprobs"]

LN_EPS = 1e-5  # torch.nn.LayerNorm's default, as in Probing-RAG's released prober


class ProbeParams(NamedTuple):
    """Stacked weights of L probers (one per tapped layer), laid out for ``x @ w`` (Linear weights transposed)."""

    ln0_w: torch.Tensor  # [L, d]
    ln0_b: torch.Tensor  # [L, d]
    w1: torch.Tensor  # [L, d, h]
    b1: torch.Tensor  # [L, h]
    ln1_w: torch.Tensor  # [L, h]
    ln1_b: torch.Tensor  # [L, h]
    w2: torch.Tensor  # [L, h, h]
    b2: torch.Tensor  # [L, h]
    ln2_w: torch.Tensor  # [L, h]
    ln2_b: torch.Tensor  # [L, h]
    w3: torch.Tensor  # [L, h, 2]
    b3: torch.Tensor  # [L, 2]

    @property
    def n_layers(self) -> int:
        return int(self.w1.shape[0])

    @property
    def d(self) -> int:
        return int(self.w1.shape[1])

    @property
    def h(self) -> int:
        return int(self.w1.shape[2])

    def validate(self) -> None:
        """Raise :class:`ShapeError` unless every tensor has the shape implied by ``w1 [L, d, h]``."""
        if self.w1.ndim != 3:
            raise ShapeError(f"ProbeParams.w1 must be [L, d, h], got {tuple(self.w1.shape)}")
        n, d, h = self.w1.shape
        expected = {
            "ln0_w": (n, d), "ln0_b": (n, d), "w1": (n, d, h), "b1": (n, h), "ln1_w": (n, h), "ln1_b": (n, h),
            "w2": (n, h, h), "b2": (n, h), "ln2_w": (n, h), "ln2_b": (n, h), "w3": (n, h, 2), "b3": (n, 2),
        }
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ShapeError(f"ProbeParams.{name} must be {list(shape)} for L={n}, d={d}, h={h}; got {list(got)}")

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> ProbeParams:
        return ProbeParams(*(t.to(device=device, dtype=dtype) for t in self))


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # x [B, L, f], w/b [L, f]: each layer's prober has its own affine parameters
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) * torch.rsqrt(var + LN_EPS) * w + b


def probe_logits(sums: torch.Tensor, counts: torch.Tensor, params: ProbeParams) -> torch.Tensor:
    """Per-layer prober logits from running sums of hidden states (op 1, docs/ARCHITECTURE.md).

    Per (b, l): ``x = sums/counts; x = LN0(x); x = LN1(silu(x@w1+b1)); x = LN2(silu(x@w2+b2)); logits = x@w3+b3``.

    Args:
        sums: ``[B, L, d]`` sum of the generated tokens' hidden states at each tapped layer.
        counts: ``[B]`` number of tokens in the sums (> 0).
        params: the L probers, stacked.

    Returns:
        ``[B, L, 2]`` float32 logits; index 0 = "needs retrieval" (answer wrong), 1 = "answer correct".
    """
    params.validate()
    if sums.ndim != 3 or sums.shape[1:] != (params.n_layers, params.d):
        raise ShapeError(f"probe_logits: sums must be [B, {params.n_layers}, {params.d}], got {tuple(sums.shape)}")
    if counts.shape != (sums.shape[0],):
        raise ShapeError(f"probe_logits: counts must be [{sums.shape[0]}], got {tuple(counts.shape)}")
    if bool((counts <= 0).any()):
        raise ShapeError("probe_logits: every count must be > 0 (a sequence with no generated tokens has no mean)")
    p = params.to(sums.device)
    x = sums.to(torch.float32) / counts.to(torch.float32)[:, None, None]  # [B, L, d]
    x = _layer_norm(x, p.ln0_w, p.ln0_b)
    x = _layer_norm(F.silu(torch.einsum("bld,ldh->blh", x, p.w1) + p.b1), p.ln1_w, p.ln1_b)  # [B, L, h]
    x = _layer_norm(F.silu(torch.einsum("blh,lhk->blk", x, p.w2) + p.b2), p.ln2_w, p.ln2_b)  # [B, L, h]
    return torch.einsum("blh,lhc->blc", x, p.w3) + p.b3  # [B, L, 2]


def check_eigenscore_args(z: torch.Tensor, alpha: float, valid: torch.Tensor | None, scale: str | None
                          ) -> torch.Tensor:
    """Validate :func:`eigenscore`'s inputs (shared with the Triton launcher); returns ``valid [B, k]`` (bool).

    Finiteness is not checked here: a NaN or inf anywhere in a request's z makes its k×k Gram matrix non-finite, so
    each implementation checks the Gram it computes anyway instead of reading all of z a second time.
    """
    if z.ndim != 3:
        raise ShapeError(f"eigenscore: z must be [B, k, d], got {tuple(z.shape)}")
    b, k, d = z.shape
    if k < 1 or d < 2:
        raise ShapeError(f"eigenscore: need k >= 1 samples of d >= 2 features, got k={k}, d={d}")
    if not (alpha > 0 and math.isfinite(alpha)):  # NaN passed `alpha <= 0`: NaN scores, or a Cholesky traceback
        raise ShapeError(f"eigenscore: alpha must be a finite number > 0, got {alpha}")
    if scale not in (None, "cov"):
        raise ShapeError(f"eigenscore: scale must be None or 'cov', got {scale!r}")
    if valid is None:
        valid = torch.ones((b, k), dtype=torch.bool, device=z.device)
    elif valid.shape != (b, k):
        raise ShapeError(f"eigenscore: valid must be [{b}, {k}], got {tuple(valid.shape)}")
    return valid.bool()


NON_FINITE_Z = "eigenscore: z contains NaN or inf (or values whose squares overflow float64)"


def eigenscore(
    z: torch.Tensor, alpha: float = 1e-3, valid: torch.Tensor | None = None, scale: Literal["cov"] | None = None
) -> torch.Tensor:
    """SeaKR's self-aware uncertainty: ``logdet(Zc Zcᵀ + αI) / k'`` over the k' valid samples (op 2,
    docs/ARCHITECTURE.md).

    Each sample's vector is centred over its own d features (what SeaKR's ``J_d = I - 11ᵀ/d`` does, without building
    the d×d matrix); the k'×k' Gram log-determinant comes from a Cholesky factor, in float64.

    Args:
        z: ``[B, k, d]`` hidden states of k samples per request.
        alpha: ridge added to the Gram diagonal (SeaKR: 1e-3).
        valid: optional ``[B, k]`` bool; False drops a sample (e.g. an empty generation).
        scale: ``"cov"`` divides the Gram matrix by ``d - 1`` (INSIDE's covariance form); None keeps SeaKR's.

    Returns:
        ``[B]`` float32; a request with no valid sample gets +inf (no evidence of certainty).
    """
    valid = check_eigenscore_args(z, alpha, valid, scale)
    b, k, d = z.shape
    if b == 0:
        return torch.empty(0, dtype=torch.float32, device=z.device)
    # float64 Gram in chunks of requests: the float64 copy of a chunk stays cache-sized instead of doubling all of z
    chunk = max(1, (1 << 17) // (k * d))
    grams = []
    for start in range(0, b, chunk):
        zd = z[start:start + chunk].to(torch.float64)
        zc = zd - zd.mean(-1, keepdim=True)  # [c, k, d]
        grams.append(zc @ zc.transpose(1, 2))  # [c, k, k]
    gram = torch.cat(grams)  # [B, k, k]
    if not bool(torch.isfinite(gram).all()):  # before the valid mask: a non-finite dropped sample is an error too
        raise ShapeError(NON_FINITE_Z)
    if scale == "cov":
        gram = gram / (d - 1)
    v = valid.to(torch.float64)  # [B, k]
    # invalid samples become identity rows/columns: they add log(1) = 0 to the log-determinant
    m = gram * v[:, :, None] * v[:, None, :] + torch.diag_embed(alpha * v + (1 - v))  # [B, k, k]
    chol = torch.linalg.cholesky(m)  # m is SPD: a PSD Gram plus a positive diagonal
    logdet = 2 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)  # [B]
    n_valid = v.sum(-1)  # [B]
    out = torch.where(n_valid > 0, logdet / n_valid.clamp_min(1), torch.full_like(logdet, float("inf")))
    return out.to(torch.float32)


def accumulate_taps(running_sum: torch.Tensor, states: torch.Tensor, weight: torch.Tensor) -> None:
    """``running_sum += states * weight`` in place: the per-step tap update (reference of the Triton kernel).

    Args:
        running_sum: ``[N, L, d]`` float32.
        states: ``[N, L, d]`` hidden states of the current token at each tapped layer (any float dtype).
        weight: ``[N]`` 1 for sequences whose current token counts, 0 otherwise.
    """
    if running_sum.ndim != 3 or states.shape != running_sum.shape or weight.shape != running_sum.shape[:1]:
        # broadcasting took states [1, L, d] into [N, L, d] sums, where the Triton launcher refuses them
        raise ShapeError(f"accumulate_taps: running_sum [N, L, d], states of its shape and weight [N], got "
                         f"{tuple(running_sum.shape)}, {tuple(states.shape)}, {tuple(weight.shape)}")
    running_sum.add_(states.to(torch.float32) * weight.to(torch.float32)[:, None, None])


def answer_nll(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-prob over masked tokens (op 5, docs/ARCHITECTURE.md, DTR's uncertainty u).

    Args:
        token_logprobs: ``[B, T]`` log-probs of the chosen tokens.
        mask: ``[B, T]`` bool/0-1; DTR excludes the final EOS token through it.

    Returns:
        ``[B]`` float32; a row with an empty mask gets +inf (no evidence of confidence).
    """
    if token_logprobs.ndim != 2 or mask.shape != token_logprobs.shape:
        raise ShapeError(
            f"answer_nll: expected token_logprobs [B, T] and mask of the same shape, got {tuple(token_logprobs.shape)} "
            f"and {tuple(mask.shape)}"
        )
    m = mask.to(torch.float32)  # [B, T]
    # masked-out positions are left out, not multiplied by 0: a -inf log-prob there made the row NaN
    lp = torch.where(m != 0, token_logprobs.to(torch.float32), 0.0)  # [B, T]
    total = -(lp * m).sum(-1)  # [B]
    count = m.sum(-1)  # [B]
    return torch.where(count > 0, total / count.clamp_min(1.0), torch.full_like(total, float("inf")))


def check_decode_attention_args(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                                positions: bool = True) -> None:
    """Shape checks shared by every implementation of :func:`decode_attention`; ``positions=False`` leaves the
    range of ``pos`` to the caller (the C++ kernel checks it without a host-side min / max a layer)."""
    if q.ndim != 3 or keys.ndim != 4 or values.shape != keys.shape:
        raise ShapeError(f"decode_attention: q [m, H, D] and keys / values [R, Hkv, C, D] of one shape, got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    m, heads, dim = q.shape
    if keys.shape[3] != dim or heads % keys.shape[1] or m > keys.shape[0]:
        raise ShapeError(f"decode_attention: q {tuple(q.shape)} does not fit keys {tuple(keys.shape)} (head dim, "
                         "heads a multiple of the key / value heads, rows)")
    if pos.shape != (m,):
        raise ShapeError(f"decode_attention: pos must be [m] = [{m}], got {tuple(pos.shape)}")
    if positions and m and (int(pos.min()) < 0 or int(pos.max()) >= keys.shape[2]):
        raise ShapeError(f"decode_attention: positions must lie in 0..{keys.shape[2] - 1}")


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Decode rows' attention: row ``r``'s heads ``q [m, H, D]`` over columns ``0 .. pos[r]`` of its own row of the
    store ``keys / values [R, Hkv, C, D]`` (rows ``0 .. m - 1``; query head ``h`` reads key / value head
    ``h // (H / Hkv)``), in float32 whatever the store's dtype; ``scale`` defaults to ``D ** -0.5``.

    Returns:
        ``[m, H, D]`` float32.
    """
    check_decode_attention_args(q, keys, values, pos)
    m = q.shape[0]
    width = int(pos.max()) + 1 if m else 1
    k, v = keys[:m, :, :width].to(torch.float32), values[:m, :, :width].to(torch.float32)  # [m, Hkv, W, D]
    mask = (torch.arange(width, device=q.device)[None, :] <= pos[:, None])[:, None, None, :]  # [m, 1, 1, W]
    o = F.scaled_dot_product_attention(q.to(torch.float32).unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != keys.shape[1])  # [m, H, 1, D]
    return o[:, :, 0]


def decode_attention_step(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, pos: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """A pass of decode rows only: row ``r``'s new key and value ``k_new / v_new [m, Hkv, D]`` written at column
    ``pos[r]`` of its store row ``keys / values [R, Hkv, C, D]`` (in place), then :func:`decode_attention` of its
    heads ``q [m, H, D]``; the result ``[m, H, D]`` in ``q``'s dtype."""
    check_decode_attention_args(q, keys, values, pos)  # before the writes: pos -1 wrote the last column, then raised
    want = (q.shape[0], keys.shape[1], keys.shape[3])
    if k_new.shape != want or v_new.shape != want:  # one key head was broadcast into every head of the store
        raise ShapeError(f"decode_attention_step: k_new / v_new must be [m, Hkv, D] = {list(want)}, got "
                         f"{tuple(k_new.shape)}, {tuple(v_new.shape)}")
    rows = torch.arange(q.shape[0], device=q.device)  # [m]
    keys[rows, :, pos] = k_new.to(keys.dtype)
    values[rows, :, pos] = v_new.to(values.dtype)
    return decode_attention(q, keys, values, pos, scale).to(q.dtype)


def check_prefill_attention_args(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Shape checks shared by every implementation of :func:`prefill_attention`."""
    if q.ndim != 4 or keys.ndim != 4 or values.shape != keys.shape or q.shape[0] != 1 or keys.shape[0] != 1:
        raise ShapeError(f"prefill_attention: q [1, H, n, D] and keys / values [1, Hkv, S, D] of one shape, got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    _, heads, n, dim = q.shape
    if keys.shape[3] != dim or heads % keys.shape[1]:
        raise ShapeError(f"prefill_attention: q {tuple(q.shape)} does not fit keys {tuple(keys.shape)} (head dim, "
                         "heads a multiple of the key / value heads)")
    if start < 0 or start + n != keys.shape[2]:
        raise ShapeError(f"prefill_attention: {n} queries from column {start} need start + n = {start + n} key "
                         f"columns, got {keys.shape[2]}")


def prefill_mask(start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The mask of ``n`` queries at columns ``start .. start + n - 1``: ``[n, start + n]`` bool, query ``i`` sees
    columns ``0 .. start + i``; None where it is plain causal (``start == 0``)."""
    if not start:
        return None
    q = torch.arange(start, start + n)[:, None]  # [n, 1]
    return (torch.arange(start + n)[None, :] <= q).to(device)  # [n, start + n]


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                      scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt chunk's attention: ``q [1, H, n, D]``, the chunk's queries at columns ``start .. start + n - 1`` of
    its sequence, over ``keys / values [1, Hkv, start + n, D]`` (the cached prefix, then the chunk), causal; query
    head ``h`` reads key / value head ``h // (H / Hkv)``. ``mask``: a copy of :func:`prefill_mask` the caller built
    once for the chunk (built here otherwise; not read where ``start`` is 0, which is plain causal). torch's SDPA in
    the inputs' dtype.

    Returns:
        ``[1, H, n, D]`` in ``q``'s dtype.
    """
    check_prefill_attention_args(q, keys, values, start)
    if not start:
        mask = None
    elif mask is None:
        mask = prefill_mask(start, q.shape[2], q.device)
    elif mask.shape != (q.shape[2], start + q.shape[2]):
        raise ShapeError(f"prefill_attention: mask must be [n, start + n] = [{q.shape[2]}, {start + q.shape[2]}], got "
                         f"{tuple(mask.shape)}")
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])  # [1, H, n, D]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm``'s arithmetic (Qwen2's and Mistral's are the same) over the last dimension of ``x [..., d]``:
    float32 statistics, ``weight [d] * (x * rsqrt(mean(x^2) + eps))`` rounded to ``x``'s dtype before the product."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding ``x * cos + rotate_half(x) * sin`` of ``x [T, H, D]`` with ``cos``, ``sin [T, 1, D]``
    (``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``): a new ``[T, H, D]``."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, H, D]
    return x * cos + rot * sin


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation of ``gu [T, 2I]`` (the gate and up products side by side): ``silu(gate) * up``
    ``[T, I]`` in ``gu``'s dtype, each rounded as torch rounds it (Llama's, Qwen2's and Mistral's MLP)."""
    inter = gu.shape[-1] // 2
    # in place on silu's fresh output: the bits of ``silu(gate) * up`` without a second [T, I] (a 440-token chunk of
    # qwen2.5-0.5b: 4.3 MB a layer of page faults)
    return F.silu(gu[..., :inter]).mul_(gu[..., inter:])


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token and its log-prob (the decode loop's choice; op 11, docs/ARCHITECTURE.md).

    Args:
        logits: ``[M, V]`` float32.
        chosen: ``[M]`` int64 tokens already chosen (sampled rows); None: each row's argmax (the first largest).

    Returns:
        ``(chosen [M] int64, log_softmax(logits)[r, chosen[r]] [M] float32)``.
    """
    if logits.ndim != 2 or (chosen is not None and chosen.shape != logits.shape[:1]):
        raise ShapeError(f"token_logprobs: expected logits [M, V] and chosen [M], got {tuple(logits.shape)} and "
                         f"{None if chosen is None else tuple(chosen.shape)}")
    logprobs = torch.log_softmax(logits, dim=-1)  # [M, V]
    if chosen is None:
        chosen = logits.argmax(-1)  # [M]
    return chosen, logprobs.gather(-1, chosen[:, None]).squeeze(-1)  # [M] each
