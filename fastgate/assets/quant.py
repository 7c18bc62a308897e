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

``int4`` holds the decoder blocks' linear weights in groups of 32 along ``K`` with a float32 scale and zero each
(:class:`Int4Linear`, :func:`int4_reference`):

    w[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32],   q in 0..15

the semantics of torch's CPU kernel ``aten._weight_int4pack_mm_for_cpu``. For an embedded GGUF model the codes are the
GGUF's own (:func:`q4_1_codes`, :func:`q4_k_codes`; read by :func:`fastgate.assets.models.gguf_int4_codes`): a Q4_1
block of 32 (``w = q * d + m``) is one group with ``scale = d``, ``zero = m + 8 d``; a Q4_K sub-block of 32
(``w = d * sc * q - dmin * mn``) one with ``scale = d * sc``, ``zero = 8 scale - dmin * mn``, both exact up to the
float32 rounding of the zero. A tensor the GGUF holds otherwise (Q5_0, Q6_K, Q8_0: SmolLM2's tied embedding and
head, most of Qwen2.5-0.5B's Q4_K_M file) is not 4-bit: its layer is an :class:`Int8Linear` (from the de-quantized
weight), and so are q/k/v or gate/up together when one of them is (the fused pass joins them into one product). A model
without a GGUF (a local HF directory, the tests' tiny model) is quantized here, group by group (:func:`quantize_int4`:
``scale = (max - min) / 15``), the head included. A layer whose ``K`` is not a multiple of 32 stays int8.

``int4-dense`` is ``int4`` with each quantized layer's de-quantized weight kept beside its codes (``keep_dense``, a
buffer in the model's dtype left out of the state dict; a fused layer keeps it and its parts hold views): the kernels
run up to :data:`DENSE_KERNEL_ROWS` rows, where they beat a dense bf16 product (one thread of a Zen 4 EPYC, 576 →
1536: 1 row 26 µs against 64, 4 rows 43 against 79, 8 rows 128 against 96), and every larger product multiplies the
kept copy: prefill and batched steps at the dense product's speed, the results those of de-quantizing every call.
(Those timings had the weight in cache; a decode step's weights come from memory, and where fastgate's C++ kernels run
the fused pass takes them up to 32 rows: fastgate.ops.quant.BF16_KERNEL_ROWS.)
The price is memory (the codes beside the copy). ``auto`` (:func:`choose_weights`, the default of ``load`` and the
CLI) picks it for an embedded model in bf16 on a CPU whose torch runs the kernels' AVX-512 code, and in float32 where
``auto`` chose float32 and the extension's float32 kernels run (AVX2 and FMA: :mod:`fastgate.ops.quant`), ``float``
elsewhere.

