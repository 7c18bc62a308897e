"""The decode step's weight-only quantized products on a CPU (ops ``int4_matmul``, ``int8_matmul``;
docs/ARCHITECTURE.md, Ops).

Each op takes bf16 rows ``x [M, K]`` and a quantized layer (:class:`~fastgate.assets.quant.Int4Linear`,
:class:`~fastgate.assets.quant.Int8Linear`) and returns ``x @ w.T`` ``[M, N]`` in bf16, without the layer's bias (the
callers add it, as the layers do). The references (:func:`torch_int4_matmul`, :func:`torch_int8_matmul`) are what the
layers run for such rows: torch's weight-only kernels (``aten._weight_int4pack_mm_for_cpu`` over the layer's packed
weight and bf16 scales and zeros; ``aten._weight_int8pack_mm`` with bf16 scales). The definitions they approximate
are :func:`fastgate.assets.quant.int4_reference` and :func:`~fastgate.assets.quant.int8_reference` (float32).

Why a kernel of our own (``fastgate._C.int4_matmul_bf16``, ``int8_matmul_bf16``; csrc/ops.cpp): on one core of a
Zen 4 EPYC torch's int4 kernel ran ~36 G codes a second and the int8 head ~23 G weights, compute-bound, 90% of a
batch-1 decode step of SmolLM2. The C++ kernels read the codes in tiles of four rows, one forward stream a tile
(:func:`int4_bf16_tiles`, :func:`int8_bf16_tiles`, made once a layer by :func:`bf16_tiles` beside its plain codes: the
rows as held were twelve streams the CPU's prefetchers did not follow, a batch-1 step's int4 products at 25 against 32
GB/s and its int8 head at 19 against 43 on two Zen 4 cores), and use AVX512-BF16 dot products of exact bf16 forms of
the codes: 46-64 G codes a second on the same core (576 -> 3,072: 36
against 49 us; 1,536 -> 576: 14 against 26). They sum in float32 and round once to bf16, as torch's kernels do, in
another order, with the float32 scales and zeros (torch's kernels round them to bf16 first): results within a bf16
rounding of torch's. They need AVX512-BF16 (the registry binds them only where the CPU has it) and take every input
the layers hand a decode step; anything else (other dtypes, devices, strides; a bias is the caller's) goes to the
reference.

float32 rows (a float32 model: ``auto`` on a CPU without a native bf16 product) have kernels of their own
(``int4_matmul_f32``, ``int8_matmul_f32``): AVX2 and FMA, float32 in and out, nothing rounded to bf16. Why: on such a
CPU torch's weight-only kernels run a scalar loop for float32 rows (576 -> 3,072, one row: 2.6 ms), so a float32 model
could only multiply its float32 weights, 4-8x the bytes of the GGUF's 4-bit blocks. The registry binds them where the
CPU has AVX2 and FMA (``float32`` set on the op); their reference for float32 rows is the dense product of the
de-quantized weight (the layer's kept copy where it has one), :func:`fastgate.assets.quant.int4_reference`'s
arithmetic. They read the codes (and the int4 scales) in tiles of eight rows, the rows interleaved group by group
(:func:`int4_tiles`, :func:`int8_tiles`), made once a layer (:func:`f32_tiles`) beside its plain codes: a tile is one
forward stream, which the CPU's prefetchers follow; eight rows read side by side were not (a batch-1 step's int4
products of SmolLM2 at 7.4 against 11.1 GB/s on one core, csrc/ops.cpp).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType

import torch
import torch.nn.functional as F

from fastgate.assets.quant import GROUP, Int4Linear, Int8Linear
from fastgate.ops.layer import ext_kernels

__all__ = ["BF16_KERNEL_ROWS", "INT4_FLOAT", "INT4_HALF", "TILE4_ROWS", "TILE_ROWS", "bf16_tiles", "ext_int4_matmul",
           "ext_int8_matmul", "f32_tiles", "int4_bf16_form", "int4_bf16_tiles", "int4_tiles", "int8_bf16_tiles",
           "int8_tiles", "torch_int4_matmul", "torch_int8_matmul"]

TILE_ROWS = 8  # weight rows a tile of the float32 kernels' layout (csrc/ops.cpp, kTileRows)
TILE4_ROWS = 4  # weight rows a tile of the bf16 kernels' layouts (csrc/ops.cpp, kInt4TileRows, kInt8TileRows)
INT4_FLOAT, INT4_HALF = 0, 1  # the int4 tiles' forms (csrc/ops.cpp, kInt4Float, kInt4Half; int4_bf16_tiles)

_MAX_K = 16384  # the int4 kernel keeps a tile's per-group corrections on its stack (csrc/ops.cpp)
# float32 rows up to which int4_matmul_f32 beats the kept de-quantized float32 copy (int4-dense, whose own crossover,
# DENSE_KERNEL_ROWS, is bf16's): a dense float32 product of 16 rows streamed its weights at 4.6 GB/s, 7x the bytes of
# the codes; SmolLM2's batch-16 step at 600 tokens took 132 ms through the kernel against 184 through the copy (an
# AVX2-only EPYC, 2 threads)
F32_KERNEL_ROWS = 16
# float32 rows up to which int8_matmul_f32 beats the kept float32 copy of an int8 layer (an LM head: SmolLM2's 49,152 x
# 576): 3.7 against 26 ms at 4 rows, 12 against 30 at 16, 56 against 72 at 64 (the copy's 113 MB stream from memory;
# an AVX2-only EPYC, 2 threads), so a batch-16 step took its head through the copy, 28 of its 106 ms
F32_INT8_ROWS = 64
# bf16 rows up to which the C++ bf16 kernels (int4, and int8 for an LM head) beat the kept de-quantized bf16 copy of
# int4-dense: the copy's dense product of a decode step's few rows streams 2.7x the codes' bytes from memory at ~5 GB/s
# (oneDNN's bf16 product of 16 x 576 -> 3,072: 303 us with the weight in cache; a whole step's 212 MB come from
# memory). SmolLM2's step on a 2-core Zen 4 EPYC (AVX512-BF16), the kernels up to 4 / 16 / 32 / 64 rows: batch 8
# 34.8 / 17.9 / 18.0 / 17.7 ms, batch 16 49.6 / 30.9 / 31.7 / 31.0, batch 24 61.3 / 56.6 / 45.9 / 44.9, batch 32
# 62.0 / 65.1 / 60.2 / 59.7. (DENSE_KERNEL_ROWS, the layers' own 4, was measured with the weight in cache.)
BF16_KERNEL_ROWS = 32


def torch_int4_matmul(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    """``x [M, K]`` on a CPU times ``layer``'s int4 weight: ``[M, N]`` in ``x``'s dtype. bf16 rows by torch's kernel;
    float32 rows by the dense product of the de-quantized weight (the layer's kept copy where it has one: torch's
    kernel runs a scalar loop on float32 rows)."""
    if x.dtype is torch.float32:
        dense = layer._kept(torch.float32)
        return F.linear(x, layer.dequantized(torch.float32) if dense is None else dense)  # [M, N]
    x = x.contiguous()  # the kernel's rows
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, GROUP, layer.scale_zeros)  # [M, N'] (N' >= N)
    return y if y.shape[1] == layer.out_features else y[:, :layer.out_features]


def torch_int8_matmul(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """``x [M, K]`` on a CPU times ``layer``'s int8 weight: ``[M, N]`` in ``x``'s dtype. bf16 rows by torch's kernel;
    float32 rows by the dense product of the codes (the kept copy where there is one), then the scales; bf16 rows of
    a ``K`` torch's kernel does not take (not a multiple of 16: it crashes the process) by the dense product too."""
    if x.dtype is torch.float32:
        dense = layer._kept(torch.float32)
        return F.linear(x, layer.q.to(torch.float32) if dense is None else dense) * layer.scale  # [M, N]
    if not layer._k_ok:  # in float32, rounded once: what the kernel computes
        return (F.linear(x.float(), layer.q.to(torch.float32)) * layer.scale).to(x.dtype)  # [M, N]
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), layer.q, layer.scale_bf16)


