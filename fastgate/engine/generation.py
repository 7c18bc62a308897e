"""What a generation returns and the states its rows pass through: the types the engine, its decode loops and the
gates share.

Why a module of its own: the loops (:mod:`fastgate.engine.decode`, :mod:`fastgate.engine.packed`) build these results
and the gates read them; with the types inside :mod:`fastgate.engine.local`, the loops imported the engine module that
imports them (an import cycle) and every gate depended on the engine. This module depends on torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal

import torch

from fastgate.errors import InputError

__all__ = ["FinishReason", "Generation", "GenerationBatch", "RowState", "check_prompts"]

FinishReason = Literal["eos", "stop", "length"]


def check_prompts(prompts) -> None:
    """What every engine's ``generate`` takes as its prompts: a non-empty list of strings (the local and the remote
    engine refuse the same inputs the same way).

    Raises:
        InputError: a string (a sequence: it ran as one prompt per character), nothing, or a prompt not a string."""
    if isinstance(prompts, str):
        raise InputError("generate takes a list of prompts, not a string: generate([prompt])")
    if not prompts:
        raise InputError("generate: no prompts")
    odd = [p for p in prompts if not isinstance(p, str)]
    if odd:
        raise InputError(f"generate: prompts must be strings, got {type(odd[0]).__name__} {odd[0]!r:.60}")


class RowState(IntEnum):
    """Where one decoding sequence stands."""

    ACTIVE = 0  # choosing tokens
    FLUSH_LAST = 1  # stopped: its last token is fed once more so the taps read its states
    FLUSH_EOS = 2  # a forced EOS is fed so the taps read the EOS state
    DONE = 3  # nothing left to feed


@dataclass
class Generation:
    """One generated sequence."""

    text: str  # decoded continuation, cut before the first stop string
    token_ids: list[int]  # every generated token, including EOS / stop-string tokens
    token_logprobs: list[float]  # log p(token) under the model (temperature 1), one per token_ids entry
    answer_tokens: int  # how many leading tokens make up `text` (excludes EOS and stop-string tokens)
    finish_reason: FinishReason
    prompt_tokens: int
    truncated: bool  # the prompt was cut on the left to fit the context
    stop_string: str | None = None  # the stop string that ended the sequence (finish_reason "stop")
    # per token_ids entry, its config's top_logprobs most likely tokens and their log-probs (temperature 1), best
    # first; None where the config asked none
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class GenerationBatch:
    """The result of :meth:`Engine.generate <fastgate.engine.local.Engine.generate>` for B prompts × k samples
    (prompt-major order). Every tensor is float32, whatever the model's weights are."""

    sequences: list[Generation]
    running_sum: torch.Tensor | None = None  # [N, L, d] float32, sum of generated-token states per tapped layer
    count: torch.Tensor | None = None  # [N] float32, tokens in the running sums
    pre_answer: torch.Tensor | None = None  # [N, d] float32
    eos_state: torch.Tensor | None = None  # [N, d] float32
    layers: tuple[int, ...] = ()  # the tapped layers of running_sum, in order
    steps: int = 0  # tokens chosen per sequence at most (decode iterations)
    forwards: int = 0  # decode forward passes: one per fed token, plus the flushes that read the last token's states
    timings: dict[str, float] = field(default_factory=dict)  # prefill_s, decode_s, total_s, taps_s

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)
