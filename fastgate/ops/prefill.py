"""A prompt chunk's attention over bf16 or float32 keys and values on a CPU (op ``prefill_attention``,
docs/ARCHITECTURE.md).

The reference (:func:`fastgate.ops.reference.prefill_attention`) is torch's SDPA, whose CPU flash kernel ran a
700-token SmolLM2 prompt's causal attention (9 heads, 3 key / value heads, head dim 64) at ~50 GFLOP/s on one thread
of a Zen 4 EPYC, in bf16 and in float32 alike: 10.5 ms a layer, 46% of a 16 x 700 prefill (5.3 of 11.5 s; HF's own
forward spends the same), where the products ran at ~450 GFLOP/s. Two implementations here, both float32 inside
(scores, softmax, the value product) with the output rounded to bf16 once, so closer to float32 attention than the
flash kernel's bf16 path, which also rounds the probabilities to bf16 (max error on that layer 0.0142 against 0.0142,
mean 0.00063 against 0.00071):

- :func:`ext_prefill_attention`: the C++ kernel (``fastgate._C.prefill_attention_bf16``, csrc/ops.cpp) where the CPU
  has AVX512-BF16: the scores from bf16 dot products (exact bf16 products summed in float32: the float32 scores of
  the bf16 inputs) over keys repacked once per call, the upper triangle skipped: 2.8 ms for that layer, 3.9x SDPA.
  Head dims 32, 64 and 128; every other input goes to the blocks. Its ``segs`` (``prefill_attention_segs_bf16``):
  every chunk of a packed pass in one call a layer, their buffers' writes included, each chunk's work items those of
  its own call (the same bits) spread over the pool together. A burst's 12 closed-book prompts (SmolLM2, ~12 tokens
  each after the cached few-shot block) made 12 calls a layer of 3 items each on 2 threads: their pass 158 -> 152 ms
  and 160 -> 146 ms (medians of 8 and 16, 2-core Zen 4 EPYC).
- :func:`blocked_prefill_attention`: torch operations, for any CPU: the queries in blocks of :data:`BLOCK` rows, each
  block one float32 batched product against the columns it may see and one against the values (7.3 ms; oneDNN's
  float32 product runs at ~200 GFLOP/s, the bf16 one faster but rounding the scores to bf16). Rounding the
  probabilities to bf16 for a bf16 value product ran 5.6 ms at 1.25-1.4x the flash kernel's mean error: not taken.

float32 chunks (a float32 model's) run :func:`ext_prefill_attention`'s float32 kernel
(``fastgate._C.prefill_attention_f32``) where the CPU has AVX-512 (16 floats a vector) or AVX2 and FMA (8): each
score a float32 dot product over 16 (8) keys a register (keys repacked once per call), the upper triangle skipped,
the softmax and the value product as above, the output float32. SDPA's flash kernel ran a 700-token SmolLM2 layer in
6.1 ms on two Zen 4 cores and a chunk that continues a prompt through a mask over the whole rectangle (4.6 ms for
376 queries after 324 columns); the kernel 3.2 and 2.5 ms (8 wide on the same CPU: 4.9 and 3.8 ms). Its sums run in
another order than SDPA's: outputs within ~5e-6 of float64 attention where SDPA's are within ~1e-6
(tests/test_prefill_attention.py); the replay set's greedy answers are unchanged (docs/RESULTS.md). Every other
input (another dtype, another device, a head dim without tiles, float32 where the CPU has no AVX2) goes to the
reference, torch's SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from fastgate.errors import ShapeError
from fastgate.ops import reference

__all__ = ["BLOCK", "KERNEL_HEAD_DIMS", "blocked_prefill_attention", "ext_prefill_attention"]

KERNEL_HEAD_DIMS = (32, 64, 128)  # the C++ kernel's (its value accumulators are sized per head dim)

BLOCK = 64  # query rows a block: 64 and 96 fastest for the layer above, 32 ~10% slower, 128 ~70% (blocks spill cache)


def _bf16_on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is bf16 on a CPU: the inputs both implementations here are for."""
    return all(t.dtype is torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def blocked_prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                              scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fastgate.ops.reference.prefill_attention`'s signature and semantics; bf16 CPU inputs in query blocks
    (module docstring), every other input through the reference. ``mask`` is not read by the blocks, whose causal
    pattern is the same for every chunk (it goes to the reference with the inputs the blocks do not take)."""
    if not _bf16_on_cpu(q, keys, values):
        return reference.prefill_attention(q, keys, values, start, scale, mask)
    reference.check_prefill_attention_args(q, keys, values, start)
    _, heads, n, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    scale = dim ** -0.5 if scale is None else float(scale)
    qg = q[0].unflatten(0, (kv_heads, group))  # [Hkv, g, n, D]: a key / value head's query heads side by side
    kt = keys[0].to(torch.float32).transpose(1, 2)  # [Hkv, D, S]: the scores in float32, as the flash kernel's
    v = values[0].to(torch.float32)  # [Hkv, S, D]
    out = torch.empty((kv_heads, group, n, dim), dtype=q.dtype, device=q.device)  # [Hkv, g, n, D]
    # [B, B]: a block's own columns above its diagonal
    tri = torch.full((BLOCK, BLOCK), float("-inf"), device=q.device).triu(1)
    for s in range(0, n, BLOCK):
        e = min(n, s + BLOCK)
        b, cols = e - s, start + e  # rows of the block; the columns its last row sees
        qb = qg[:, :, s:e].to(torch.float32).mul_(scale).reshape(kv_heads, group * b, dim)  # [Hkv, g*b, D]
        scores = torch.bmm(qb, kt[:, :, :cols]).view(kv_heads, group, b, cols)  # [Hkv, g, b, cols] float32
        scores[..., cols - b:].add_(tri[:b, :b])  # row i sees columns .. start + s + i
        p = torch.softmax(scores, -1).view(kv_heads, group * b, cols)  # [Hkv, g*b, cols] float32
        out[:, :, s:e] = torch.bmm(p, v[:, :cols]).view(kv_heads, group, b, dim)  # [Hkv, g, b, D], rounded once
    return out.view(1, heads, n, dim)  # [1, H, n, D]


def ext_prefill_attention(ext: ModuleType) -> Callable[..., torch.Tensor]:
    """The C++ kernels with the reference's signature: bf16 inputs where ``ext.prefill_attention_bf16_supported()``,
    float32 inputs where ``ext.prefill_attention_f32_supported()`` (call only where one of them is); inputs neither
    runs go to :func:`blocked_prefill_attention` (and from there bf16 ones to the blocks, others to the reference)."""

    # the kernel for each dtype this CPU runs, asked once (an extension built before the float32 kernel: bf16 only)
    kernels = {}
    if ext.prefill_attention_bf16_supported():
        kernels[torch.bfloat16] = ext.prefill_attention_bf16
    if getattr(ext, "prefill_attention_f32_supported", lambda: False)():
        kernels[torch.float32] = ext.prefill_attention_f32

    def kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> Callable | None:
        if not (q.device.type == "cpu" and q.dtype == keys.dtype == values.dtype and q.dim() == 4
                and q.shape[-1] in KERNEL_HEAD_DIMS and q.stride(-1) == 1 and keys.stride(-1) == 1
                and keys.stride() == values.stride() and keys.device.type == values.device.type == "cpu"):
            return None
        return kernels.get(q.dtype)

    def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                          scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        run = kernel(q, keys, values)
        if run is None:  # bf16 inputs to the blocks, every other to the reference
            return blocked_prefill_attention(q, keys, values, start, scale, mask)
        reference.check_prefill_attention_args(q, keys, values, start)
        _, heads, n, dim = q.shape
        out = torch.empty((n, heads, dim), dtype=q.dtype)  # [n, H, D]
        try:
            run(q.data_ptr(), q.stride(1), q.stride(2), keys.data_ptr(), values.data_ptr(), keys.stride(1),
                keys.stride(2), out.data_ptr(), n, heads, keys.shape[1], dim, start,
                dim ** -0.5 if scale is None else float(scale), torch.get_num_threads())
        except ValueError as exc:
            raise ShapeError(str(exc)) from None
        return out.transpose(0, 1)[None]  # [1, H, n, D]

    batched = getattr(ext, "prefill_attention_segs_bf16", None) if torch.bfloat16 in kernels else None
    if batched is not None:  # an extension built before the batched call: each chunk its own call
        prefill_attention.segs = _segs_call(batched)
    return prefill_attention


Chunk = tuple[int, int, int, torch.Tensor, torch.Tensor]  # (offset, n, start, key buffer, value buffer)


def _segs_call(run: Callable) -> Callable[..., bool]:
    """The C++ call for a packed pass's bf16 chunks, all at once (:func:`ext_prefill_attention`'s ``segs``)."""

    def segs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunks: list[Chunk], scale: float | None,
             out: torch.Tensor) -> bool:
        """Each chunk's new keys / values (``key`` / ``value [1, Hkv, T, D]`` of the pass, at its offset) into its
        buffers ``[1, Hkv, P, D]`` at columns ``start .. start + n - 1``, and its rows of ``out [T, H, D]``: the
        attention of ``query [1, H, T, D]``'s rows over its buffer's columns ``0 .. start + row``, what the per-chunk
        call computes, bit for bit. Returns False, doing nothing, where an input is not the kernel's (the caller
        then takes each chunk on its own)."""
        _, heads, t, dim = query.shape
        kv_heads = key.shape[1]
        if not (dim in KERNEL_HEAD_DIMS and _bf16_on_cpu(query, key, value, out) and query.stride(-1) == 1
                and key.stride(-1) == 1 and value.stride(-1) == 1 and key.shape == value.shape
                and key.shape[2] == t and heads % kv_heads == 0 and out.shape == (t, heads, dim)
                and out.is_contiguous()):
            return False
        rows = []
        for offset, n, start, k_buf, v_buf in chunks:
            if not (_bf16_on_cpu(k_buf, v_buf) and k_buf.dim() == 4 and k_buf.shape[0] == 1
                    and k_buf.shape[1] == kv_heads and k_buf.shape[3] == dim and k_buf.shape[2] >= start + n
                    and k_buf.stride(-1) == 1 and k_buf.stride(2) == dim and k_buf.stride() == v_buf.stride()
                    and k_buf.shape == v_buf.shape and 0 <= offset and offset + n <= t and n >= 0 and start >= 0):
                return False
            rows.append((offset, n, start, k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(1)))
        table = torch.tensor(rows, dtype=torch.int64)  # [chunks, 6]
        try:
            run(query.data_ptr(), query.stride(1), query.stride(2), key.data_ptr(), key.stride(1), key.stride(2),
                value.data_ptr(), value.stride(1), value.stride(2), table.data_ptr(), len(rows), out.data_ptr(),
                heads, kv_heads, dim, dim ** -0.5 if scale is None else float(scale), torch.get_num_threads())
        except ValueError as exc:
            raise ShapeError(str(exc)) from None
        return True

    return segs
