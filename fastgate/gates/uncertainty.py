"""DTR's uncertainty-guided trigger (UGT): the normalised NLL of the greedy short answer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastgate.config import TapSpec
from fastgate.engine.generation import Generation, GenerationBatch
from fastgate.gates.base import Gate, GateStep
from fastgate.ops.reference import answer_nll

__all__ = ["AnswerNLLGate", "answer_logprob_matrix"]


def answer_logprob_matrix(batch: GenerationBatch | Sequence[Generation]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each sequence's answer-token log-probs into ``([N, T], mask [N, T])``.

    Only the tokens that make up the answer text count: the final EOS (as in DTR) and stop-string tokens are masked.
    """
    seqs = batch.sequences if isinstance(batch, GenerationBatch) else list(batch)
    n = len(seqs)
    width = max(1, max(len(s.token_logprobs) for s in seqs))
    lp = torch.zeros((n, width), dtype=torch.float32)  # [N, T]
    mask = torch.zeros((n, width), dtype=torch.bool)  # [N, T]
    for i, s in enumerate(seqs):
        if s.token_logprobs:
            lp[i, : len(s.token_logprobs)] = torch.tensor(s.token_logprobs, dtype=torch.float32)
        mask[i, : s.answer_tokens] = True
    return lp, mask


class AnswerNLLGate(Gate):
    """Retrieve iff ``u = mean(-log p(answer tokens)) >= tau`` (DTR §4.1; an empty answer always retrieves).

    The signal is the greedy answer's :class:`~fastgate.engine.local.Generation`.

    Args:
        tau: uncertainty threshold. DTR's paper uses 0.001 with 7B+ models; small models need larger values
            (SmolLM2-135M: known facts score ≈0.1–0.2, unknown ones ≈0.7+).
    """

    name = "answer_nll"
    taps = TapSpec()  # token log-probs are always recorded; no hidden-state taps
    batch_key = "answer_nll"  # one NLL pass serves every DTR program, whatever its tau

    def __init__(self, tau: float = 0.001) -> None:
        self.tau = float(tau)

    def scores(self, signals: Sequence[Generation]) -> torch.Tensor:
        lp, mask = answer_logprob_matrix(signals)
        return answer_nll(lp, mask)  # [N]

    def step(self, score: float, signal=None) -> GateStep:
        return GateStep(self.name, float(score), self.tau, bool(score >= self.tau))
