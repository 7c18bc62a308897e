"""An int4 model's decoder layers for a pass of decode rows in one C++ call (op ``decode_layers``;
docs/ARCHITECTURE.md, Ops): float32 rows (``decode_layers_f32``, AVX2 and FMA) and bf16 rows (``decode_layers_bf16``,
AVX512-BF16).

The fused pass's decode-only path (:meth:`fastgate.engine.fused.FusedForward._decode_layers`) already runs every
layer's arithmetic in C++ where the CPU has AVX2 and FMA: the norm inside the q/k/v product's call, the rotary
embedding, store writes and attention in one call, the residual sums inside the o and down products' calls. What was
left was the host: ~7 Python calls, tensor allocations and torch operations a layer (the SwiGLU), ~4 ms of a ~13 ms
batch-1 step of SmolLM2 on an AVX2-only EPYC. ``fastgate._C.decode_layers_f32`` runs layers ``first .. last - 1`` in
one call, the same kernels in the same order, and the SwiGLU as torch computes it (``x / (1 + exp(-x))`` with the
SLEEF exp torch's vectorized float loops call, found in the loaded ``libtorch_cpu``; the last ``I % 16`` of a row with
the C library's exp, as torch's loop takes a row's tail): bitwise the per-op path, so an answer does not depend on
which of the two ran (``tests/test_decode_layers.py``). ``decode_layers_bf16`` is the same for a bf16 model (the bf16
kernels with their norm and residual, the q/k/v bias rounded as torch adds a bf16 one, torch's bf16 SwiGLU: widened,
the same exp, rounded; 64 values a step on an AVX-512 torch): a batch-1 step of SmolLM2 (``auto`` = bf16 with
int4-dense weights on a 2-core Zen 4 EPYC) 7.2 -> 6.2 ms. Why written here: torch has no whole-layer CPU call, and
``torch.compile`` of the step was a wash on a CPU (42-220 s of compiling, 1.3x at batch 1 on an older EPYC).

:func:`ext_decode_layers` is the op: given a model's layers (:class:`DecoderLayerWeights`) it returns a
:class:`DecodeStack` for them, or None where it cannot take them (another weight form or dtype, a bias beyond q/k/v,
another activation, a CPU without AVX2 and FMA, or for bf16 without AVX512-BF16, a SwiGLU of more than 32,768 values,
which torch would split across threads with other tails): the caller then runs the per-op path, with the same results.
The fused pass gives a stack at most as many rows as every product's kernel takes (beyond, the per-op path multiplies
the kept dense copy). The reference (:func:`no_decode_layers`) takes no model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from fastgate.assets.quant import Int4Linear
from fastgate.errors import ShapeError
from fastgate.ops import reference
from fastgate.ops.quant import _int4_layer_ok, bf16_tiles, f32_tiles

__all__ = ["DecodeStack", "DecoderLayerWeights", "ext_decode_layers", "is_silu", "no_decode_layers", "silu_agrees",
           "torch_float_block"]

_SERIAL_SILU = 32768  # torch's grain: a SwiGLU of fewer values runs its loop on one thread (its tails: the rows')
# pointers a layer in the extension's table (decode_layers_f32 / decode_layers_bf16 in csrc/ops.cpp): float32 products
# read three tiles (codes, scales, offsets), bf16 ones one stream (and its form, after the norms)
_TABLE = {torch.float32: 15, torch.bfloat16: 11}


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer as the fused pass holds it: the joined q/k/v and gate/up products, o and down, the two RMS
    norms (weight, eps), the attention's scaling and the MLP's activation module."""

    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    scaling: float
    act: nn.Module


def no_decode_layers(layers: Sequence[DecoderLayerWeights], heads: int, kv_heads: int,
                     head_dim: int) -> DecodeStack | None:
    """The reference: no whole-layer call (the fused pass runs its per-op path)."""
    return None


