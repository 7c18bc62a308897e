"""The one place that switches a model's attention implementation: fastgate's decode paths (the packed pass of
:mod:`fastgate.engine.packed`, the static step of :mod:`fastgate.engine.static_step`) run their own attention
functions through transformers' ``AttentionInterface`` for one pass each, and every layer reads the implementation's
name from the shared config when it runs. Registering (once, on first use; never at import) and switching (for the
pass only, restored after it) are written here so the two paths cannot disagree on how.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["attention_dtype", "attention_implementation", "register_attention", "sdpa_backends", "sdpa_choice"]

_registered: dict[str, Callable] = {}


def attention_dtype(device, dtype):
    """The dtype decode rows attend in over a cache of ``dtype`` on ``device``: float32 for a bf16 / fp16 cache on a
    CPU (the cache stays as it is, each step's slice cast), None (the cache's own) elsewhere. torch's CPU SDPA in bf16
    took 3.76 ms a layer at 16 rows x 600 columns against 0.55 ms through float32 on a Zen 4 EPYC (AVX512-BF16),
    which made bf16's batch-16 step at 600 tokens 1.9x float32's (bench/results/engine.csv). The packed pass and the
    static step both follow it, so that they compute the same tokens."""
    import torch

    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return None


def sdpa_backends(device) -> list | None:
    """The SDPA backends fastgate's decode passes allow on ``device``, chosen once by the runner: on CUDA every one
    but cuDNN's, whose per-shape execution plan is built on the host at each new key length, which is every decode
    step (1.26 ms of host time per layer call on an H200, 30 calls a step: a 53 ms batch-1 step of which the GPU ran
    2 ms; bench/profile_step.py); None (torch's own choice) elsewhere. The flash and memory-efficient kernels build
    nothing per shape."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def sdpa_choice(backends: list | None) -> Iterator[None]:
    """Inside the block torch's SDPA picks among ``backends`` (:func:`sdpa_backends`; None: unrestricted)."""
    if backends is None:
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends):
        yield


def register_attention(name: str, fn: Callable) -> None:
    """Register ``fn`` with transformers as attention implementation ``name`` (once)."""
    if _registered.get(name) is not fn:
        from transformers import AttentionInterface

        AttentionInterface.register(name, fn)
        _registered[name] = fn


@contextlib.contextmanager
def attention_implementation(config, name: str, fn: Callable) -> Iterator[None]:
    """``config``'s attention implementation is ``name`` (the function ``fn``, registered on first use) inside the
    block, and what it was after it; the padded paths outside the block never see it."""
    register_attention(name, fn)
    old = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old
