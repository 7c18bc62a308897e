"""Typed configuration shared by the engine, retrievers and methods."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastgate.errors import InputError

__all__ = ["TOP_LOGPROBS_LIMIT", "SAMPLING_EPS", "GenerationConfig", "TapSpec", "as_integer", "check_tap_layers"]


SAMPLING_EPS = 1e-5  # temperatures below this decode greedily (vLLM's rule)
TOP_LOGPROBS_LIMIT = 20  # GenerationConfig.top_logprobs at most (OpenAI's chat API's own limit)


@dataclass(frozen=True)
class GenerationConfig:
    """How one call of :meth:`fastgate.engine.local.Engine.generate` decodes."""

    max_new_tokens: int = 32  # short answers; methods raise it for rationales
    do_sample: bool = False  # greedy by default: reproducible answers and gate scores
    temperature: float = 1.0  # SeaKR samples at T=1.0
    top_k: int = 0  # 0 disables; SeaKR uses 50
    top_p: float = 1.0  # 1.0 disables; SeaKR uses 0.9
    seed: int | None = None  # sampling seed; None draws from torch's global generator
    stop: tuple[str, ...] = ()  # stop strings; the returned text ends before the first match
    stop_at_eos: bool = True  # EOS ends a sequence (turn off to force max_new_tokens)
    top_logprobs: int = 0  # the n most likely tokens at each step with their log-probs (OpenAI's logprobs); 0: none

    def __post_init__(self) -> None:
        # typed first: a string stop would stop at each of its characters, a float length slice nothing, a NaN
        # temperature fail inside the sampler
        for name in ("max_new_tokens", "top_k", "top_logprobs"):
            object.__setattr__(self, name, as_integer(name, getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", as_integer("seed", self.seed))
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise InputError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("do_sample", "stop_at_eos"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False, got {getattr(self, name)!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # one stop string, not its characters
        if not isinstance(stop, (tuple, list)) or not all(isinstance(x, str) for x in stop):
            raise InputError(f"stop must be a tuple of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise InputError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.do_sample and self.temperature < SAMPLING_EPS:
            # greedy, as vLLM treats such temperatures: the logits divided by 1e-45 overflowed to inf and the sampler's
            # error failed every request decoding beside this one
            object.__setattr__(self, "do_sample", False)
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.top_logprobs <= TOP_LOGPROBS_LIMIT:
            raise InputError(f"top_logprobs must be between 0 and {TOP_LOGPROBS_LIMIT}, got {self.top_logprobs}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InputError("stop strings must be non-empty")


@dataclass(frozen=True)
class TapSpec:
    """Which internal signals a gate needs captured during decoding; nothing else is recorded.

    Layer index ``l`` means HF ``hidden_states[l]``: 0 = embeddings, ``n_layers`` = the final (normed) output.
    """

    layers: tuple[int, ...] = ()  # running sums of generated-token states at these layers (Probing-RAG)
    pre_answer: bool = False  # mid-layer state of the last prompt token (CBDR), free from prefill
    eos_state: bool = False  # mid-layer state at a forced EOS after each sequence stops (SeaKR)
    mid_layer: int | None = None  # layer for pre_answer/eos_state; None = n_layers // 2

    def __post_init__(self) -> None:
        # TapSpec(layers="12") or (1.5,) reached the engine as a bare TypeError, pre_answer="no" captured the state
        if isinstance(self.layers, (str, bytes)) or not hasattr(self.layers, "__iter__"):
            raise InputError(f"layers must be a sequence of layer indices, got {self.layers!r:.60}")
        layers = tuple(as_integer("a tap layer", v) for v in self.layers)
        if any(v < 0 for v in layers):
            raise InputError(f"tap layers must be >= 0, got {layers}")
        object.__setattr__(self, "layers", layers)
        for name in ("pre_answer", "eos_state"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False, got {getattr(self, name)!r:.60}")
        if self.mid_layer is not None and as_integer("mid_layer", self.mid_layer) < 0:
            raise InputError(f"mid_layer must be >= 0, got {self.mid_layer}")

    @property
    def needs_flush(self) -> bool:
        """Whether a finished sequence's last token must still be fed (to record its state)."""
        return bool(self.layers) or self.eos_state


def check_tap_layers(layers: Iterable[int], n_layers: int) -> None:
    """Each of ``layers`` is a hidden state a model of ``n_layers`` layers has: 0 (the embeddings) .. ``n_layers``
    (the final output). One check for the engine's generations and prefills and the scheduler's requests.

    Raises:
        InputError: the first that is not."""
    for layer in layers:
        if not 0 <= layer <= n_layers:
            raise InputError(f"tap layer {layer} out of range 0..{n_layers}")


def as_integer(name: str, value: Any) -> int:
    """``value`` as an int (numpy's integers too); bools, floats and strings are refused (``name`` says which)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise InputError(f"{name} must be an integer, got {value!r:.60}")
    return operator.index(value)
