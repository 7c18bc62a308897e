"""The decode loop's choice of each row's next token and its log-prob on a CPU (op ``token_logprobs``;
docs/ARCHITECTURE.md, Ops).

The reference (:func:`fastgate.ops.reference.token_logprobs`) is torch's ``log_softmax`` over the whole row, its
``argmax`` and a ``gather``: on an AVX2-only EPYC ~60 us and 60-130 us of a batch-1 step for SmolLM2's 49,152 logits,
~1.5 ms of a batch-16 one, though only one log-prob a row is kept. ``fastgate._C.token_logprobs_f32`` reads a row
twice (its largest value and index; the sum of ``exp(x - max)``) and computes the one log-prob: torch's arithmetic
bit for bit (its AVX2 kernel's order of the sum and its vector reductions, the SLEEF ``exp`` and ``log`` that
libtorch_cpu exports), so a recorded log-prob, and any gate reading it, does not depend on which ran; a torch whose
float kernels run 16 wide (CPU capability AVX512: Zen 4 EPYCs, Xeons) sums in vectors of 16, and the kernel's
``width`` 16 follows that order (~0.15 ms of a SmolLM2 batch-1 step on a Zen 4 EPYC ran torch's three ops before it).
Why written here: torch has no fused "log-prob of the argmax" on a CPU. Bound only where a probe against torch agrees
bit for bit (the width of torch's own capability tried first, then the other); float32 rows on a CPU, unit stride
along the vocabulary; anything else goes to the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from fastgate.ops import reference

__all__ = ["ext_token_logprobs", "torch_width"]


def _probe_rows() -> list[torch.Tensor]:
    """Rows that exercise what the kernel must reproduce: vocabularies of 1, 7, 8, 13, 769 and 49,157 (a partial last
    vector), ties for the largest, large and tiny values."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(v, generator=gen) * s for v, s in ((1, 1.0), (7, 3.0), (8, 0.1), (13, 30.0), (769, 8.0),
                                                            (49157, 12.0))]
    rows[3][[2, 9]] = 200.0  # a tie for the largest
    return rows


def _agrees(run: Callable) -> bool:
    for row in _probe_rows():
        x = row[None]  # [1, V]
        chosen, lp = run(x)
        want_chosen, want_lp = reference.token_logprobs(x)
        if not (torch.equal(chosen, want_chosen) and torch.equal(lp, want_lp)):
            return False
        every = torch.arange(min(x.shape[1], 64))  # the first 64 tokens' log-probs, one row each
        xs = x.expand(len(every), -1).contiguous()  # [min(V, 64), V]
        got = run(xs, every)[1]
        if not torch.equal(got, reference.token_logprobs(xs, every)[1]):
            return False
    return True


def _bind(ext: ModuleType, width: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    run_ext = ext.token_logprobs_f32

    def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (logits.dtype is torch.float32 and logits.is_cpu and logits.ndim == 2 and logits.shape[1] > 0
                and logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1]
                and (chosen is None or (chosen.dtype is torch.int64 and chosen.is_cpu
                                        and chosen.shape == logits.shape[:1]))):
            return reference.token_logprobs(logits, chosen)
        m, v = logits.shape
        picks = torch.empty(m, dtype=torch.int64) if chosen is None else chosen.contiguous()  # [M]
        out = torch.empty(m, dtype=torch.float32)  # [M]
        try:
            run_ext(logits.data_ptr(), m, v, logits.stride(0), picks.data_ptr(), chosen is None, out.data_ptr(),
                    torch.get_num_threads(), width)
        except ValueError:  # a token out of range (checked before anything is written): torch's own error
            return reference.token_logprobs(logits, chosen)
        return picks, out

    token_logprobs.reference = reference.token_logprobs  # type: ignore[attr-defined]
    token_logprobs.width = width  # type: ignore[attr-defined]
    return token_logprobs


@functools.cache
def _agrees_here(ext: ModuleType, width: int) -> bool:
    """The probe of one width, once a process (an engine builds its ops once; the tests build many)."""
    try:
        return _agrees(_bind(ext, width))
    except (RuntimeError, ValueError):  # (ValueError: a width this build or CPU does not have)
        return False


def torch_width() -> int:
    """The floats a vector of torch's CPU kernels holds here: 16 where its capability is AVX512, else 8."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def ext_token_logprobs(ext: ModuleType) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The op ``token_logprobs`` over the extension where it is torch's bit for bit here (module docstring): the
    width of torch's own kernels tried first, then the other; the reference where neither agrees."""
    if not (hasattr(ext, "token_logprobs_f32") and ext.torch_exp_found()):
        return reference.token_logprobs
    first = torch_width()
    for width in (first, 24 - first):
        if _agrees_here(ext, width):
            return _bind(ext, width)
    return reference.token_logprobs