def int4_tiles(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The plain codes ``q [N, K / 2]``, scales and zeros ``[N, K / 32]`` in ``int4_matmul_f32``'s tiles: codes
    ``[ceil(N / 8), K / 32, 8, 16]`` uint8, scales and offsets ``zero - 8 scale`` ``[ceil(N / 8), K / 32, 8]`` float32
    (a tile's eight rows group by group; the last tile's rows past ``N`` zero)."""
    n, groups = scale.shape
    pad = -n % TILE_ROWS
    offset = zero - 8.0 * scale  # [N, G]: 8 scale is exact, so one rounding, the kernel's own fnmadd's
    if pad:
        q = torch.cat((q, q.new_zeros((pad, q.shape[1]))))  # [N8, K / 2]
        scale, offset = (torch.cat((t, t.new_zeros((pad, groups)))) for t in (scale, offset))  # [N8, G]
    qt = q.reshape(-1, TILE_ROWS, groups, GROUP // 2).permute(0, 2, 1, 3).contiguous()  # [N8 / 8, G, 8, 16]
    st, ot = (t.reshape(-1, TILE_ROWS, groups).permute(0, 2, 1).contiguous() for t in (scale, offset))  # [N8 / 8, G, 8]
    return qt, st, ot


def int4_bf16_tiles(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    half: bool | None = None) -> tuple[torch.Tensor, int]:
    """The plain codes ``q [N, K / 2]``, scales and zeros ``[N, K / 32]`` in ``int4_matmul_bf16``'s tiles (csrc/ops.cpp:
    one forward stream a tile of four rows), and the tiles' form: ``[ceil(N / 4), B G']`` uint8, ``G'`` the tile groups
    (``G`` where ``G % 4 == 2``, else ``G`` rounded up to four). A tile is its blocks of four groups (the last two where
    ``G % 4 == 2``), a block of ``gb`` groups its four rows' codes ``[4, 16 gb]`` and two floats a row and group, ``[4,
    gb]`` each: form :data:`INT4_HALF` (``B`` 80) where the scales and zeros are a Q4_1 file's ``d`` and ``m + 8 d``
    (``scale`` float16, ``zero = m + 8 d`` with ``m`` float16, rounded once: the kernel makes the same float32 scale and
    correction from ``d`` and ``m``), the float16 ``d`` and ``m``; else form :data:`INT4_FLOAT` (``B`` 96) the float32
    scales and corrections ``zero - 24 scale`` (rounded once). Rows past ``N`` and groups past ``G`` zero. ``half``
    False: the float32 form whatever the floats (True: the float16 one, an error where it would not be exact)."""
    n, groups = scale.shape
    tg = groups if groups % 4 == 2 else -(-groups // 4) * 4  # the tile groups
    rows = -(-n // TILE4_ROWS) * TILE4_ROWS
    d, m = _q4_1_floats(scale, zero)
    exact = d is not None
    if half and not exact:
        raise ValueError("int4_bf16_tiles: these scales and zeros are not a Q4_1 file's float16 d and m + 8 d")
    half = exact if half is None else half
    if half:
        floats = (d.view(torch.int16), m.view(torch.int16))
    else:
        floats = (scale, (zero.double() - 24.0 * scale.double()).float())  # [N, G]: exact in float64, one rounding
    q = F.pad(q, (0, (tg - groups) * GROUP // 2, 0, rows - n))  # [N4, G' 16]
    floats = tuple(F.pad(t, (0, tg - groups, 0, rows - n)) for t in floats)  # [N4, G'] each
    tiles, full, r = rows // TILE4_ROWS, tg // 4, TILE4_ROWS

    def blocks(t: torch.Tensor, per_group: int, g0: int, g1: int) -> torch.Tensor:  # [T, B, bytes of a block]
        gb = min(4, g1 - g0)  # groups a block
        part = t[:, g0 * per_group:g1 * per_group].reshape(tiles, r, -1, gb * per_group)  # [T, 4, B, gb per_group]
        return part.permute(0, 2, 1, 3).contiguous().view(torch.uint8).reshape(tiles, (g1 - g0) // gb, -1)

    spans = [(0, 4 * full)] if full else []
    if tg % 4 == 2:
        spans.append((4 * full, tg))
    # each span's blocks: codes (16 bytes a group), then the two floats (one a group each) side by side
    parts = [torch.cat([blocks(t, w, g0, g1) for t, w in ((q, GROUP // 2), (floats[0], 1), (floats[1], 1))], -1)
             for g0, g1 in spans]  # each [T, blocks, B gb]
    parts = [p.reshape(tiles, -1) for p in parts]
    return torch.cat(parts, -1).contiguous(), INT4_HALF if half else INT4_FLOAT  # [T, B G']


def _q4_1_floats(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A Q4_1 file's float16 ``(d, m)`` where ``scale`` and ``zero`` are exactly its ``d`` and ``m + 8 d`` (as
    :func:`fastgate.assets.quant.q4_1_codes` makes them), else ``(None, None)``."""
    d = scale.to(torch.float16)  # [N, G]
    m = (zero.double() - 8.0 * scale.double()).to(torch.float16)  # [N, G]: m where zero = m + 8 d
    exact = (torch.isfinite(d).all() and torch.isfinite(m).all() and torch.equal(d.float(), scale)
             and torch.equal(m.float() + 8.0 * d.float(), zero))
    return (d, m) if exact else (None, None)


