"""The one ops registry: every op (docs/ARCHITECTURE.md, Ops) bound, once, to an implementation for a requested backend
and a device.

Why one registry: the gating ops (tap accumulate, prober, eigenscore) and the CPU ops (word alignment, word log-probs,
AIS) used to be chosen by two dispatchers that each parsed ``FASTGATE_BACKEND`` and each knew a different set of
backends, and a fast implementation that could not run an input (the Triton eigenscore for k > 64) raised instead of
handing the input to its reference. Here :func:`build_ops` makes every choice in one place, reads
``FASTGATE_BACKEND`` through one function (:func:`env_backend`), records the implementation each op got
(:attr:`Ops.backends`) and wraps each fast implementation so that an input it cannot run goes to the op's reference,
which gives the same results.

Backends (the ``backend`` argument; ``FASTGATE_BACKEND`` takes the same values and applies where ``auto`` is asked):

- ``auto``: on CUDA the Triton kernels for accumulate, prober and eigenscore when ``triton`` imports; on CPU the C++
  eigenscore when the extension ``fastgate._C`` is built (accumulate and prober stay torch, where they cost ~nothing);
  the CPU ops (align_words, word_logprobs, AIS) run in the extension when it is built, in numpy otherwise, and so
  does the decode rows' attention over a bf16 store on a CPU (``decode_attention``; torch's SDPA otherwise) and the
  fused pass's norm and rotary embedding of bf16 rows (``rms_norm``, ``rope``; torch operations otherwise), and of
  float32 rows where the CPU has AVX2 and FMA (so does the decode-only pass's ``decode_attention_step``). A
  prompt chunk's attention over bf16 keys on a CPU (``prefill_attention``, :mod:`fastgate.ops.prefill`) runs in the
  extension where the CPU has AVX512-BF16 (``ext``), else in query blocks of torch's batched products (``blocked``,
  no extension needed), under every backend but ``torch``; torch's SDPA elsewhere; a float32 chunk in the extension
  where the CPU has AVX2 and FMA, torch's SDPA otherwise. As for the ``ext`` layer ops, the record names the
  implementation bound for the device: inputs it is not for still run the reference.
  The decode step's quantized products (``int4_matmul``, ``int8_matmul``, :mod:`fastgate.ops.quant`) run in the
  extension for bf16 rows where the CPU has AVX512-BF16 and for float32 rows where it has AVX2 and FMA; torch's
  weight-only kernels (bf16 rows) and the de-quantized dense product (float32 rows) otherwise, and under ``torch``.
  A float32 model's int4 decoder layers run a decode pass in one call (``decode_layers``, :mod:`fastgate.ops.decoder`)
  where the CPU has AVX2 and FMA and the extension's SwiGLU is torch's bit for bit; elsewhere the reference binds
  nothing and the fused pass runs the ops one by one, with the same results. A decode step's tokens and log-probs
  (``token_logprobs``, :mod:`fastgate.ops.sampling`) run in the extension for float32 logits where the CPU has AVX2
  and FMA and a probe finds torch's ``log_softmax`` bits; torch's three calls otherwise. A layer's dense product
  of bf16 rows (``dense_linear``, :mod:`fastgate.ops.dense`: a prompt chunk's, a large batch's) multiplies its
  weight in oneDNN's layout, made once (``onednn``), where torch has oneDNN's bf16 product and a probe finds
  ``F.linear``'s bits, with or without the extension; ``F.linear`` of the plain weight otherwise.
- ``triton``: insists on Triton for the three gating ops: fails unless ``triton`` imports and the device is CUDA, or
  ``TRITON_INTERPRET=1`` is set (the interpreter runs the kernels on CPU tensors; the tests use it). CPU ops as auto.
- ``ext``: insists on the C++ extension and a CPU device, for the eigenscore and every CPU op.
- ``torch`` (alias ``python``): every op runs its reference (``fastgate.ops.reference``, ``fastgate.ops._python``).

Every choice is recorded by op name in :attr:`Ops.backends`: ``triton``, ``ext``, ``blocked``, ``onednn``, ``torch``
(the torch references) or ``python`` (the numpy references). ``triton`` is imported only when a Triton kernel is chosen.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Literal

import torch

from fastgate.errors import BackendUnavailableError, InputError
from fastgate.ops import _python, reference
from fastgate.ops._cpu import CpuOps
from fastgate.ops.decoder import no_decode_layers
from fastgate.ops.dense import torch_dense_linear
from fastgate.ops.quant import torch_int4_matmul, torch_int8_matmul

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "OP_NAMES",
    "Ops",
    "build_ops",
    "env_backend",
    "ext_available",
    "import_ext",
    "requested_backend",
    "triton_available",
]

ENV_VAR = "FASTGATE_BACKEND"
BACKENDS: tuple[str, ...] = ("auto", "triton", "ext", "torch", "python")
Backend = Literal["auto", "triton", "ext", "torch", "python"]
GateBackend = Literal["triton", "ext", "torch"]

GATE_OPS: tuple[str, ...] = ("accumulate", "probe_logits", "eigenscore")
CPU_OPS: tuple[str, ...] = ("align_words", "word_logprobs", "align_word_logprobs_batch", "ais_scores",
                            "ais_scores_batch", "ais_topk_batch")
_LAYER_OPS = ("decode_attention", "decode_attention_step", "rms_norm", "rope")  # the engine's: C++ on a CPU
_QUANT_OPS = ("int4_matmul", "int8_matmul")  # the decode step's quantized products (C++: bf16 / float32 rows)
OP_NAMES: tuple[str, ...] = (*GATE_OPS, "answer_nll", *_LAYER_OPS, "swiglu", "prefill_attention", *_QUANT_OPS,
                             "dense_linear", "decode_layers", "token_logprobs", *CPU_OPS)


def import_ext() -> ModuleType | None:
    """The compiled extension ``fastgate._C``, or None when it is not built."""
    try:
        return importlib.import_module("fastgate._C")
    except ImportError:
        return None


def ext_available() -> bool:
    """Whether the compiled extension ``fastgate._C`` can be imported."""
    return import_ext() is not None


def triton_available() -> bool:
    """Whether ``triton`` and the kernels import (imports them: call it only where Triton may be chosen)."""
    try:
        importlib.import_module("fastgate.kernels.probe")
        importlib.import_module("fastgate.kernels.gram")
    except ImportError:
        return False
    return True


def env_backend() -> str:
    """The backend ``FASTGATE_BACKEND`` asks for where ``auto`` is requested: ``auto`` when unset or empty.

    The one place the variable is read. Raises :class:`InputError` for a value that is not a backend.
    """
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if not raw:
        return "auto"
    if raw not in BACKENDS:
        raise InputError(f"{ENV_VAR}={raw!r} is not a backend; choose one of: {', '.join(BACKENDS)}")
    return raw


@dataclass(frozen=True, eq=False)
class Ops:
    """Every op (docs/ARCHITECTURE.md, Ops), bound to one implementation each; build it with :func:`build_ops`.

    The ops have the signatures and semantics of their references (:mod:`fastgate.ops.reference` for the tensor ops,
    :class:`~fastgate.ops._cpu.CpuOps` for the CPU ops). Where the chosen fast implementation cannot run an input it
    hands the input to the reference, so an op never fails for want of a fast path.
    """

    backend: GateBackend  # the backend of the gating ops (today's ``engine.backend``)
    device: torch.device
    backends: Mapping[str, str]  # op name -> "triton" | "ext" | "blocked" | "torch" | "python"
    accumulate: Callable[..., None]  # (running_sum [B,L,d], states [B,L,d], weight [B]) -> None, in place
    probe_logits: Callable[..., torch.Tensor]  # (sums [B,L,d], counts [B], ProbeParams) -> [B,L,2]
    eigenscore: Callable[..., torch.Tensor]  # (z [B,k,d], alpha=1e-3, valid=None, scale=None) -> [B]
    answer_nll: Callable[..., torch.Tensor]  # (token_logprobs [B,T], mask [B,T]) -> [B]
    align_words: Callable[..., tuple[list[str], list[int]]]  # (pieces) -> (words, word_ids)
    word_logprobs: Callable[..., torch.Tensor]  # (token_logprobs [T], word_ids [T], n_words=None) -> [W]
    align_word_logprobs_batch: Callable[..., list]  # (batch_pieces, batch_logprobs) -> [(words, ids, lp [W])]
    ais_scores: Callable[..., torch.Tensor]  # (q [d], p [d], docs [n,d], mode="angle") -> [n]
    ais_scores_batch: Callable[..., torch.Tensor]  # (Q [B,d], P [B,d], D [B,n,d], mode="angle") -> [B,n]
    ais_topk_batch: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (Q, P, D, k, mode) -> (scores, idx) [B,k']
    decode_attention: Callable[..., torch.Tensor]  # (q [m,H,D], keys/values [R,Hkv,C,D], pos [m], scale) -> [m,H,D]
    # (q [m,H,D], k_new/v_new [m,Hkv,D], keys/values [R,Hkv,C,D], pos [m], scale) -> [m,H,D]: store writes + attention
    decode_attention_step: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]  # (x [T,d], weight [d], eps) -> [T,d]: the fused pass's norm
    rope: Callable[..., torch.Tensor]  # (x [T,H,D], cos [T,1,D], sin [T,1,D]) -> [T,H,D]: its rotary embedding
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # (gu [T,2I]) -> [T,I]: silu(gate) * up, its MLP's activation
    # (q [1,H,n,D], keys/values [1,Hkv,start+n,D], start, scale, mask) -> [1,H,n,D]: a prompt chunk's causal attention
    prefill_attention: Callable[..., torch.Tensor]
    int4_matmul: Callable[..., torch.Tensor]  # (x [M,K] bf16, Int4Linear) -> [M,N] bf16: a decode step's product
    int8_matmul: Callable[..., torch.Tensor]  # (x [M,K] bf16, Int8Linear) -> [M,N] bf16
    # (weight [N,K], bias [N] | None) -> (x [M,K] -> [M,N]): a layer's dense product bound once, F.linear's bits
    dense_linear: Callable[..., Callable[[torch.Tensor], torch.Tensor]]
    # (layers [DecoderLayerWeights], heads, kv_heads, head_dim) -> DecodeStack | None: a float32 int4 model's decoder
    # layers for decode rows in one call (fastgate.ops.decoder); None: the fused pass's per-op path
    decode_layers: Callable[..., object]
    # (logits [M,V] float32, chosen [M] | None) -> (chosen [M] int64, log-probs [M]): a decode step's tokens (argmax
    # where chosen is None) and their log-probs, torch's log_softmax bit for bit (fastgate.ops.sampling)
    token_logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    @property
    def cpu_backend(self) -> Literal["ext", "python"]:
        """The implementation of the CPU ops (align_words, word_logprobs, AIS): ``ext`` or ``python``."""
        return self.backends["ais_scores"]  # type: ignore[return-value]


def requested_backend(backend: str) -> str:
    """Validate a requested backend and apply ``FASTGATE_BACKEND`` where it is ``auto``; ``python`` -> ``torch``."""
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = env_backend()
    return "torch" if backend == "python" else backend


def _cpu_backend(backend: str) -> Literal["ext", "python"]:
    # backend: resolved by requested_backend (FASTGATE_BACKEND applied)
    if backend == "torch":
        return "python"
    if backend == "ext" and not ext_available():
        raise BackendUnavailableError("backend 'ext' needs the C++ extension fastgate._C, which is not built: "
                                      "reinstall with `pip install -e .` (needs cmake and a C++ compiler), or use "
                                      "'auto', 'torch' or 'python'")
    return "ext" if ext_available() else "python"


def _gate_backend(backend: str, device: torch.device) -> GateBackend:
    # backend: resolved by requested_backend (FASTGATE_BACKEND applied)
    if backend == "torch":
        return "torch"
    if backend == "ext":
        if device.type != "cpu":
            raise BackendUnavailableError(f"backend 'ext' runs on CPU tensors, not {device.type}; use 'auto'")
        _cpu_backend("ext")  # raises without the extension
        return "ext"
    if backend == "triton":
        if not triton_available():
            raise BackendUnavailableError("backend 'triton' needs the triton package: pip install triton (Linux), or "
                                          "use backend='auto' or 'torch'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendUnavailableError(f"backend 'triton' runs on CUDA tensors, not {device.type} (set "
                                          "TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)")
        return "triton"
    if device.type == "cuda":  # auto
        return "triton" if triton_available() else "torch"
    return "ext" if device.type == "cpu" and ext_available() else "torch"


def _with_fallback(fast: Callable, ref: Callable, runs: Callable[..., bool]) -> Callable:
    """``fast`` where ``runs(*args)`` says it can take the input, else the reference ``ref`` (same results)."""

    @functools.wraps(fast)
    def op(*args, **kwargs):
        return fast(*args, **kwargs) if runs(*args, **kwargs) else ref(*args, **kwargs)

    op.fast, op.reference = fast, ref  # type: ignore[attr-defined]
    return op


def _triton_ops(interpret: bool) -> dict[str, Callable]:
    """The Triton kernels, each behind the inputs it can run: tensors on CUDA (or any device in the interpreter),
    a contiguous float32 running sum, and at most ``gram.MAX_K`` samples for the register-resident Gram matrix."""
    from fastgate.kernels import gram, probe

    def on_device(t: torch.Tensor) -> bool:
        return interpret or t.is_cuda

    def accumulate_runs(running_sum, states, weight) -> bool:
        return on_device(running_sum) and running_sum.dtype == torch.float32 and running_sum.is_contiguous()

    def probe_runs(sums, counts, params) -> bool:
        return on_device(sums)

    def eigenscore_runs(z, *args, **kwargs) -> bool:
        return on_device(z) and (z.ndim != 3 or z.shape[1] <= gram.MAX_K)  # bad shapes: the kernel's own error

    return {
        "accumulate": _with_fallback(probe.accumulate, reference.accumulate_taps, accumulate_runs),
        "probe_logits": _with_fallback(probe.probe_logits, reference.probe_logits, probe_runs),
        "eigenscore": _with_fallback(gram.eigenscore, reference.eigenscore, eigenscore_runs),
    }


def _ext_eigenscore(ext: CpuOps) -> Callable:
    """The C++ eigenscore for CPU tensors; tensors elsewhere go to the reference, which keeps them there."""
    return _with_fallback(ext.eigenscore, reference.eigenscore, lambda z, *a, **k: z.device.type == "cpu")


def _cpu_ops(backend: Literal["ext", "python"]) -> CpuOps:
    """The CPU ops adapter of one implementation module (``ext`` raises unless the extension is built)."""
    if backend == "python":
        return CpuOps("python", _python)
    ext = import_ext()
    if ext is None:
        raise BackendUnavailableError("the C++ extension fastgate._C is not built; reinstall with `pip install -e .` "
                                      "(needs cmake and a C++ compiler) or use backend='python'")
    return CpuOps("ext", ext)


def build_ops(backend: str = "auto", device: torch.device | str = "cpu") -> Ops:
    """Bind every op (docs/ARCHITECTURE.md, Ops) for ``device``, once (see the module docstring for the backends).

    Args:
        backend: ``auto|triton|ext|torch|python``; ``auto`` defers to ``FASTGATE_BACKEND`` when it is set.
        device: where the gating ops' tensors live (the model's device).

    Raises:
        InputError: an unknown backend (argument or ``FASTGATE_BACKEND``).
        BackendUnavailableError: ``triton`` or ``ext`` was asked for and cannot run here.
    """
    device = torch.device(device)
    backend = requested_backend(backend)  # FASTGATE_BACKEND is read here, once per build
    gate, cpu = _gate_backend(backend, device), _cpu_backend(backend)
    impl = _cpu_ops(cpu)
    chosen: dict[str, Callable] = {
        "accumulate": reference.accumulate_taps,
        "probe_logits": reference.probe_logits,
        "eigenscore": reference.eigenscore,
        "answer_nll": reference.answer_nll,
        "decode_attention": reference.decode_attention,
        "decode_attention_step": reference.decode_attention_step,
        "rms_norm": reference.rms_norm,
        "rope": reference.rope,
        "swiglu": reference.swiglu,
        "prefill_attention": reference.prefill_attention,
        "int4_matmul": torch_int4_matmul,
        "int8_matmul": torch_int8_matmul,
        "dense_linear": torch_dense_linear,
        "decode_layers": no_decode_layers,
        "token_logprobs": reference.token_logprobs,
        **{name: getattr(impl, name) for name in CPU_OPS},
    }
    names = {name: "torch" for name in (*GATE_OPS, "answer_nll", *_LAYER_OPS, "swiglu", "prefill_attention",
                                        *_QUANT_OPS, "dense_linear", "decode_layers", "token_logprobs")}
    names |= {name: cpu for name in CPU_OPS}
    ext = import_ext() if cpu == "ext" and device.type == "cpu" else None  # built: _cpu_ops("ext") imported it
    if ext is not None:  # the engine's decode rows over a bf16 store (fastgate.ops.attention)
        from fastgate.ops.attention import ext_decode_attention, ext_decode_attention_step
        from fastgate.ops.layer import UNLIMITED, ext_rms_norm, ext_rope, row_limits

        # the rows each loop pays for at this CPU's vector width (an extension built before the widths: 8 wide)
        limits = row_limits(getattr(ext, "cpu_has_avx512", lambda: False)())
        # bf16 products where the CPU has AVX512-BF16; float32 products, norm, rotary embedding and decode attention
        # where it has AVX2 and FMA (an older extension: torch's for both)
        bf16 = bool(getattr(ext, "quant_kernels_supported", lambda: False)())
        f32 = bool(getattr(ext, "quant_f32_kernels_supported", lambda: False)())
        f32_layers = f32 and hasattr(ext, "rms_norm_f32")  # built with the float32 layer ops
        chosen |= {"decode_attention": ext_decode_attention(ext),
                   "rms_norm": ext_rms_norm(ext, limits["rms_norm"], f32=f32_layers),
                   "rope": ext_rope(ext, limits["rope"], f32=f32_layers),
                   # bf16 rows (float32 rows too where f32_layers); others: the references. The rotary embedding in
                   # the same call where rope is C++ for any rows (AVX-512), and for float32 rows
                   "decode_attention_step": ext_decode_attention_step(ext, fuse_rope=limits["rope"] == UNLIMITED,
                                                                      f32=f32_layers)}
        names |= {name: "ext" for name in _LAYER_OPS}
        if bf16 or f32:
            from fastgate.ops.quant import ext_int4_matmul, ext_int8_matmul

            # the C++ norm above is bound for every bf16 row here (AVX512-BF16 CPUs have AVX-512): int4 products
            # may norm their rows in the same call with it
            fuse = names["rms_norm"] == "ext" and limits["rms_norm"] == UNLIMITED
            chosen |= {"int4_matmul": ext_int4_matmul(ext, fuse_norm=fuse, bf16=bf16, f32=f32,
                                                      fuse_norm_f32=f32_layers),
                       "int8_matmul": ext_int8_matmul(ext, bf16=bf16, f32=f32)}
            names |= {name: "ext" for name in _QUANT_OPS}
            # whole layers of float32 rows (with the float32 layer ops) and of bf16 rows (where the bf16 norm and
            # rotary embedding bound above are the C++ loops for any rows: that call runs those loops), where the
            # extension's SwiGLU is torch's here
            bf16_layers = bf16 and fuse and limits["rope"] == UNLIMITED
            if f32_layers or bf16_layers:
                from fastgate.ops.decoder import ext_decode_layers

                chosen["decode_layers"] = ext_decode_layers(ext, f32=f32_layers, bf16=bf16_layers)
                if chosen["decode_layers"] is not no_decode_layers:
                    names["decode_layers"] = "ext"
        if bf16 and getattr(ext, "torch_exp_found", lambda: False)():  # bf16 rows' SwiGLU where it is torch's bits
            from fastgate.ops.decoder import silu_agrees
            from fastgate.ops.layer import ext_swiglu

            if silu_agrees(ext, torch.bfloat16):
                chosen["swiglu"], names["swiglu"] = ext_swiglu(ext), "ext"
        if f32:  # float32 logits on a CPU with AVX2 and FMA, where a probe finds torch's bits (fastgate.ops.sampling)
            from fastgate.ops.sampling import ext_token_logprobs

            chosen["token_logprobs"] = ext_token_logprobs(ext)
            if chosen["token_logprobs"] is not reference.token_logprobs:
                names["token_logprobs"] = "ext"
    if backend != "torch" and device.type == "cpu":  # bf16 rows' dense products with the weight reordered once
        from fastgate.ops.dense import OnednnDense, onednn_agrees, resting_dense_linear

        # the extension's pooled calls (norm, rotary embedding, attention) alternate with these products in a chunk
        # pass: its spinning workers are sent to sleep before each (fastgate.ops.dense, rest), whichever product
        rest = getattr(ext, "pool_rest", None) if ext is not None else None
        if onednn_agrees():
            chosen["dense_linear"] = OnednnDense(rest)  # may also hold a quantized layer's kept copy (adopt)
            names["dense_linear"] = "onednn"
        elif rest is not None:  # F.linear's bits: recorded as the reference ("torch")
            chosen["dense_linear"] = functools.partial(resting_dense_linear, rest=rest)
    if backend != "torch" and device.type == "cpu":  # bf16 chunks (fastgate.ops.prefill); others: the reference
        from fastgate.ops.prefill import blocked_prefill_attention, ext_prefill_attention

        # the C++ kernels: bf16 chunks where the CPU has AVX512-BF16, float32 chunks where it has AVX2 and FMA
        if ext is not None and (ext.prefill_attention_bf16_supported()
                                or getattr(ext, "prefill_attention_f32_supported", lambda: False)()):
            chosen["prefill_attention"], names["prefill_attention"] = ext_prefill_attention(ext), "ext"
        else:  # torch operations: no extension needed
            chosen["prefill_attention"], names["prefill_attention"] = blocked_prefill_attention, "blocked"
    if gate == "triton":
        chosen.update(_triton_ops(os.environ.get("TRITON_INTERPRET") == "1"))
        names.update({name: "triton" for name in GATE_OPS})
    elif gate == "ext":
        chosen["eigenscore"] = _ext_eigenscore(impl)
        names["eigenscore"] = "ext"
    return Ops(backend=gate, device=device, backends=MappingProxyType(names), **chosen)
