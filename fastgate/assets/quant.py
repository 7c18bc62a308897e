"""Weight-only quantized linear layers, chosen once when a model loads (``--weights``).

``float`` keeps every weight in the model's dtype (:mod:`fastgate.assets.precision`). ``int8`` replaces each linear
layer of the decoder blocks (attention q/k/v/o, MLP gate/up/down) by an :class:`Int8Linear`: an int8 weight ``q [N, K]``
with one float32 scale per output channel ``s [N]`` (symmetric, ``s = max|w_n| / 127``), multiplied as

    y = x @ (q * s[:, None]).T + b        (:func:`int8_reference`, the plain torch definition)

Only the weights are quantized: activations, the residual stream, the KV cache, the embedding table, the logits,
taps, gate inputs and log-probs keep the model's dtype, as with ``float``. The LM head is quantized too, as an
:class:`Int8Linear` of its own (per vocabulary row scales) while the embedding table it is tied to in SmolLM2 and
Qwen2.5 stays float: the head is the largest single product of a decode step (SmolLM2: 49,152 × 576, a fifth of the
weights), and the embedding is read one row a token. Its logits come out of the product in the model's dtype (in
bf16 for a float32 model through ``bf16_products``: a relative 2^-9, below the head's own quantization error).

How the product runs (torch 2.13's CPU build; timings in ``bench/bench_engine.py``'s ``weights`` column):

- bf16 activations, at most :data:`KERNEL_ROWS` rows, ``K`` a multiple of 16: ``aten._weight_int8pack_mm``, the
  AVX-512-BF16 weight-only kernel. It reads a quarter of the float32 bytes: on a 2-core EPYC (AVX512-BF16) a
  576 → 1536 product of one row took about 15 µs against 50-75 µs for the dense bf16 product (shared machine).
  Its time grows linearly with the rows (a GEMV per row); beyond ~16 rows the dense product wins, hence the bound.
  With ``K`` not a multiple of 16 the kernel crashed the process in bf16 (a segmentation fault, M > 1), so such
  layers never reach it.
- float32 activations, the same bounds, on a CPU where torch dispatches AVX-512 code
  (:data:`FLOAT32_VIA_BF16`): the rows are rounded to bf16 for the product only and the result cast back to float32
  (``bf16_products``). The kernel's own float32 path is a scalar loop, 6-40x slower than a dense float32 product,
  and the cast weight of the dense path costs more than float32 weights (SmolLM2's batch-1 step took 350 ms
  against 40 ms, shared machine). The rounding of the product's inputs (a relative 2^-9) is of the order of the
  weights' own quantization error (half a step of 1/127 of a row's largest weight); the residual stream, norms,
  attention and KV cache stay float32.
- every other case (more rows: a prefill; ``K`` not a multiple of 16; another device or CPU): the weight is cast to
  the activations' dtype and multiplied densely, then scaled per channel (``(x @ q.T) * s``, equal to the definition
  up to rounding). That reads the int8 bytes and writes a float copy per call; over many rows the copy is small
  beside the product.

A 4-bit form (``aten._weight_int4pack_mm_for_cpu``, groups of 32 with scale and zero, semantics
``w = (q - 8) * scale + zero``; GGUF's Q4_1 blocks ``w = q * d + m`` map onto it exactly with ``scale = d``,
``zero = m + 8 d``) is not offered yet. Timed on one weight in the cache it was no faster than the int8 kernel (1 × 2048
→ 8192 bf16: about 260 µs against 200 µs); timed as a decode step reads them, 30 different 576 → 3072 weights in turn
(out of the caches), one thread of a Zen 4 EPYC: bf16 dense 240 µs, int8 121 µs, int4 66 µs a product, so it would
cut the int8 step's products by about 45%. Its packed layout is not separable by rows (the fused q/k/v and gate/up
products of :mod:`fastgate.engine.fused` need the codes kept in a plain layout and packed after concatenation) and
it needs ``N % 16 == 0`` and ``K % 32 == 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastgate.errors import UnknownNameError

__all__ = [
    "FLOAT32_VIA_BF16",
    "KERNEL_ROWS",
    "WEIGHTS",
    "Int8Linear",
    "canonical_weights",
    "int8_reference",
    "quantize_int8",
    "quantize_model",
    "quantized_layers",
]

WEIGHTS = ("float", "int8")  # what --weights accepts
KERNEL_ROWS = 16  # rows up to which the weight-only kernel beats a dense bf16 product (module docstring)
# float32 rows go through the bf16 kernel where torch runs its AVX-512 code (the kernel's vectorized path)
FLOAT32_VIA_BF16 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
_KERNEL_K_MULTIPLE = 16  # the bf16 kernel's K must be a multiple of this (it crashed otherwise)


def canonical_weights(weights: str) -> str:
    """``weights``' canonical name (``float``, ``int8``); an unknown name raises
    :class:`~fastgate.errors.UnknownNameError` naming the choices."""
    name = {"fp": "float", "none": "float"}.get(str(weights).lower(), str(weights).lower())
    if name not in WEIGHTS:
        raise UnknownNameError("weight format", weights, WEIGHTS)
    return name


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of ``weight [N, K]``: ``(q [N, K] int8, s [N] float32)`` with
    ``|w - q * s| <= s / 2`` elementwise (a row of zeros gets the scale 1)."""
    w = weight.detach().to(torch.float32)  # [N, K]
    amax = w.abs().amax(dim=1)  # [N]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # [N]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return q.contiguous(), scale.contiguous()


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: ``x [..., K] @ (q [N, K] * scale [N, None]).T (+ bias)``, in float32, de-quantized."""
    w = q.to(torch.float32) * scale.to(torch.float32)[:, None]  # [N, K]
    return F.linear(x.to(torch.float32), w, None if bias is None else bias.to(torch.float32))


class Int8Linear(nn.Module):
    """A drop-in for ``nn.Linear`` holding an int8 weight ``[N, K]`` and float32 scales ``[N]`` (buffers, so the
    model's ``parameters()`` still name its float dtype). The output has ``x``'s dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel_rows: int = KERNEL_ROWS) -> None:
        super().__init__()
        if q.dim() != 2 or q.dtype != torch.int8 or scale.shape != (q.shape[0],):
            raise ValueError(f"Int8Linear needs q [N, K] int8 and scale [N]; got {tuple(q.shape)} {q.dtype} and "
                             f"{tuple(scale.shape)}")
        self.out_features, self.in_features = int(q.shape[0]), int(q.shape[1])
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.to(torch.float32).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.kernel_rows = kernel_rows
        self.bf16_products = FLOAT32_VIA_BF16  # float32 rows rounded to bf16 for the kernel (module docstring)
        self.refresh()

    def refresh(self) -> None:
        """Derive what the forward reads from ``q`` and ``scale`` (call after replacing them): the scales in bf16 for
        the kernel, cast once here rather than every call, and whether ``K`` suits the kernel."""
        scale_bf16 = self.scale.to(torch.bfloat16)  # [N]
        if "scale_bf16" in self._buffers:
            self.scale_bf16 = scale_bf16
        else:  # a buffer (moves with the module), left out of the state dict
            self.register_buffer("scale_bf16", scale_bf16, persistent=False)
        self._k_ok = self.in_features % _KERNEL_K_MULTIPLE == 0
        self._kinds = (torch.bfloat16, torch.float32) if self.bf16_products else (torch.bfloat16,)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel_rows: int = KERNEL_ROWS) -> Int8Linear:
        q, scale = quantize_int8(linear.weight)
        q, scale = q.to(linear.weight.device), scale.to(linear.weight.device)
        return cls(q, scale, linear.bias, kernel_rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (2-D, contiguous rows) goes through ``aten._weight_int8pack_mm`` (float32 rows rounded to
        bf16 for it where ``bf16_products``)."""
        kinds = (torch.bfloat16, torch.float32) if self.bf16_products else (torch.bfloat16,)
        return (x.device.type == "cpu" and x.dtype in kinds and x.shape[0] <= self.kernel_rows
                and self.in_features % _KERNEL_K_MULTIPLE == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and x.dtype is torch.bfloat16 and x.shape[0] <= self.kernel_rows and self._k_ok
                and self.bias is None and x.device.type == "cpu" and x.is_contiguous()):
            # the common case of a bf16 decode step, in one operation (what the general path below does for it)
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale_bf16)  # [M, N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if self.uses_kernel(x2):
            xb = x2.to(torch.bfloat16)  # a no-op for bf16 rows
            y = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale_bf16).to(x2.dtype)  # [M, N]
        else:
            y = F.linear(x2, self.q.to(x2.dtype)) * self.scale.to(x2.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def quantized_layers(model: nn.Module) -> int:
    """How many :class:`Int8Linear` layers ``model`` holds."""
    return sum(isinstance(m, Int8Linear) for m in model.modules())


def quantize_model(model: nn.Module, weights: str, kernel_rows: int = KERNEL_ROWS, head: bool = True) -> int:
    """Swap the linear layers of ``model.model.layers`` (the decoder blocks) and, with ``head``, ``model.lm_head``
    (an :class:`Int8Linear` of its own: a tied embedding table stays float) for the ``weights`` format, in place;
    returns how many were swapped (0 for ``float``).

    Raises:
        UnknownNameError: ``weights`` is not one of :data:`WEIGHTS`.
    """
    if canonical_weights(weights) == "float":
        return 0
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers to quantize")
    swapped = 0
    for block in layers:
        for name, child in list(block.named_modules()):
            if type(child) is not nn.Linear:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, Int8Linear.from_linear(child, kernel_rows))
            swapped += 1
    lm_head = getattr(model, "lm_head", None)
    if head and type(lm_head) is nn.Linear:
        model.lm_head = Int8Linear.from_linear(lm_head, kernel_rows)  # the tied embedding keeps its float table
        swapped += 1
    return swapped