def int4_bf16_form(scale: torch.Tensor, zero: torch.Tensor) -> int:
    """The form :func:`int4_bf16_tiles` takes for these scales and zeros (:data:`INT4_HALF` or :data:`INT4_FLOAT`),
    without making the tiles."""
    return INT4_HALF if _q4_1_floats(scale, zero)[0] is not None else INT4_FLOAT


def int8_bf16_tiles(q: torch.Tensor) -> torch.Tensor:
    """The codes ``q [N, K]`` int8 in ``int8_matmul_bf16``'s tiles (csrc/ops.cpp: one forward stream a tile of four
    rows): ``[ceil(N / 4), K16 / 16, 4, 16]`` (``K16``: ``K`` rounded up to 16; zero codes past ``K`` and in the last
    tile's rows past ``N``): each 64 bytes the four rows' next 16 codes."""
    n, k = q.shape
    q = F.pad(q, (0, -k % 16, 0, -n % TILE4_ROWS))  # [N4, K16]
    return q.reshape(-1, TILE4_ROWS, q.shape[1] // 16, 16).permute(0, 2, 1, 3).contiguous()  # [N4 / 4, K16 / 16, 4, 16]


def bf16_tiles(layer: Int4Linear | Int8Linear) -> tuple:
    """``layer``'s codes in the bf16 kernels' tiles: int4 ``(tiles, form)`` (:func:`int4_bf16_tiles`), int8
    ``(tiles,)`` (:func:`int8_bf16_tiles`), the kernels' arguments in their order; made once and kept on the layer
    while its buffers are the ones they were made of (a layer whose codes are replaced gets new tiles)."""
    int4 = isinstance(layer, Int4Linear)
    made_of = (layer.q, layer.scale, layer.zero) if int4 else (layer.q,)
    held = layer.__dict__.get("_bf16_tiles")
    if held is None or any(a is not b for a, b in zip(held[0], made_of)):
        tiles = int4_bf16_tiles(*made_of) if int4 else (int8_bf16_tiles(*made_of),)
        held = layer.__dict__["_bf16_tiles"] = (made_of, tiles)
    return held[1]


def int8_tiles(q: torch.Tensor) -> torch.Tensor:
    """The codes ``q [N, K]`` int8 in ``int8_matmul_f32``'s tiles: ``[ceil(N / 8), K8 / 8, 8, 8]`` (``K8``: ``K``
    rounded up to 8; zero codes past ``K`` and in the last tile's rows past ``N``)."""
    n, k = q.shape
    q = F.pad(q, (0, -k % 8, 0, -n % TILE_ROWS))  # [N8, K8]
    return q.reshape(-1, TILE_ROWS, q.shape[1] // 8, 8).permute(0, 2, 1, 3).contiguous()  # [N8 / 8, K8 / 8, 8, 8]


def f32_tiles(layer: Int4Linear | Int8Linear) -> tuple[torch.Tensor, ...]:
    """``layer``'s codes in the float32 kernels' tiles (:func:`int4_tiles`: ``(codes, scales, offsets)``;
    :func:`int8_tiles`: ``(codes,)``), made once and kept on the layer while its buffers are the ones they were made
    of (a layer whose codes are replaced gets new tiles)."""
    int4 = isinstance(layer, Int4Linear)
    made_of = (layer.q, layer.scale, layer.zero) if int4 else (layer.q,)
    held = layer.__dict__.get("_f32_tiles")
    if held is None or any(a is not b for a, b in zip(held[0], made_of)):
        tiles = int4_tiles(*made_of) if int4 else (int8_tiles(layer.q),)
        held = layer.__dict__["_f32_tiles"] = (made_of, tiles)
    return held[1]


def _rows_ok(x: torch.Tensor, k: int, kinds: Mapping[torch.dtype, Callable]) -> bool:
    """Rows a kernel of ``kinds`` (row dtype -> kernel) takes: 2-D CPU rows of ``K``, unit stride along ``K``."""
    return (x.dtype in kinds and x.device.type == "cpu" and x.dim() == 2 and x.shape[1] == k
            and x.stride(1) == 1 and x.stride(0) >= k)


def _int4_layer_ok(layer: Int4Linear) -> bool:
    """Whether the C++ kernels take ``layer``'s buffers (they read tiles made of them): plain codes on a CPU, float32
    scales and zeros, contiguous, ``K`` within the kernel's bound."""
    q, scale, zero = layer.q, layer.scale, layer.zero
    return (layer.in_features <= _MAX_K and q.device.type == "cpu" and q.is_contiguous() and scale.is_contiguous()
            and zero.is_contiguous() and scale.dtype is torch.float32 and zero.dtype is torch.float32)


def ext_int4_matmul(ext: ModuleType, fuse_norm: bool = False, *, bf16: bool = True, f32: bool = False,
                    fuse_norm_f32: bool = False) -> Callable[[torch.Tensor, Int4Linear], torch.Tensor]:
    """The C++ int4 product with :func:`torch_int4_matmul`'s signature; inputs it cannot take go to torch's.

    ``bf16``: bf16 rows run ``int4_matmul_bf16`` (AVX512-BF16); ``f32``: float32 rows run ``int4_matmul_f32`` (AVX2 and
    FMA; the op then says so: ``float32`` True). ``fuse_norm``: the runner's ``rms_norm`` is the C++ one
    (``rms_norm_bf16``), so a layer bound here may also norm its bf16 rows in the same call with that loop
    (``bind(layer).normed``), bitwise ``product(rms_norm(x, w, eps))``; ``fuse_norm_f32``: likewise float32 rows
    (``rms_norm_f32``'s loop in ``int4_matmul_f32``'s call; with ``f32``)."""
    runs = ext_kernels(ext, "int4_matmul", bf16=bf16, f32=f32)
    # the row dtypes whose kernel norms the rows in its call (bitwise the C++ norm, which is bitwise the reference)
    normable = {dtype for dtype, asked in ((torch.bfloat16, fuse_norm and bf16), (torch.float32, fuse_norm_f32 and f32))
                if asked}

    def int4_matmul(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
        k, n = layer.in_features, layer.out_features
        if not (_rows_ok(x, k, runs) and _int4_layer_ok(layer)):
            return torch_int4_matmul(x, layer)
        out = torch.empty((x.shape[0], n), dtype=x.dtype)  # [M, N]
        tiles = f32_tiles(layer) if x.dtype is torch.float32 else bf16_tiles(layer)
        runs[x.dtype](x.data_ptr(), x.stride(0), *_ptrs(tiles), out.data_ptr(), x.shape[0], n, k,
                      torch.get_num_threads())
        return out

    def bind(layer: Int4Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        """``int4_matmul(x, layer)`` for one layer, its checks made once: a decode step makes 120 of these calls
        (SmolLM2), and the op's checks of the layer's buffers cost ~4x the kernel's own call. The buffers are held
        and compared by identity each call, so a layer whose codes are replaced (``refresh``) takes the op again."""
        if not _int4_layer_ok(layer):
            return lambda x: int4_matmul(x, layer)
        buffers = layer._buffers
        q, scale, zero = buffers["q"], buffers["scale"], buffers["zero"]
        k, n = layer.in_features, layer.out_features
        # each row dtype's tiles, made at its first rows (a float32 model on a CPU with both kernels never makes the
        # bf16 ones) and kept alive here: bf16 rows read bf16_tiles, float32 rows f32_tiles
        ptrs = _KernelArgs(layer)
        empty, bf16_t, threads = torch.empty, torch.bfloat16, torch.get_num_threads

        def takes(x: torch.Tensor) -> bool:  # _rows_ok's rows in a dtype bound here; the same buffers
            return (x.dtype in runs and x.is_cpu and x.dim() == 2 and x.shape[1] == k
                    and x.stride(1) == 1 and x.stride(0) >= k and buffers["q"] is q and buffers["scale"] is scale
                    and buffers["zero"] is zero)

        def product(x: torch.Tensor) -> torch.Tensor:
            if not takes(x):
                return int4_matmul(x, layer)
            m = x.shape[0]
            out = empty((m, n), dtype=x.dtype)  # [M, N]
            runs[x.dtype](x.data_ptr(), x.stride(0), *ptrs[x.dtype], out.data_ptr(), m, n, k, threads())
            return out

        def normed(x: torch.Tensor, weight: torch.Tensor, eps: float, rms_norm: Callable) -> torch.Tensor:
            """``product(rms_norm(x, weight, eps))`` in one call for rows of a dtype in ``normable`` (the norm's C++
            loop in the kernel's call)."""
            dtype = x.dtype
            if not (dtype in normable and takes(x) and weight.dtype is dtype and weight.is_contiguous()
                    and weight.shape == (k,)):
                return product(rms_norm(x, weight, eps))
            m = x.shape[0]
            out = empty((m, n), dtype=dtype)  # [M, N]
            if dtype is bf16_t:
                runs[bf16_t](x.data_ptr(), x.stride(0), *ptrs[bf16_t], out.data_ptr(), m, n, k, threads(),
                             weight.data_ptr(), float(eps))
            else:  # float32: the residual (none) comes first in its kernel's arguments
                runs[dtype](x.data_ptr(), x.stride(0), *ptrs[dtype], out.data_ptr(), m, n, k, threads(), 0,
                            weight.data_ptr(), float(eps))
            return out

        def added(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            """``residual + product(x)`` in one call (each sum rounded as torch rounds it in the rows' dtype)."""
            m = x.shape[0]
            if not (takes(x) and residual.dtype is x.dtype and residual.is_cpu and residual.shape == (m, n)
                    and residual.is_contiguous()):
                return residual + product(x)
            out = empty((m, n), dtype=x.dtype)  # [M, N]
            if x.dtype is bf16_t:
                runs[bf16_t](x.data_ptr(), x.stride(0), *ptrs[bf16_t], out.data_ptr(), m, n, k, threads(), 0, 1e-6,
                             residual.data_ptr())
            else:
                runs[x.dtype](x.data_ptr(), x.stride(0), *ptrs[x.dtype], out.data_ptr(), m, n, k, threads(),
                              residual.data_ptr())
            return out

        product.added = added  # type: ignore[attr-defined]
        product.tiles = ptrs.tiles  # type: ignore[attr-defined]  (ptrs point into them: alive while the product is)
        if normable:
            product.normed = normed  # type: ignore[attr-defined]
        return product

    int4_matmul.bind = bind  # type: ignore[attr-defined]
    int4_matmul.float32 = f32  # type: ignore[attr-defined]  (float32 rows have a kernel: fastgate.engine.fused)
    int4_matmul.float32_rows = F32_KERNEL_ROWS if f32 else 0  # type: ignore[attr-defined]  (and up to these rows)
    int4_matmul.bf16_rows = BF16_KERNEL_ROWS if bf16 else 0  # type: ignore[attr-defined]  (bf16 rows, likewise)
    return int4_matmul


def _ptrs(args: tuple) -> tuple[int, ...]:
    """A kernel's arguments from its tiles: each tensor's address, each form as it is."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


class _KernelArgs(dict):
    """A bound layer's kernel arguments by row dtype (``{dtype: (addresses and forms, ...)}``), each made at its first
    lookup, so that a bound product's per-call lookup stays one dict hit; the tiles they point into are kept in
    ``tiles`` (alive while the product is)."""

    def __init__(self, layer: Int4Linear) -> None:
        super().__init__()
        self.layer = layer
        self.tiles: dict[torch.dtype, tuple] = {}

    def __missing__(self, dtype: torch.dtype) -> tuple[int, ...]:
        tiles = self.tiles[dtype] = bf16_tiles(self.layer) if dtype is torch.bfloat16 else f32_tiles(self.layer)
        args = self[dtype] = _ptrs(tiles)
        return args


def ext_int8_matmul(ext: ModuleType, *, bf16: bool = True,
                    f32: bool = False) -> Callable[[torch.Tensor, Int8Linear], torch.Tensor]:
    """The C++ int8 product with :func:`torch_int8_matmul`'s signature; inputs it cannot take go to torch's.
    ``bf16`` / ``f32``: which rows run C++ (``int8_matmul_bf16``, AVX512-BF16; ``int8_matmul_f32``, AVX2 and FMA)."""
    runs = ext_kernels(ext, "int8_matmul", bf16=bf16, f32=f32)

    def int8_matmul(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        q, scale = layer.q, layer.scale
        k, n = layer.in_features, layer.out_features
        if not (_rows_ok(x, k, runs) and q.device.type == "cpu" and q.is_contiguous() and scale.is_contiguous()
                and scale.dtype is torch.float32):
            return torch_int8_matmul(x, layer)
        out = torch.empty((x.shape[0], n), dtype=x.dtype)  # [M, N]
        (q,) = f32_tiles(layer) if x.dtype is torch.float32 else bf16_tiles(layer)
        runs[x.dtype](x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), out.data_ptr(), x.shape[0], n, k,
                      torch.get_num_threads())
        return out

    int8_matmul.float32 = f32  # type: ignore[attr-defined]
    int8_matmul.float32_rows = F32_INT8_ROWS if f32 else 0  # type: ignore[attr-defined]  (and up to these rows)
    int8_matmul.bf16_rows = BF16_KERNEL_ROWS if bf16 else 0  # type: ignore[attr-defined]  (bf16 rows, likewise)
    return int8_matmul