def is_silu(act: nn.Module) -> bool:
    """Whether ``act`` is HF's SiLU module (``ACT2FN["silu"]``: nn.SiLU; older releases: SiLUActivation)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _int4_ok(linear: nn.Module, n: int, k: int, bias: bool, dtype: torch.dtype = torch.float32) -> bool:
    """An Int4Linear of ``n`` outputs and ``k`` inputs the kernel takes as the per-op path gives it: plain codes on a
    CPU, float32 scales and zeros, contiguous; a bias only where ``bias`` allows one: float32 for float32 layers (the
    kernel adds it in float32), for bf16 ones float32 or bf16 (rounded to bf16 first, as the per-op path does)."""
    if (type(linear) is not Int4Linear or (linear.out_features, linear.in_features) != (n, k) or k % 32
            or linear.scale_zeros.shape[1] != n):  # the per-op path's condition for its kernel (fused._row_products)
        return False
    b = linear.bias
    if b is not None and not (bias and b.dtype in (torch.float32, dtype) and b.is_contiguous() and b.shape == (n,)):
        return False
    return _int4_layer_ok(linear)  # the buffers the C++ kernel takes (the per-op path's own check)


class DecodeStack:
    """A model's int4 decoder layers bound to ``decode_layers_f32`` (float32 layers) or ``decode_layers_bf16`` (bf16
    layers): :meth:`__call__` runs layers ``first .. last - 1`` for the decode rows ``h`` of the layers' dtype. Holds
    the layers' tensors (the table's pointers stay valid while it lives) and checks each call's inputs."""

    def __init__(self, ext: ModuleType, layers: Sequence[DecoderLayerWeights], heads: int, kv_heads: int,
                 head_dim: int, inter: int) -> None:
        self.dtype = layers[0].ln1.dtype
        bf16 = self.dtype is torch.bfloat16
        self._run = ext.decode_layers_bf16 if bf16 else ext.decode_layers_f32
        self.heads, self.kv_heads, self.head_dim, self.inter = heads, kv_heads, head_dim, inter
        self.d = layers[0].ln1.shape[0]
        self.n = len(layers)
        # the most rows: torch's SwiGLU of them on one thread (the caller passes rows only where its products take
        # them through the int4 kernels, beyond which the per-op path multiplies a kept de-quantized copy:
        # fastgate.engine.fused's decode condition and its bf16 kernel rows)
        self.max_rows = (_SERIAL_SILU - 1) // inter
        self._layers = layers  # keeps every pointer below alive
        rows = []
        self._tiles = []  # each product's codes and scales as its kernel reads them (the table points into them)
        for w in layers:
            qkv, o, gu, dn = w.qkv, w.o, w.gate_up, w.down
            row, forms = [], []
            for i, product in enumerate((qkv, o, gu, dn)):
                if bf16:  # one stream a product, and its form (at the row's end)
                    stream, form = bf16_tiles(product)
                    tiles = (stream,)
                    forms.append(form)
                else:  # codes, scales, offsets
                    tiles = f32_tiles(product)
                self._tiles.append(tiles)
                row += [t.data_ptr() for t in tiles]
                if i == 0:
                    bias = None if qkv.bias is None else qkv.bias.detach().to(self.dtype).contiguous()
                    self._tiles.append((bias,))
                    row.append(0 if bias is None else bias.data_ptr())
            rows.append(row + [w.ln1.data_ptr(), w.ln2.data_ptr()] + forms)
        # each product's buffers and codes: a layer whose codes are replaced (Int4Linear.refresh of new codes, a join)
        # no longer runs here
        self._codes = [(m._buffers, m.q) for w in layers for m in (w.qkv, w.o, w.gate_up, w.down)]
        self._table = torch.tensor(rows, dtype=torch.int64)  # [L, _TABLE[dtype]]
        assert self._table.shape[1] == _TABLE[self.dtype]
        self._floats = torch.tensor([[w.eps1, w.eps2, w.scaling] for w in layers], dtype=torch.float64)  # [L, 3]
        self._store: tuple | None = None  # (keys list, values list, [L, 2] pointers, shape, strides)

    def current(self) -> bool:
        """Whether the layers still hold the codes bound here (a layer whose codes were replaced: no longer)."""
        return all(buffers["q"] is q for buffers, q in self._codes)

    def _kv(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple:
        """The store's per-layer pointers, made again when the store's lists are replaced (it grew)."""
        store = self._store
        if store is not None and store[0] is keys and store[1] is values:
            return store
        k0 = keys[0]
        shape, strides = k0.shape, k0.stride()
        if (len(keys) != self.n or len(values) != self.n or k0.dim() != 4 or shape[1] != self.kv_heads
                or shape[3] != self.head_dim or strides[3] != 1
                or any(t.dtype is not self.dtype or not t.is_cpu or t.shape != shape or t.stride() != strides
                       for t in (*keys, *values))):
            raise ShapeError(f"decode_layers: the key / value store is not {self.dtype} [R, Hkv, C, D] alike in every "
                             "layer")
        ptrs = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(keys, values)], dtype=torch.int64)  # [L, 2]
        self._store = (keys, values, ptrs, shape, strides)
        return self._store

    def takes(self, h: torch.Tensor) -> bool:
        """Whether a call with the rows ``h`` runs here: CPU rows ``[m, d]`` of the layers' dtype, contiguous, m
        within :attr:`max_rows`, the layers' codes unchanged."""
        return self._rows_ok(h) and self.current()

    def _rows_ok(self, h: torch.Tensor) -> bool:
        """:meth:`takes` but for the codes' walk (~5 us: its caller's, once before the step's calls)."""
        return (h.dtype is self.dtype and h.is_cpu and h.dim() == 2 and h.shape[1] == self.d
                and 0 < h.shape[0] <= self.max_rows and h.is_contiguous())

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor], pos: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Layers ``first .. last - 1`` over ``h [m, d]`` (:meth:`takes` it): row ``r`` is store row ``r``, its token
        at column ``pos[r]`` (``[m]`` int64), ``cos`` / ``sin`` ``[m, D]`` of the layers' dtype (rows of their table,
        unit stride along D; a ``[m, 1, D]`` view too). Writes each layer's new keys and values; returns the output
        ``[m, d]``."""
        if not self._rows_ok(h):  # a float32 h into a bf16 stack read past its end
            raise ShapeError(f"decode_layers: h must be contiguous CPU rows [1..{self.max_rows}, {self.d}] of "
                             f"{self.dtype}, got {tuple(h.shape)} {h.dtype}")
        if not 0 <= first < last <= self.n:  # past the last layer the C++ loop read a table row that is not there
            raise ShapeError(f"decode_layers: layers first={first} .. last={last} must satisfy 0 <= first < last "
                             f"<= {self.n}")
        m = h.shape[0]
        _, _, ptrs, shape, strides = self._kv(keys, values)
        cst = cos.stride()
        if not (pos.dtype is torch.int64 and pos.is_contiguous() and pos.shape == (m,) and cos.dtype is self.dtype
                and sin.dtype is self.dtype and cos.shape[0] == m and cos.shape[-1] == self.head_dim
                and cst[-1] == 1 and sin.stride() == cst and sin.shape == cos.shape and m <= shape[0]):
            raise ShapeError("decode_layers: rows, positions and rotary tables disagree")
        out = torch.empty((m, self.d), dtype=self.dtype)  # [m, d]
        try:
            self._run(h.data_ptr(), out.data_ptr(), m, self.d, self._table.data_ptr(), self._floats.data_ptr(),
                      ptrs.data_ptr(), first, last, self.heads, self.kv_heads, self.head_dim, self.inter,
                      cos.data_ptr(), sin.data_ptr(), cst[0], pos.data_ptr(), shape[2], strides[0], strides[1],
                      strides[2], torch.get_num_threads())
        except ValueError as exc:
            raise ShapeError(str(exc)) from None
        return out


def torch_float_block() -> int:
    """How many floats torch's vectorized loops take a step here: two of its vectors, 16 floats each where its CPU
    kernels run AVX-512, else 8; the rest of a row runs its scalar loop (another exp)."""
    return 32 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 16


@functools.cache
def silu_agrees(ext: ModuleType, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the extension's SwiGLU of ``dtype`` rows is torch's bit for bit here, told torch's step first
    (:func:`torch_float_block`): a probe of 4,112 values over silu's range and of rows of 1 to 33 (float32) or 1 to 65
    (bf16: torch takes 64 of them a step on AVX-512), their scalar tails: the bound loop must be, or the per-op path
    runs."""
    if hasattr(ext, "set_torch_float_block"):
        ext.set_torch_float_block(torch_float_block())
    run = ext.silu_mul_bf16 if dtype is torch.bfloat16 else ext.silu_mul_f32
    tails = (1, 7, 15, 16, 17, 31, 32, 33) if dtype is torch.float32 else (1, 7, 31, 32, 33, 63, 64, 65)
    for width, scale in ((4112, 30.0), *((w, 6.0) for w in tails)):
        gate = torch.linspace(-scale, scale, width)  # [I]
        gu = torch.cat([gate, torch.linspace(-2.0, 2.0, width)])[None].to(dtype)  # [1, 2 I]
        out = torch.empty((1, width), dtype=dtype)
        run(gu.data_ptr(), out.data_ptr(), 1, width)
        if not torch.equal(out, reference.swiglu(gu)):
            return False
    return True


