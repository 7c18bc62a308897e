"""The read gate over any gated method: search first, then decide whether to read the passages.

fastgate's own extension beyond the papers (docs/DEVIATIONS.md, "The read gate"). The wrapped (``base``) method runs
up to its first gate decision, which gives its own signal (DTR: the closed-book answer's NLL; CBDR: its confidence;
Probing-RAG: the prober score, ...); its decision is not followed. The closed-book answer is the base's own first
generation where it is one (DTR), else one greedy closed-book generation. Then the question is searched (BM25 and
dense, together: a fraction of a millisecond and a few milliseconds), :func:`~fastgate.gates.read.read_features`
combines all of it, and the :class:`~fastgate.gates.read.ReadGate` decides whether to read the top-k passages of the
reading retriever (the method's retriever, BM25 by default) into a prompt, or to keep the closed-book answer.

``decide="prefill"`` decides before anything is generated (:meth:`Read.program_prefill`): one prefill of the
closed-book prompt stopped at the gate's layer gives the pre-answer hidden state, the two searches run beside it, and
the gate reads the state (projected) and the search scores. A skip then generates the closed-book answer, its few-shot
block's KV cached once per engine (:class:`~fastgate.methods.base.Method` registers it), so only the question's own
tokens are prefilled again; a read goes straight to the reading prompt and never generates closed-book. No base
method runs.

A question's record counts its searches (``retrieval_calls``) apart from its read (``retrieved``): the rate this gate
is judged by is the share of questions that read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fastgate.errors import InputError
from fastgate.gates.read import (
    DECIDE_MODES,
    FEATURE_SETS,
    ReadGate,
    check_read_checkpoint,
    load_prefill_checkpoint,
    open_read_checkpoint,
    prefill_features,
    read_features,
)
from fastgate.methods.base import GateThreshold, Method, MethodConfig, method_class
from fastgate.programs import All, Answer, Decide, Generate, Program, PromptStates, Score, Search
from fastgate.prompts import closed_book_prompt

__all__ = ["Read", "ReadConfig"]

# the methods whose first gate decision can be wrapped (never / always decide nothing)
BASES = ("dtr", "cbdr", "probing", "flare", "scaar", "seakr")


@dataclass(frozen=True)
class ReadConfig(MethodConfig):
    """Read-gate parameters."""

    decide: str = "answer"  # answer: after the closed-book answer (base's signal); prefill: from its prompt's prefill
    base: str = "dtr"  # the gated method whose first signal the read gate sees (DTR: the best of the papers' here)
    features: str = "all"  # "all" (BM25 + dense + model) or "dense" (dense + model: blind to the BM25-defined split)
    threshold: float = 0.0  # read iff the gate's score >= threshold: the price of a read in accuracy (calibrated)
    checkpoint: str = ""  # read-gate checkpoint directory (`fastgate train read`); default: shipped for the model
    collect: bool = False  # training pass: read every question and record its features; needs no checkpoint

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base not in BASES:
            raise InputError(f"read: base must be one of {', '.join(BASES)}, got {self.base!r}")
        if self.features not in FEATURE_SETS:
            raise InputError(f"read: features must be one of {', '.join(FEATURE_SETS)}, got {self.features!r}")
        if math.isnan(self.threshold):
            raise InputError("read: threshold must be a number, got nan")
        if self.decide not in DECIDE_MODES:
            raise InputError(f"read: decide must be one of {', '.join(DECIDE_MODES)}, got {self.decide!r}")
        if self.collect and self.decide == "prefill":
            raise InputError("read: collect=true is the training pass of both modes (it records what both need); "
                             "leave decide=answer: `fastgate train read --decide prefill` runs it")


def _base_config(cls: type[Method], params: dict[str, Any]) -> MethodConfig:
    """The base method's config from its calibrated parameters: typed JSON values written by ``fastgate calibrate``
    (or shipped), checked by name as :func:`fastgate.methods.make_config` checks a request's."""
    defaults = cls.parameters()
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise InputError(f"unknown parameter(s) for {cls.name}: {', '.join(unknown)}; "
                         f"valid: {', '.join(sorted(defaults))}")
    # an integral JSON number in a float field is that float, as make_config reads it
    return cls.config_class(**{k: float(v) if isinstance(defaults[k], float) and type(v) is int else v
                               for k, v in params.items()})


_WARNED: set[tuple[str, int]] = set()


def _warn_if_off_training(path, trained: int | None, config: ReadConfig) -> None:
    """Say once when the gate searches with another k than its checkpoint was trained with (``trained``; None:
    not recorded, the default then): the search features (drop, cover, agreement) then mean something else and the
    price no longer what it did (k=10 moved a SmolLM2 question's score 0.100 -> 0.168 against a price of 0.037)."""
    import logging

    trained = MethodConfig.k if trained is None else trained
    if config.k != trained and (str(path), config.k) not in _WARNED:
        _WARNED.add((str(path), config.k))
        logging.getLogger("fastgate.read").warning(
            "fastgate: warning: the read gate %s was trained on searches of k=%d passages; k=%d changes its search "
            "features and what its price means", path, trained, config.k)


