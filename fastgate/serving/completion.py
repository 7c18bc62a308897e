"""Plain completions with token log-probabilities: what ``fastgate serve`` answers for its LM's own name on
``/v1/completions`` (so that one fastgate can be the black-box model of another, see :mod:`fastgate.engine.remote`).
This module holds the program the scheduler runs and its result; :mod:`fastgate.entrypoints.http.logprobs` writes the
result in OpenAI's formats.

The chosen tokens' log-probabilities are the decode loop's own (float32, temperature 1, exactly what the local gates
read). ``top_logprobs`` (at most :data:`MAX_TOP_LOGPROBS`) come from the same loop, from the logits each token was
chosen from (:attr:`fastgate.config.GenerationConfig.top_logprobs`); for a greedy completion asking for one, the
chosen token *is* the top one. Why in the loop: a second forward over prompt + completion, which this ran before,
took seconds of the scheduler's thread for a long prompt, outside the prefill budget, and stalled every other request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastgate.config import GenerationConfig
from fastgate.engine.generation import Generation
from fastgate.programs import Generate, Program

__all__ = ["MAX_TOP_LOGPROBS", "Completion", "completion_program"]

MAX_TOP_LOGPROBS = 5  # OpenAI's own limit for completions; each extra one costs nothing once the logits are there


@dataclass
class Completion:
    """A plain completion: the generation, each token's bytes, and the top alternatives at each step if asked."""

    generation: Generation
    pieces: list[bytes]  # one per generation.token_ids entry
    top: list[list[tuple[bytes, float]]] | None = None  # per token: (bytes, log-prob), best first


def completion_program(engine, prompt: str, config: GenerationConfig, seed: int | None, top_n: int) -> Program:
    """One generation of ``prompt`` and, when ``top_n`` > 0, the top-n alternatives at each of its tokens (the
    decode loop's, :attr:`~fastgate.config.GenerationConfig.top_logprobs`)."""
    greedy_one = not config.do_sample and top_n == 1  # greedy: the chosen token is the most likely one
    if top_n > 0 and not greedy_one:
        config = dataclasses.replace(config, top_logprobs=top_n)
    seq = (yield Generate(prompt, config, seed=seed)).sequences[0]
    pieces = engine.token_pieces(seq.token_ids)
    alternatives = None
    if top_n > 0 and seq.token_ids:
        if greedy_one:
            alternatives = [[(p, lp)] for p, lp in zip(pieces, seq.token_logprobs)]
        else:
            if seq.top_logprobs is None or len(seq.top_logprobs) != len(seq.token_ids):
                raise RuntimeError("the engine returned no top log-probs for a completion that asked for them")
            alternatives = [[(engine.token_pieces([i])[0], lp) for i, lp in step] for step in seq.top_logprobs]
    return Completion(seq, pieces, alternatives)
