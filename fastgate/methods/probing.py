"""Probing-RAG (Baek et al., 2025): probers on the hidden states of the generated rationale decide, after each
chain-of-thought answer, whether to retrieve and answer again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastgate.config import GenerationConfig, TapSpec
from fastgate.errors import InputError
from fastgate.gates.checkpoints import load_probe_checkpoint, resolve_checkpoint
from fastgate.gates.prober import ProberGate
from fastgate.methods.base import GateThreshold, Method, MethodConfig
from fastgate.programs import Answer, Decide, Generate, Program, Search
from fastgate.prompts import cot_prompt, extract_answer
from fastgate.retrieval.base import Hit

__all__ = ["Probing", "ProbingConfig", "default_probe_layers"]


def default_probe_layers(n_layers: int) -> tuple[int, ...]:
    """Even layers from one third of the depth up to below the last (Gemma-2B, 18 layers: 6, 8, …, 16)."""
    return tuple(range(((n_layers // 3) + 1) // 2 * 2, n_layers, 2))


@dataclass(frozen=True)
class ProbingConfig(MethodConfig):
    """Probing-RAG parameters."""

    k: int = 5  # Probing-RAG puts five passages in the prompt (Table 7)
    checkpoint: str = ""  # prober checkpoint directory (`fastgate train prober`); required
    theta: float = 0.0  # retrieve iff Σ p(retrieve) + θ > Σ p(no retrieval); the paper's default
    max_iterations: int = 4  # at most four retrieve-and-regenerate rounds (Algorithm 1)
    max_rationale_tokens: int = 96  # a few rationale sentences and "So the answer is X"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_iterations < 1 or self.max_rationale_tokens < 1:
            raise InputError("max_iterations and max_rationale_tokens must be >= 1")


class Probing(Method):
    """Generate a CoT answer while summing the tapped layers' states; probe; retrieve with q+r+â; repeat.

    The probers come from ``config.checkpoint``; it must have been trained for this model.
    """

    name = "probing"
    threshold = GateThreshold("theta", skip=-1e9, retrieve_above=True, negate=True)  # iff score > -theta
    config_class = ProbingConfig
    description = "Probing-RAG: probers on rationale hidden states decide retrieval (Baek et al., 2025)"

    @classmethod
    def preflight(cls, config: ProbingConfig, model_name: str | None = None) -> Path:
        """The checkpoint to load: ``config.checkpoint``, or the one shipped for ``model_name``."""
        return resolve_checkpoint(config.checkpoint, model_name, "probing", cls.name, "fastgate train prober")

    def __init__(self, engine, retriever, config: ProbingConfig | None = None) -> None:
        super().__init__(engine, retriever, config)
        path = self.preflight(self.config, engine.lm.name)
        ckpt = load_probe_checkpoint(path, engine.lm, kind="probing")
        self.checkpoint = ckpt
        self.gate = ProberGate(ckpt.params.to(engine.device), ckpt.layers, self.config.theta, engine.ops)

    def _prompt(self, question: str, passages: list[Hit]) -> str:
        return cot_prompt(question, [h.passage for h in passages], self.config.passage_words)

    def _query(self, question: str, rationale: str, passages: list[Hit]) -> str:
        # R(q, r, â) first; later rounds R(q, {d}, r, â) (eq. 6)
        return " ".join([question, *(h.text for h in passages), rationale.strip()])

    def program(self, question: str) -> Program:
        c = self.config
        gen_cfg = GenerationConfig(max_new_tokens=c.max_rationale_tokens, stop=("\n",))
        docs: list[Hit] = []
        for round_ in range(c.max_iterations + 1):
            probe = round_ < c.max_iterations  # the answer after the last allowed retrieval is final
            prompt = self._prompt(question, docs)
            out = yield Generate(prompt, gen_cfg, self.gate.taps if probe else TapSpec())
            text = out.sequences[0].text
            if not probe:
                break
            step = yield Decide(self.gate, out)  # the probers read the rationale's mean hidden states
            if not step.retrieve:
                break
            (docs,) = yield Search(self.retriever, (self._query(question, text, docs),), c.k)
            docs = self.fit_passages(question, docs, self._prompt, c.max_rationale_tokens)
        return Answer(extract_answer(text), docs)  # the passages of the final answer's prompt