class Read(Method):
    """Run the base method to its first gate score, search, and read the passages iff the read gate says so."""

    name = "read"
    config_class = ReadConfig
    description = ("read gate (fastgate's extension): search first, then a learned gate on the base method's signal "
                   "and the search's scores decides whether to read the passages")
    uses_retrievers: ClassVar[tuple[str, ...]] = ("bm25", "dense")
    threshold = GateThreshold("threshold", skip=1e9, retrieve_above=True)
    paper_threshold = False  # fastgate's own gate: its price is its checkpoint's, under --paper-defaults too

    @classmethod
    def preflight(cls, config: ReadConfig, model_name: str | None = None):
        """The checkpoint to load (none for a training pass), its header checked for this request before the model
        loads (a feature set it lacks was found after ~11 s of loading, and after calibrate made its run directory).

        Raises:
            CheckpointError: no checkpoint for the model, or one made for another model, mode or base, or without
                the feature set."""
        path = cls.checkpoint_path(config, model_name)
        cls.check_checkpoint(config, path, model_name)
        return path

    @classmethod
    def check_checkpoint(cls, config: ReadConfig, path, model_name: str | None = None) -> None:
        """The header of the checkpoint at ``path`` (:meth:`checkpoint_path`) checked for ``config`` and the model
        named ``model_name`` as given (a directory's path too) without reading its models; nothing for a training pass
        or a directory without a ``config.json`` (its load says what is wrong).

        Raises:
            CheckpointError: made for another model, mode or base, or without the feature set."""
        if path is not None and (Path(path) / "config.json").is_file():
            from fastgate.assets.models import loaded_name

            # the name the model loads as (a directory's last part: the CLI passes --model as typed, a path)
            check_read_checkpoint(path, config.features, model_name=loaded_name(model_name) if model_name else None,
                                  base=config.base if config.decide == "answer" else None, decide=config.decide)

    @classmethod
    def checkpoint_path(cls, config: ReadConfig, model_name: str | None = None):
        """The checkpoint ``config`` asks for, resolved (none for a training pass), not checked."""
        if config.collect:
            return None
        from fastgate.gates.checkpoints import default_checkpoint, resolve_checkpoint

        if config.decide == "prefill":
            return resolve_checkpoint(config.checkpoint, model_name, "read-prefill", cls.name,  # type: ignore[arg-type]
                                      "fastgate train read --decide prefill")
        kind = f"read-{config.base}"
        if config.features == "dense" and not config.checkpoint and default_checkpoint(model_name, f"{kind}-dense"):
            kind += "-dense"  # the dense-only gate ships apart: trained on its own pass, which reads dense passages
        return resolve_checkpoint(config.checkpoint, model_name, kind, cls.name,  # type: ignore[arg-type]
                                  f"fastgate train read --base {config.base}")

    @classmethod
    def inert_parameters(cls, config: ReadConfig) -> frozenset[str]:  # type: ignore[override]
        """A training pass (``collect``) reads every question: its gate's threshold and checkpoint are never used."""
        return frozenset({"threshold", "checkpoint"}) if config.collect else frozenset()

    def __init__(self, engine, retriever, config: ReadConfig | None = None,
                 retrievers: dict[str, Any] | None = None) -> None:
        super().__init__(engine, retriever, config)
        from fastgate.methods.calibration import calibrated_params
        from fastgate.retrieval import open_retriever

        c = self.config
        self.retrievers = dict(retrievers or {})
        for kind in self.uses_retrievers:  # opened here when constructed outside a Runtime
            if kind not in self.retrievers:
                self.retrievers[kind] = retriever if getattr(retriever, "name", None) == kind else open_retriever(kind)
        self._searches = self.searched(c)
        self.gate = None
        if c.decide == "prefill":  # no base method: the gate reads the prompt's pre-answer state
            # (its header is checked by the load, against the model itself)
            model, self.projection = load_prefill_checkpoint(self.checkpoint_path(c, engine.lm.name), c.features,
                                                             model=engine.lm)
            self.gate = ReadGate(model, c.threshold)
            return
        base_cls = method_class(c.base)  # one of BASES (ReadConfig checks); through the interface, not the table
        # the base runs to its first score only (its decision is not followed): its threshold does not matter here
        base_config = _base_config(base_cls, calibrated_params(engine.lm.name, c.base, {}, warn=False))
        base_retriever = self.retrievers.get(base_cls.default_retriever, retriever)
        self.base = base_cls(engine, base_retriever, base_config)
        if not c.collect:
            path = self.checkpoint_path(c, engine.lm.name)
            ck = open_read_checkpoint(path, c.features, model=engine.lm, base=c.base)  # its header checked there
            self.gate = ReadGate(ck.model, c.threshold)
            _warn_if_off_training(path, ck.k, c)

    @staticmethod
    def searched(config: ReadConfig) -> list[str]:
        """The retrievers searched before the gate decides: both for the full features (and to collect them), the
        dense one alone for the dense features."""
        c = config
        return [kind for kind in ("bm25", "dense") if c.collect or c.features == "all" or kind == "dense"]

    @classmethod
    def reads_from(cls, config: ReadConfig, retriever: str) -> str:
        """The run's retriever where it was searched, else the first searched (the dense features: dense)."""
        searched = cls.searched(config)
        return retriever if retriever in searched else searched[0]

    @classmethod
    def calibration_condition(cls, config: ReadConfig) -> dict[str, Any]:
        return {"base": config.base, "features": config.features}

    def _base_signal(self, question: str) -> Program:
        """Drive the base program up to its first gate decision: (its score, its closed-book answer or None)."""
        prog = self.base.program(question)
        closed, prompt, cfg = None, closed_book_prompt(question), self.answer_config()
        try:
            req = next(prog)
            while not isinstance(req, Decide):
                out = yield req
                if (closed is None and isinstance(req, Generate) and req.prompt == prompt and req.k == 1
                        and req.config == cfg):
                    closed = out.sequences[0]
                req = prog.send(out)
        except StopIteration:  # the base answered without a gate decision
            return math.nan, closed
        finally:
            prog.close()
        score = yield Score(req.gate, req.signal)
        return float(req.gate.step(score, req.signal).score), closed

    def program(self, question: str) -> Program:
        if self.config.decide == "prefill":
            return (yield from self.program_prefill(question))
        return (yield from self.program_answer(question))

    def program_prefill(self, question: str) -> Program:
        """Decide from the closed-book prompt's prefill and the searches, before anything is generated."""
        c = self.config
        # one prefill of the closed-book prompt, stopped at the gate's layer, beside the searches (one tick)
        state, *found = yield All(PromptStates((closed_book_prompt(question),), self.projection.layer),
                                  *(Search(self.retrievers[kind], (question,), c.k) for kind in self._searches))
        hits = {kind: h[0] for kind, h in zip(self._searches, found)}
        feats = prefill_features(question, state[0], self.projection, hits.get("bm25"), hits.get("dense"))
        details = {"decide": "prefill", "features": feats}
        step = yield Decide(self.gate, feats)
        if step.share is not None:  # a shift-gain gate's answerable-share estimate after this decision's batch
            details["answerable_share"] = round(step.share, 4)
        if not step.retrieve:  # the closed-book answer, its few-shot block's KV cached: the question's tokens only
            closed = (yield self.closed_book(question, answer=True)).sequences[0]
            return Answer(closed.text.strip(), details={**details, "closed_book_answer": closed.text.strip()})
        reading = hits[self.reads_from(c, getattr(self.retriever, "name", "bm25"))] or hits[self._searches[0]]
        reading = self.fit_passages(question, reading)
        answer = (yield self.with_passages(question, reading, answer=True)).sequences[0]
        return Answer(answer.text.strip(), reading, details={**details, "read": True})

    def program_answer(self, question: str) -> Program:
        """Decide after the closed-book answer, from the base's signal, the answer and the searches."""
        c = self.config
        base_score, closed = yield from self._base_signal(question)
        if closed is None:
            closed = (yield self.closed_book(question)).sequences[0]
        found = yield All(*(Search(self.retrievers[kind], (question,), c.k) for kind in self._searches))
        hits = {kind: h[0] for kind, h in zip(self._searches, found)}
        feats = read_features(question, closed, base_score, hits.get("bm25"), hits.get("dense"))
        details = {"base": c.base, "base_score": base_score if math.isfinite(base_score) else None,
                   "closed_book_answer": closed.text.strip(), "features": feats}
        if self.gate is not None:
            step = yield Decide(self.gate, feats)
            if step.share is not None:  # a shift-gain gate: its answerable-share estimate after this decision's
                details["answerable_share"] = round(step.share, 4)  # batch of scores (not gate.share: moved since)
            if not step.retrieve:
                return Answer(closed.text.strip(), details=details, generation=closed)
        reading = hits[self.reads_from(c, getattr(self.retriever, "name", "bm25"))] or hits[self._searches[0]]
        reading = self.fit_passages(question, reading)
        answer = (yield self.with_passages(question, reading, answer=True)).sequences[0]
        return Answer(answer.text.strip(), reading, details={**details, "read": True})

    def result(self, question: str, answer: str, trace, timings: dict[str, float]):
        res = super().result(question, answer, trace, timings)
        res.retrieved = bool(trace.passages)  # read passages (every question searched)
        return res
