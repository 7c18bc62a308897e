"""The weights' dtype, chosen once when a model loads: bf16 where the hardware multiplies it natively, float32
elsewhere.

``auto`` means bf16 on CUDA, and on a CPU whose flags name a native bf16 product (``amx_bf16``: Intel AMX tiles;
``avx512_bf16``: AVX-512 BF16 dot products) *and* where a short timed product at the model's own shapes confirms
it (the flags say what the CPU can do, the probe what this torch build makes of it); float32 on every other CPU,
where bf16 is emulated and slower (an AMD EPYC without the flags, most laptops). A 2-core Xeon with AMX-BF16 runs
SmolLM2-135M's 16 × 700 prefill 3.7× faster in bf16 (issue 35).

Whatever the weights are, logits, taps, gate inputs and log-probs stay float32 (the runner casts them), so gates and
records read the same types on every machine. Why a module of its own: the choice is a pure function of the device,
the CPU's flags and an optional probe, which tests inject; :func:`fastgate.assets.models.load` calls it once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fastgate.errors import UnknownNameError

__all__ = [
    "BF16_FLAGS",
    "DTYPES",
    "DtypeChoice",
    "ProbeResult",
    "canonical_dtype",
    "choose_dtype",
    "cpu_flags",
    "expected_dtype",
    "native_bf16_flags",
    "probe_bf16",
]

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of a native bf16 product
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what --dtype accepts besides auto
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


@dataclass(frozen=True)
class ProbeResult:
    """Seconds of one linear product at the model's shapes in each dtype (the least of interleaved rounds)."""

    float32_s: float  # x [rows, d_in] float32 @ W [d_in, d_out] float32
    bfloat16_s: float  # the same product in bf16

    @property
    def speedup(self) -> float:
        """How many times faster bf16 ran (above 1: faster)."""
        return self.float32_s / self.bfloat16_s if self.bfloat16_s > 0 else float("inf")


@dataclass(frozen=True)
class DtypeChoice:
    """The weights' dtype and why it was chosen (``/healthz`` and the bench rows report both)."""

    dtype: torch.dtype  # what the weights are loaded in
    reason: str  # "asked", "cuda", or the CPU flags and probe that decided
    probe: ProbeResult | None = None  # the timed product, when one ran

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cpu_flags(path: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (the first processor's ``flags`` line); empty where there is no such file."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16_flags(flags: Iterable[str]) -> tuple[str, ...]:
    """The flags of ``flags`` that name a native bf16 product, in :data:`BF16_FLAGS` order (empty: none)."""
    have = set(flags)
    return tuple(f for f in BF16_FLAGS if f in have)


def _best_times(fns: Sequence[Callable[[], object]], repeat: int) -> list[float]:
    """The least time of each of ``fns`` over ``repeat`` rounds, the functions run in turn within a round: another
    process's load slows a round of both alike, and the least time is what the machine does when it is not slowed.
    A median of one function's runs, then the other's, flipped ``auto`` to float32 on a busy 2-core machine (4 of 150
    probes below 1.2x where an idle one reads 2.2x), and a resumed evaluation then refused its own records."""
    for fn in fns:
        fn()  # warm-up: the first call picks and packs the kernel
    best = [math.inf] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def probe_bf16(rows: int, d_in: int, d_out: int, repeat: int = 9) -> ProbeResult:
    """Time ``[rows, d_in] @ [d_in, d_out]`` in float32 and in bf16 on the CPU (a few milliseconds at a model's
    shapes: SmolLM2-135M's MLP is 64 × 576 → 1536), each the least of ``repeat`` interleaved rounds."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((rows, d_in), generator=gen)  # [rows, d_in]
    w = torch.randn((d_out, d_in), generator=gen)  # [d_out, d_in], as nn.Linear keeps it
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    with torch.inference_mode():
        f32, b16 = _best_times([lambda: torch.nn.functional.linear(x, w), lambda: torch.nn.functional.linear(xb, wb)],
                               repeat)
    return ProbeResult(f32, b16)


def canonical_dtype(dtype: str) -> str:
    """``dtype``'s canonical name (``auto``, ``float32``, ``bfloat16``; ``bf16``, ``fp32`` and ``float16`` are
    accepted too); an unknown name raises :class:`~fastgate.errors.UnknownNameError`."""
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPES and name not in ("auto", "float16"):
        raise UnknownNameError("dtype", dtype, ["auto", *DTYPES, "float16"])
    return name


def expected_dtype(dtype: str, device: torch.device | str) -> str | None:
    """The dtype name :func:`choose_dtype` gives without a probe, or None where only the probe at load can say (auto
    on a CPU whose flags name a native bf16 product). Lets a resumed run check its records without loading."""
    if canonical_dtype(dtype) != "auto":
        return canonical_dtype(dtype)
    if torch.device(device).type == "cuda":
        return "bfloat16"
    return None if native_bf16_flags(cpu_flags()) else "float32"


def choose_dtype(dtype: str, device: torch.device | str, *, flags: Iterable[str] | None = None,
                 probe: Callable[[], ProbeResult] | None = None, min_speedup: float = 1.2) -> DtypeChoice:
    """The weights' dtype for ``dtype`` (``auto``, ``float32``, ``bfloat16``) on ``device``.

    Args:
        flags: the CPU's flags (None: this machine's, :func:`cpu_flags`).
        probe: on a CPU with native bf16 flags, a timed product at the model's shapes (:func:`probe_bf16`); bf16 is
            kept only if it runs ``min_speedup`` times faster than float32. None: the flags decide alone.
    """
    name = canonical_dtype(dtype)
    if name != "auto":
        return DtypeChoice(DTYPES.get(name, torch.float16), "asked")
    if torch.device(device).type == "cuda":
        return DtypeChoice(torch.bfloat16, "cuda")
    native = native_bf16_flags(cpu_flags() if flags is None else flags)
    if not native:
        return DtypeChoice(torch.float32, f"cpu without native bf16 (no {' or '.join(BF16_FLAGS)} flag)")
    if probe is None:
        return DtypeChoice(torch.bfloat16, f"cpu flags {' '.join(native)}")
    result = probe()
    verdict = "kept" if result.speedup >= min_speedup else f"below {min_speedup:g}x: float32"
    reason = f"cpu flags {' '.join(native)}; probe bf16 {result.speedup:.2f}x float32 ({verdict})"
    return DtypeChoice(torch.bfloat16 if result.speedup >= min_speedup else torch.float32, reason, result)
