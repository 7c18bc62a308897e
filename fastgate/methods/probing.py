"""Probing-RAG (Baek et al., 2025): probers on the hidden states of the generated rationale decide, after each
chain-of-thought answer, whether to retrieve and answer again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastgate.config import GenerationConfig
from fastgate.errors import InputError
from fastgate.gates.prober import ProberGate
from fastgate.methods.base import Method, MethodConfig, MethodResult, _Timer, _Trace
from fastgate.probes import load_probe_checkpoint, resolve_checkpoint
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
        self.gate = ProberGate(ckpt.params.to(engine.device), ckpt.layers, self.config.theta, engine.gate_ops)

    def _query(self, question: str, rationale: str, passages: list[Hit]) -> str:
        # R(q, r, â) first; later rounds R(q, {d}, r, â) (eq. 6)
        return " ".join([question, *(h.text for h in passages), rationale.strip()])

    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        questions = self.validate(questions)
        c = self.config
        gen_cfg = GenerationConfig(max_new_tokens=c.max_rationale_tokens, stop=("\n",))
        timer = _Timer()
        traces = [_Trace() for _ in questions]
        text = [""] * len(questions)
        docs: list[list[Hit]] = [[] for _ in questions]
        with timer.span("total_s"):
            todo = list(range(len(questions)))  # questions whose latest answer must be (re)generated
            for round_ in range(c.max_iterations + 1):
                probe = round_ < c.max_iterations  # the answer after the last allowed retrieval is final
                prompts = [cot_prompt(questions[i], [h.passage for h in docs[i]], c.passage_words) for i in todo]
                with timer.span("generation_s"):
                    batch = self.engine.generate(prompts, gen_cfg, taps=self.gate.taps if probe else None)
                for i, s in zip(todo, batch.sequences):
                    traces[i].generation(s)
                    text[i] = s.text
                if not probe:
                    break
                with timer.span("gate_s"):
                    decision = self.gate.decide(batch)
                for j, i in enumerate(todo):
                    traces[i].gate_steps.append(decision.step(j))
                todo = [i for j, i in enumerate(todo) if decision.retrieve[j]]
                if not todo:
                    break
                hits = self.retrieve([self._query(questions[i], text[i], docs[i]) for i in todo], timer)
                for i, hs in zip(todo, hits):
                    traces[i].retrieval(hs, keep=False)
                    docs[i] = hs
        for t, d in zip(traces, docs):
            t.use(d)  # the passages of the final answer's prompt
        return [t.result(q, extract_answer(x), self.name, timer.spans) for q, t, x in zip(questions, traces, text)]
