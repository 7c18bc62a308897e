"""Plain completions with token log-probabilities: what ``fastgate serve`` answers for its LM's own name on
``/v1/completions`` (so that one fastgate can be the black-box model of another, see :mod:`fastgate.engine.remote`).
This module holds the program the scheduler runs and its result; :mod:`fastgate.entrypoints.http.logprobs` writes the
result in OpenAI's formats.

The chosen tokens' log-probabilities are the decode loop's own (float32, temperature 1, exactly what the local gates
read). ``top_logprobs`` (at most :data:`MAX_TOP_LOGPROBS`) need the whole distribution at each step, which the loop
does not keep: for a greedy completion asking for one, the chosen token *is* the top one (exact, free); otherwise one
extra forward over prompt + completion computes them (float32 logits; they may differ from the loop's in the last
digits, as any two passes of different shapes do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgate.config import GenerationConfig
from fastgate.engine.generation import Generation
from fastgate.programs import Batched, Generate, Program

__all__ = ["MAX_TOP_LOGPROBS", "Completion", "TopLogprobs", "completion_program"]

MAX_TOP_LOGPROBS = 5  # OpenAI's own limit for completions; each extra one costs nothing once the logits are there


@dataclass
class Completion:
    """A plain completion: the generation, each token's bytes, and the top alternatives at each step if asked."""

    generation: Generation
    pieces: list[bytes]  # one per generation.token_ids entry
    top: list[list[tuple[bytes, float]]] | None = None  # per token: (bytes, log-prob), best first


class TopLogprobs:
    """``fn`` of a :class:`~fastgate.programs.Batched` request: the top-n log-probabilities after each generated
    token's prefix, from one forward per completion (one callable per engine, so the scheduler groups the requests)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    @torch.inference_mode()
    def __call__(self, items: list[tuple[str, GenerationConfig, list[int], int]]
                 ) -> list[list[list[tuple[int, float]]]]:
        out = []
        eng = self.engine
        for prompt, cfg, tokens, n in items:
            (row,), _ = eng.encode([prompt], cfg.max_new_tokens)
            ids = torch.tensor([row + tokens[:-1]], dtype=torch.long, device=eng.device)  # [1, P + T - 1]
            logits = eng.model(input_ids=ids).logits[0, len(row) - 1:].float()  # [T, V]
            lp = torch.log_softmax(logits, dim=-1)
            vals, idx = lp.topk(min(n, lp.shape[-1]), dim=-1)  # [T, n]
            out.append([list(zip(i.tolist(), v.tolist())) for i, v in zip(idx, vals)])
        return out


def completion_program(engine, prompt: str, config: GenerationConfig, seed: int | None, top_n: int,
                       top: TopLogprobs | None) -> Program:
    """One generation of ``prompt`` and, when ``top_n`` > 0, the top-n alternatives at each of its tokens."""
    seq = (yield Generate(prompt, config, seed=seed)).sequences[0]
    pieces = engine.token_pieces(seq.token_ids)
    alternatives = None
    if top_n > 0 and seq.token_ids:
        if not config.do_sample and top_n == 1:  # greedy: the chosen token is the most likely one
            alternatives = [[(p, lp)] for p, lp in zip(pieces, seq.token_logprobs)]
        else:
            ranked = yield Batched(top, (prompt, config, list(seq.token_ids), top_n), phase="generation_s")
            alternatives = []
            for chosen, own, step in zip(seq.token_ids, seq.token_logprobs, ranked):
                # the chosen token's value is the loop's own, as in token_logprobs: the extra forward's differs by
                # the products' rounding (a few hundredths of a nat in bf16), and clients match the two
                step = sorted(((i, own if i == chosen else lp) for i, lp in step), key=lambda t: -t[1])
                alternatives.append([(engine.token_pieces([i])[0], lp) for i, lp in step])
    return Completion(seq, pieces, alternatives)