def ext_decode_layers(ext: ModuleType, *, f32: bool = True, bf16: bool = False) -> Callable[..., DecodeStack | None]:
    """The op ``decode_layers`` over the extension: ``(layers, heads, kv_heads, head_dim) -> DecodeStack | None``
    (module docstring). ``f32``: float32 layers may run in ``decode_layers_f32`` (the registry asks where the
    extension has its float32 layer ops); ``bf16``: bf16 layers in ``decode_layers_bf16`` (asked where the runner's
    bf16 norm and rotary embedding are the C++ loops for any rows, which that call runs, and the CPU has AVX512-BF16).
    Each where the extension runs it here (AVX2 and FMA, torch's exp found, its SwiGLU torch's bit for bit); the
    reference where neither does."""
    ok = hasattr(ext, "torch_exp_found") and ext.torch_exp_found()
    dtypes = set()
    if f32 and ok and hasattr(ext, "decode_layers_f32") and silu_agrees(ext, torch.float32):
        dtypes.add(torch.float32)
    if (bf16 and ok and hasattr(ext, "decode_layers_bf16") and ext.quant_kernels_supported()
            and silu_agrees(ext, torch.bfloat16)):
        dtypes.add(torch.bfloat16)
    if not dtypes:
        return no_decode_layers

    def decode_layers(layers: Sequence[DecoderLayerWeights], heads: int, kv_heads: int,
                      head_dim: int) -> DecodeStack | None:
        if not layers:
            return None
        d, dtype = layers[0].ln1.shape[0], layers[0].ln1.dtype
        width = (heads + 2 * kv_heads) * head_dim
        inter = layers[0].gate_up.out_features // 2 if type(layers[0].gate_up) is Int4Linear else 0
        if (dtype not in dtypes or not inter or d % 32 or (heads * head_dim) % 32 or head_dim % 2
                or heads % kv_heads):
            return None
        for w in layers:
            if not (_int4_ok(w.qkv, width, d, True, dtype) and _int4_ok(w.o, d, heads * head_dim, False, dtype)
                    and _int4_ok(w.gate_up, 2 * inter, d, False, dtype) and _int4_ok(w.down, d, inter, False, dtype)
                    and is_silu(w.act) and all(t.dtype is dtype and t.is_contiguous() and t.shape == (d,)
                                                for t in (w.ln1, w.ln2))):
                return None
        return DecodeStack(ext, layers, heads, kv_heads, head_dim, inter)

    return decode_layers