The codes are kept plain, two to a byte along ``K`` (``q [N, K / 2]``: rows can be split and joined, as
:mod:`fastgate.engine.fused` does), and packed once for the kernel (``packed``, ``scale_zeros [K / 32, N, 2]`` in
bf16; ``N`` padded to a multiple of 16, which the kernel needs). The packed layout runs in blocks of 64 rows: the
fused q/k/v and gate/up layers' parts, each a multiple of 64 rows in SmolLM2 and Qwen2.5, keep views of the fused
packed weight rather than a second copy (checked once a process, :func:`packed_rows_split`). The kernel's float32
path is a scalar loop (576 → 3072, one row: 2.6 ms against 51 µs in bf16), so float32 rows go through it rounded to
bf16 as with int8 (``bf16_products``); its scales and zeros are bf16 too (a relative 2^-9 each). Timed at one thread
of a Zen 4 EPYC on one 576 → 3072 weight (bf16 rows): 1 row 51 µs, 4 rows 87, 16 rows 334, 64 rows 1.35 ms; the dense
product with its weight de-quantized first costs about 1.7 ms + 8 µs a row, hence the kernel up to
:data:`INT4_KERNEL_ROWS` rows (a decode step, batch 16 included) and the de-quantized dense product beyond (prefill).
In the engine (``bench/bench_engine.py``, one thread, same machine, one run): SmolLM2's batch-1 bf16 step took 11.2 ms
with int4 against 14.3 with int8, 24.6 with bf16 weights and 6.7 for llama.cpp on the same Q4_1 file; of the int4 step
about 4 ms are the 120 int4 products (the kernel is compute-bound at one thread, ~16 GB/s of codes) and 1.8 ms the
int8 head (the GGUF's Q8_0 table), the rest host operations. At 16 rows the kernel is no faster than a dense bf16
product (21 µs a row for 576 → 3072).

The engine's fused pass multiplies a decode step's rows (up to a layer's ``kernel_rows``) through its runner's ops
``int4_matmul`` and ``int8_matmul`` (:mod:`fastgate.ops.quant`), not through these modules' forward: torch's kernels
above, or, where the CPU has AVX512-BF16, C++ kernels over the codes ``q`` and float32 ``scale`` / ``zero`` (torch's
kernels round those to bf16) in tiles of four rows made once a layer, prefetching the weights they stream: 2x torch's
int4 and int8 products on a Zen 4 core; float32 rows, where the CPU has AVX2 and FMA, through float32 C++ kernels (the
layers' own forward would de-quantize: torch's kernels run a scalar loop on float32 rows). The modules' own forward
(HF's module tree, prefill) is unchanged.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastgate.errors import UnknownNameError

__all__ = [
    "DENSE_KERNEL_ROWS",
    "FLOAT32_VIA_BF16",
    "FORMATS",
    "GROUP",
    "INT4_KERNEL_ROWS",
    "KERNEL_ROWS",
    "WEIGHTS",
    "Int4Linear",
    "Int8Linear",
    "WeightsChoice",
    "canonical_weights",
    "choose_weights",
    "float32_kernels",
    "int4_dequantize",
    "int4_reference",
    "int8_reference",
    "pack_nibbles",
    "packed_rows_split",
    "q4_1_codes",
    "q4_k_codes",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "quantized_layers",
    "unpack_nibbles",
]

FORMATS = ("float", "int8", "int4", "int4-dense")  # how a loaded model's linear weights are held
WEIGHTS = ("auto", *FORMATS)  # what --weights accepts: auto is resolved once, at load (choose_weights)
KERNEL_ROWS = 16  # rows up to which the weight-only kernel beats a dense bf16 product (module docstring)
# float32 rows go through the bf16 kernel where torch runs its AVX-512 code (the kernel's vectorized path)
FLOAT32_VIA_BF16 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
_KERNEL_K_MULTIPLE = 16  # the bf16 kernel's K must be a multiple of this (it crashed otherwise)
GROUP = 32  # values per int4 group (one scale and zero): a Q4_1 block, a Q4_K sub-block
INT4_KERNEL_ROWS = 64  # rows up to which the int4 kernel beats de-quantizing for a dense product (module docstring)
DENSE_KERNEL_ROWS = 4  # with a kept de-quantized copy (int4-dense): rows up to which the kernels beat it
_INT4_N_MULTIPLE = 16  # the int4 packing needs N a multiple of this (padded with zero rows)
_PACK_ROW_BLOCK = 64  # the packed int4 layout's row blocks (packed_rows_split checks it)


def canonical_weights(weights: str) -> str:
    """``weights``' canonical name (``auto``, ``float``, ``int8``, ``int4``, ``int4-dense``); an unknown name raises
    :class:`~fastgate.errors.UnknownNameError` naming the choices."""
    name = {"fp": "float", "none": "float"}.get(str(weights).lower(), str(weights).lower())
    if name not in WEIGHTS:
        raise UnknownNameError("weight format", weights, WEIGHTS)
    return name


@dataclass(frozen=True)
class WeightsChoice:
    """How a model's linear weights are held and why (``ask --json``, ``/healthz`` and the bench rows name both)."""

    weights: str  # one of FORMATS
    reason: str  # "asked", or what decided auto


def float32_kernels() -> bool:
    """Whether the C++ extension is built and runs its float32 weight-only kernels here (AVX2 and FMA; the registry
    binds them as ``int4_matmul`` / ``int8_matmul`` for float32 rows, :mod:`fastgate.ops.quant`)."""
    try:  # the extension is at the base (docs/ARCHITECTURE.md); fastgate.ops.registry, above the assets, binds it
        ext = importlib.import_module("fastgate._C")
    except ImportError:
        return False
    return bool(getattr(ext, "quant_f32_kernels_supported", lambda: False)())


def choose_weights(weights: str, device: torch.device | str, dtype: torch.dtype, *, gguf_blocks: bool,
                   capability: str | None = None, dtype_auto: bool = False,
                   f32_kernels: bool | None = None) -> WeightsChoice:
    """The format for ``weights`` (``auto`` or one of :data:`FORMATS`) of a model in ``dtype`` on ``device``.

    ``auto`` is ``int4-dense`` where it is never slower than ``float`` and decodes faster, for a model with a GGUF's
    own 4-bit blocks (``gguf_blocks``: an embedded model; a local directory is not re-quantized unasked) on a CPU:

    - bf16 weights where torch runs the weight-only kernels' AVX-512 code (``capability``: None for this one's);
    - float32 weights that ``auto`` chose (``dtype_auto``: a CPU without a native bf16 product) where the extension's
      float32 kernels run (``f32_kernels``: None asks :func:`float32_kernels`; AVX2 and FMA). A float32 the user
      asked for stays ``float``: the reference dtype, whose answers the golden tests pin.

    Its decode steps of at most :data:`DENSE_KERNEL_ROWS` rows read 4-bit or int8 weights (2-3x faster than the dense
    product at one row) and every larger product (batched steps, prefill) uses the de-quantized copy at the dense
    product's speed; the price is memory (the codes beside the copy). ``float`` elsewhere.

    Raises:
        UnknownNameError: ``weights`` is not one of :data:`WEIGHTS`.
    """
    name = canonical_weights(weights)
    if name != "auto":
        return WeightsChoice(name, "asked")
    cap = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    if torch.device(device).type != "cpu":
        return WeightsChoice("float", f"{torch.device(device).type}: the 4-bit kernel is torch's CPU one")
    if not gguf_blocks:
        return WeightsChoice("float", "no GGUF 4-bit blocks (a local model is quantized only when asked)")
    if dtype is torch.float32:
        if not dtype_auto:
            return WeightsChoice("float", "float32 asked: the reference dtype keeps its float weights")
        if not (float32_kernels() if f32_kernels is None else f32_kernels):
            return WeightsChoice("float", "float32: the extension's float32 kernels (AVX2 and FMA) are not here")
        return WeightsChoice("int4-dense", f"cpu {cap}, float32 by auto, the GGUF's 4-bit blocks: 4-bit decode steps "
                                           f"of <= {DENSE_KERNEL_ROWS} rows (AVX2 kernels), de-quantized copy beyond")
    if dtype is not torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        return WeightsChoice("float", f"{name} weights: the weight-only kernels take bf16 or float32 rows")
    if not cap.startswith("AVX512"):
        return WeightsChoice("float", f"cpu capability {cap}: the weight-only kernels' vectorized code needs AVX-512")
    return WeightsChoice("int4-dense", f"cpu {cap}, bf16, the GGUF's 4-bit blocks: 4-bit decode steps of <= "
                                       f"{DENSE_KERNEL_ROWS} rows, de-quantized copy beyond")


_QUANT_BLOCK = 1 << 16  # weights a block of quantize_int8 holds in float32 (256 KiB: within a core's L2)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of ``weight [N, K]``: ``(q [N, K] int8, s [N] float32)`` with
    ``|w - q * s| <= s / 2`` elementwise (a row of zeros gets the scale 1)."""
    w = weight.detach()  # [N, K]
    # |w|'s row maximum without a tensor of |w| (torch.aminmax is ~18x slower than the two reductions here), in w's
    # own dtype: converting to float32 is monotonic, so the maximum of the converted values is the converted maximum
    amax = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg()).to(torch.float32)  # [N]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # [N]
    # blocks of rows through a small float32 buffer, worked on in place: a load quantizes every layer, and a float32
    # copy of each whole weight (first-touch pages) took most of Qwen2.5-0.5B's 157 layers' time
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)  # [N, K]
    rows = max(1, _QUANT_BLOCK // max(1, w.shape[1]))
    for start in range(0, w.shape[0], rows):
        block = w[start:start + rows].to(torch.float32, copy=True)  # [rows, K]
        q[start:start + rows] = block.div_(scale[start:start + rows, None]).round_().clamp_(-127, 127)
    return q.contiguous(), scale.contiguous()


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: ``x [..., K] @ (q [N, K] * scale [N, None]).T (+ bias)``, in float32, de-quantized."""
    w = q.to(torch.float32) * scale.to(torch.float32)[:, None]  # [N, K]
    return F.linear(x.to(torch.float32), w, None if bias is None else bias.to(torch.float32))


class _KeptCopy(nn.Module):
    """What :class:`Int8Linear` and :class:`Int4Linear` share for ``int4-dense``: their weight kept in a float dtype
    beside the codes (``dense``, a buffer that moves with the module and stays out of the state dict; None unless
    the format asks), so products beyond the kernels' rows skip de-quantizing every call, with the same results.

    The copy may instead be held by a product that gives its ``F.linear`` bits (:meth:`release_dense`: oneDNN's
    reordered layout of it, :mod:`fastgate.ops.dense`, or a joined layer's product of which this layer takes its
    columns): the plain copy is then dropped, so the weight is held once beside the codes, not twice."""

    _kept_product: Callable[[torch.Tensor], torch.Tensor] | None = None  # holds the copy instead (release_dense)
    _kept_dtype: torch.dtype | None = None  # the released copy's dtype

    def _weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype`` as the layer's dense product computes it."""
        raise NotImplementedError

    def keep_dense(self, dtype: torch.dtype | None, dense: torch.Tensor | None = None) -> None:
        """Keep the weight in ``dtype`` (``dense`` if given, e.g. a view of a fused layer's); ``None`` drops it."""
        if "dense" not in self._buffers:
            self.register_buffer("dense", None, persistent=False)
        self._buffers["dense"] = None if dtype is None else (self._weight_in(dtype) if dense is None else dense)
        detach = getattr(self._kept_product, "detach", None)  # a join's shared product waits for this part no more
        if detach is not None:
            detach()
        self._kept_product = self._kept_dtype = None  # a plain copy (or none) again

    def release_dense(self, product: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Drop the plain kept copy: from now on ``product`` (``x [M, K] -> [M, N]``, ``F.linear(x, copy)``'s bits
        for CPU rows of the copy's dtype) computes every product the copy computed."""
        dense = self._buffers.get("dense")
        if dense is None:
            raise ValueError("release_dense: the layer keeps no plain copy")
        self._buffers["dense"] = None
        self._kept_product, self._kept_dtype = product, dense.dtype

    def _apply(self, fn, recurse=True):
        """``to``, ``float``, ``cuda``...: a released copy becomes a plain one first, so that it moves and casts as
        the buffer did (the product holding it stays where and what it was)."""
        if self._kept_product is not None:
            self.keep_dense(self._kept_dtype)
        return super()._apply(fn, recurse)

    @property
    def kept_dtype(self) -> torch.dtype | None:
        """The dtype the layer keeps its weight in (a plain copy, or a product holding it); None: it keeps none."""
        return self.dense.dtype if self.dense is not None else self._kept_dtype

    def _follow_codes(self) -> None:
        """After new codes (``refresh``): a kept copy is made again from them (a plain one)."""
        dtype = self.kept_dtype
        if dtype is not None:
            self.keep_dense(dtype)

    def _kept(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The plain kept copy where it is in ``dtype``, else None."""
        return self.dense if self.dense is not None and self.dense.dtype == dtype else None

    def has_kept(self, dtype: torch.dtype) -> bool:
        """Whether the layer keeps its weight in ``dtype``: a plain copy, or a product holding it."""
        return self.kept_dtype == dtype

    def _dense_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, the weight in x's dtype)`` without scales or bias, ``x [M, K] -> [M, N]``: by the kept copy
        (plain, or the product holding it) where there is one in that dtype, else of the weight de-quantized now."""
        dense = self._kept(x.dtype)
        if dense is not None:
            return F.linear(x, dense)  # [M, N]
        if (self._kept_product is not None and x.dtype == self._kept_dtype and x.device.type == "cpu"
                and not torch.compiler.is_compiling()):  # a traced step multiplies the weight made again (its bits)
            return self._kept_product(x)  # [M, N]
        return F.linear(x, self._weight_in(x.dtype))  # [M, N]


class Int8Linear(_KeptCopy):
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
        self.keep_dense(None)  # no kept copy unless the format asks (int4-dense)
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
        self._follow_codes()

    def _weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        return self.q.to(dtype)  # [N, K]: the scales multiply the product (forward)

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
            y = self._dense_linear(x2) * self.scale.to(x2.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` in 0..15 (``K`` even) two to a byte along ``K``: ``[N, K / 2]`` uint8, ``k`` even in the low
    nibble. Rows stay rows (they split and join as the codes do)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """The codes ``[N, K]`` uint8 of :func:`pack_nibbles`' ``q [N, K / 2]``."""
    out = torch.empty((*q.shape, 2), dtype=torch.uint8, device=q.device)  # [N, K / 2, 2]
    torch.bitwise_and(q, 15, out=out[..., 0])
    torch.bitwise_right_shift(q, 4, out=out[..., 1])
    return out.view(q.shape[0], -1)


def int4_dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(codes - 8) * scale + zero`` group by group: ``[N, K]`` in ``dtype`` (computed in float32) from the nibbles
    ``q [N, K / 2]`` and ``scale``, ``zero [N, K / 32]``."""
    n, groups = scale.shape
    w = unpack_nibbles(q).view(n, groups, GROUP).to(torch.float32)  # [N, G, 32]
    w.sub_(8.0).mul_(scale.to(torch.float32)[..., None]).add_(zero.to(torch.float32)[..., None])
    return w.view(n, groups * GROUP).to(dtype)


def int4_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: ``x [..., K] @ w.T (+ bias)`` with ``w[n, k] = (code - 8) * scale[n, k // 32] +
    zero[n, k // 32]``, in float32, from plain torch operations (no nibble helpers)."""
    n, groups = scale.shape
    codes = torch.stack((q & 15, q >> 4), dim=-1).reshape(n, groups * GROUP).to(torch.float32)  # [N, K]
    s = scale.to(torch.float32).repeat_interleave(GROUP, dim=1)  # [N, K]
    z = zero.to(torch.float32).repeat_interleave(GROUP, dim=1)  # [N, K]
    return F.linear(x.to(torch.float32), (codes - 8) * s + z, None if bias is None else bias.to(torch.float32))


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of ``weight [N, K]`` (``K`` a multiple of 32) in groups of 32 along ``K``: ``(q [N, K / 2]
    nibbles, scale [N, K / 32], zero [N, K / 32])`` float32, ``scale = (max - min) / 15`` (1 for a constant group),
    ``zero = min + 8 scale``, so that ``|w - w'| <= scale / 2`` elementwise (up to float32 rounding)."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs K a multiple of {GROUP}, got {k}")
    g = w.reshape(n, k // GROUP, GROUP)  # [N, G, 32]
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [N, G]
    scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).reshape(n, k)
    return pack_nibbles(codes), scale.contiguous(), (lo + 8.0 * scale).contiguous()


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from the last dimension's 2 bytes, as float32."""
    return raw.contiguous().view(torch.float16)[..., 0].to(torch.float32)


def q4_1_codes(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_1 tensor's bytes ``[N, K / 32 * 20]`` (per block: ``d``, ``m`` float16, 16 bytes of codes: value
    ``j`` in byte ``j``'s low nibble, value ``j + 16`` in its high one; ``w = q * d + m``) as :class:`Int4Linear`'s
    ``(q, scale, zero)``: ``scale = d``, ``zero = m + 8 d``."""
    n = raw.shape[0]
    blocks = raw.reshape(n, k // GROUP, 20)
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, G]
    qs = blocks[..., 4:20]  # [N, G, 16]
    codes = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(n, k)  # [N, K]
    return pack_nibbles(codes), d, m + 8.0 * d


def q4_k_codes(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_K tensor's bytes ``[N, K / 256 * 144]`` (per super-block of 256: ``d``, ``dmin`` float16, 12 bytes of
    eight 6-bit scales and mins, 128 bytes of codes; sub-block ``j`` of 32: ``w = d * sc_j * q - dmin * mn_j``) as
    :class:`Int4Linear`'s ``(q, scale, zero)``: ``scale = d * sc``, ``zero = 8 scale - dmin * mn``."""
    n = raw.shape[0]
    sb = raw.reshape(n, k // 256, 144)
    d, dmin = _f16(sb[..., 0:2]), _f16(sb[..., 2:4])  # [N, S]
    sc_raw = sb[..., 4:16].to(torch.int32)  # [N, S, 12]
    low = sc_raw[..., 0:4] & 63, sc_raw[..., 4:8] & 63  # sub-blocks 0..3: scale, min
    high = ((sc_raw[..., 8:12] & 15) | ((sc_raw[..., 0:4] >> 6) << 4),
            (sc_raw[..., 8:12] >> 4) | ((sc_raw[..., 4:8] >> 6) << 4))  # sub-blocks 4..7
    sc = torch.cat((low[0], high[0]), dim=-1).to(torch.float32)  # [N, S, 8]
    mn = torch.cat((low[1], high[1]), dim=-1).to(torch.float32)
    qs = sb[..., 16:144].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 values: low nibbles, then high
    codes = torch.stack((qs & 15, qs >> 4), dim=3).reshape(n, k)  # [N, K]
    scale = d[..., None] * sc  # [N, S, 8]
    zero = 8.0 * scale - dmin[..., None] * mn
    return pack_nibbles(codes), scale.reshape(n, -1).contiguous(), zero.reshape(n, -1).contiguous()


def _pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's packed weight and bf16 ``scale_zeros [K / 32, N', 2]`` (``N'``: ``N`` padded to a multiple of 16
    with zero rows)."""
    n = q.shape[0]
    pad = -n % _INT4_N_MULTIPLE
    codes = unpack_nibbles(q).to(torch.int32)  # [N, K]
    sz = torch.stack((scale, zero), dim=-1).to(torch.float32)  # [N, G, 2]
    if pad:
        codes = torch.cat((codes, torch.full((pad, codes.shape[1]), 8, dtype=torch.int32, device=q.device)))
        sz = torch.cat((sz, sz.new_zeros((pad, *sz.shape[1:]))))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.cpu(), 1).to(q.device)
    return packed, sz.transpose(0, 1).to(torch.bfloat16).contiguous()


@functools.cache
def packed_rows_split() -> bool:
    """Whether this torch's packed int4 layout splits by blocks of :data:`_PACK_ROW_BLOCK` rows (rows ``[0, 64)`` of
    the packed join of two weights are the first one's packed weight): then a fused layer's parts keep views."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 16, (_PACK_ROW_BLOCK, 64), generator=gen, dtype=torch.int32)
    b = torch.randint(0, 16, (2 * _PACK_ROW_BLOCK, 64), generator=gen, dtype=torch.int32)
    try:
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        joined = pack(torch.cat((a, b)), 1)
        return torch.equal(joined[:_PACK_ROW_BLOCK], pack(a, 1)) and torch.equal(joined[_PACK_ROW_BLOCK:], pack(b, 1))
    except (RuntimeError, NotImplementedError):
        return False


class Int4Linear(_KeptCopy):
    """A drop-in for ``nn.Linear`` holding int4 codes in groups of 32 (module docstring): the plain nibbles
    ``q [N, K / 2]`` and float32 ``scale``, ``zero [N, K / 32]`` (buffers), and what the kernel reads, packed once
    (``packed``, ``scale_zeros``: buffers left out of the state dict). The output has ``x``'s dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel_rows: int = INT4_KERNEL_ROWS, source: str = "quantized") -> None:
        super().__init__()
        n, groups = scale.shape if scale.dim() == 2 else (-1, -1)
        if (q.dim() != 2 or q.dtype != torch.uint8 or q.shape != (n, groups * GROUP // 2)
                or zero.shape != scale.shape):
            raise ValueError(f"Int4Linear needs q [N, K/2] uint8, scale and zero [N, K/{GROUP}]; got "
                             f"{tuple(q.shape)} {q.dtype}, {tuple(scale.shape)} and {tuple(zero.shape)}")
        self.out_features, self.in_features = int(n), int(groups * GROUP)
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.to(torch.float32).contiguous())
        self.register_buffer("zero", zero.to(torch.float32).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.kernel_rows = kernel_rows
        self.source = source  # "gguf" (the file's own blocks) or "quantized" (quantize_int4 of a float weight)
        self.bf16_products = FLOAT32_VIA_BF16  # float32 rows rounded to bf16 for the kernel (module docstring)
        self.keep_dense(None)  # no kept copy unless the format asks (int4-dense)
        self.refresh()

    def refresh(self, packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Pack ``q``, ``scale``, ``zero`` for the kernel (call after replacing them), or take ``packed``
        (``(packed, scale_zeros)``, e.g. views of a fused layer's)."""
        if packed is None:
            packed = _pack_int4(self.q, self.scale, self.zero)
        for name, value in zip(("packed", "scale_zeros"), packed):
            if name in self._buffers:
                setattr(self, name, value)
            else:
                self.register_buffer(name, value, persistent=False)
        # the kernel's output is the layer's own: no padded rows to drop, no bias to add
        self._exact = self.scale_zeros.shape[1] == self.out_features and self.bias is None
        self._follow_codes()

    def _weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantized(dtype)  # [N, K]

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel_rows: int = INT4_KERNEL_ROWS) -> Int4Linear:
        q, scale, zero = quantize_int4(linear.weight)
        dev = linear.weight.device
        return cls(q.to(dev), scale.to(dev), zero.to(dev), linear.bias, kernel_rows)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"source={self.source}")

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (2-D rows) goes through ``aten._weight_int4pack_mm_for_cpu`` (float32 rows rounded to bf16
        for it where ``bf16_products``)."""
        kinds = (torch.bfloat16, torch.float32) if self.bf16_products else (torch.bfloat16,)
        return x.device.type == "cpu" and x.dtype in kinds and x.shape[0] <= self.kernel_rows

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype``."""
        return int4_dequantize(self.q, self.scale, self.zero, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and x.dtype is torch.bfloat16 and x.shape[0] <= self.kernel_rows and self._exact
                and x.device.type == "cpu" and x.is_contiguous()):
            # the common case of a bf16 decode step, in one operation (what the general path below does for it)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zeros)  # [M, N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.uses_kernel(x2):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.packed, GROUP,
                                                           self.scale_zeros)  # [M, N'] bf16
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features]
            y = y.to(x2.dtype)
        else:
            y = self._dense_linear(x2)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def quantized_layers(model: nn.Module) -> int:
    """How many :class:`Int8Linear` and :class:`Int4Linear` layers ``model`` holds."""
    return sum(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules())


Int4Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (q [N, K / 2], scale, zero [N, K / 32])
_JOINED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # held alike: fused.py joins them


def quantize_model(model: nn.Module, weights: str, kernel_rows: int | None = None, head: bool = True,
                   codes: dict[str, Int4Codes] | None = None) -> int:
    """Swap the linear layers of ``model.model.layers`` (the decoder blocks) and, with ``head``, ``model.lm_head``
    (a quantized layer of its own: a tied embedding table stays float) for the ``weights`` format, in place;
    returns how many were swapped (0 for ``float``).

    ``int4-dense``: as ``int4``, each quantized layer keeping its de-quantized weight in the model's dtype beside
    the codes (``keep_dense``), the kernels used up to :data:`DENSE_KERNEL_ROWS` rows and the copy beyond.

    ``int4``: with ``codes`` (a GGUF's own 4-bit blocks by module name, ``model.layers.0.self_attn.q_proj``,
    ``lm_head``; :func:`fastgate.assets.models.gguf_int4_codes`) the layers it names become :class:`Int4Linear` of
    those codes and every other one an :class:`Int8Linear`; without, every layer whose ``K`` is a multiple of 32 is
    quantized by :func:`quantize_int4`. q/k/v, and gate/up, are held alike (int8 all if one is).

    Raises:
        UnknownNameError: ``weights`` is not one of :data:`WEIGHTS`.
    """
    fmt = canonical_weights(weights)
    if fmt == "auto":
        raise ValueError("quantize_model needs a format, not auto: resolve it first (choose_weights)")
    if fmt == "float":
        return 0
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers to quantize")
    dense = fmt == "int4-dense"  # keep a de-quantized copy beside the codes, for products of many rows
    if kernel_rows is None and dense:
        kernel_rows = DENSE_KERNEL_ROWS

    def available(name: str, linear: nn.Linear) -> bool:
        return fmt != "int8" and linear.in_features % GROUP == 0 and (codes is None or name in codes)

    def build(name: str, linear: nn.Linear, int4: bool) -> nn.Module:
        layer = _build(name, linear, int4)
        if dense:
            layer.keep_dense(linear.weight.dtype)
        return layer

    def _build(name: str, linear: nn.Linear, int4: bool) -> nn.Module:
        if not int4:
            return Int8Linear.from_linear(linear, KERNEL_ROWS if kernel_rows is None else kernel_rows)
        dev = linear.weight.device
        q, scale, zero = quantize_int4(linear.weight) if codes is None else codes[name]
        if q.shape != (linear.out_features, linear.in_features // 2):
            raise ValueError(f"{name}: int4 codes {tuple(q.shape)} for a {linear.out_features} x "
                             f"{linear.in_features} weight")
        return Int4Linear(q.to(dev), scale.to(dev), zero.to(dev), linear.bias,
                          INT4_KERNEL_ROWS if kernel_rows is None else kernel_rows,
                          source="quantized" if codes is None else "gguf")

    swapped = 0
    for i, block in enumerate(layers):
        linears = {name: child for name, child in block.named_modules() if type(child) is nn.Linear}
        int4 = {name: available(f"model.layers.{i}.{name}", child) for name, child in linears.items()}
        parents = {name.rpartition(".")[0] for name in linears}
        for parent_name in parents:
            for group in _JOINED:  # a group is int4 only if each of its members is
                members = [f"{parent_name}.{attr}" if parent_name else attr for attr in group]
                members = [m for m in members if m in linears]
                if not all(int4[m] for m in members):
                    for m in members:
                        int4[m] = False
        for name, child in linears.items():
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, build(f"model.layers.{i}.{name}", child, int4[name]))
            swapped += 1
    lm_head = getattr(model, "lm_head", None)
    if head and type(lm_head) is nn.Linear:  # the tied embedding keeps its float table
        model.lm_head = build("lm_head", lm_head, available("lm_head", lm_head))
        swapped += 1
    return swapped
