"""Method interface and typed results shared by every pipeline."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from fastgate.config import GenerationConfig
from fastgate.engine.generation import Generation
from fastgate.engine.protocol import LLMEngine
from fastgate.errors import InputError
from fastgate.gates.base import GateStep
from fastgate.programs import Generate, Program
from fastgate.prompts import ANSWER_STOP, COT_FEW_SHOT, FEW_SHOT_QA, closed_book_prompt, has_answer, rag_prompt
from fastgate.retrieval.base import Hit, Retriever

__all__ = ["GateThreshold", "Method", "MethodConfig", "MethodResult", "append_sentence", "black_box_methods",
           "black_box_refusal", "check_questions", "check_text", "coerce_param", "method_class"]


@dataclass(frozen=True)
class GateThreshold:
    """How a method's first gate decision depends on one parameter: what ``fastgate calibrate`` sets."""

    param: str  # the config field
    skip: float  # a value at which the first gate never retrieves, so that a calibration pass sees every score
    retrieve_above: bool  # True: retrieve iff score >= threshold; False: iff score < threshold (<= for CBDR)
    negate: bool = False  # the parameter is minus the threshold (Probing-RAG: retrieve iff score > -θ)

    def value(self, cut: float) -> float:
        """The parameter value that puts the decision boundary at score ``cut``."""
        return -cut if self.negate else cut


@dataclass(frozen=True)
class MethodConfig:
    """Parameters every method has."""

    k: int = 3  # passages used per retrieval (the papers' k=3)
    max_answer_tokens: int = 16  # short answers end at the first newline long before this
    passage_words: int = 120  # words kept per passage in the prompt; keeps 3 passages within a small model's span

    def __post_init__(self) -> None:
        # every field of every method's config, as make_config types them: a config built directly took tau=nan
        # (a gate that never fired, silently), k="3" (a bare TypeError) or k=2.5 (refused only at the search)
        for f in fields(self):
            value = getattr(self, f.name)
            typed = coerce_param(f.name, value, f.type)
            if typed is not value:
                object.__setattr__(self, f.name, typed)  # "0.5" -> 0.5, 3 -> 3.0 for a float: the same value
        if self.k < 1:
            raise InputError(f"k must be >= 1, got {self.k}")
        if self.max_answer_tokens < 1:
            raise InputError(f"max_answer_tokens must be >= 1, got {self.max_answer_tokens}")
        if self.passage_words < 1:
            raise InputError(f"passage_words must be >= 1, got {self.passage_words}")


@dataclass
class MethodResult:
    """What a method returns for one question."""

    question: str
    answer: str
    retrieved: bool
    passages: list[Hit]
    retrieval_calls: int
    lm_calls: int
    generated_tokens: int
    gate_steps: list[GateStep] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: this question's total and its calls' phases
    truncated: bool = False  # a prompt was cut on the left to fit the context
    method: str = ""
    prompt_tokens: int = 0  # prompt tokens of every LM call (k samples of one prompt count it once)
    finish_reason: str = "stop"  # "length" when the answer's own generation stopped at its token limit
    details: dict[str, Any] = field(default_factory=dict)  # method-specific (the read gate's features), JSON-ready

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "question": self.question,
            "answer": self.answer,
            "retrieved": self.retrieved,
            "passages": [{"id": h.id, "title": h.title, "score": h.score} for h in self.passages],
            "retrieval_calls": self.retrieval_calls,
            "lm_calls": self.lm_calls,
            "generated_tokens": self.generated_tokens,
            "gate_steps": [s.to_dict() for s in self.gate_steps],
            "timings": self.timings,
            "truncated": self.truncated,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            **({"details": self.details} if self.details else {}),
        }


def append_sentence(text: str, seq: Generation) -> tuple[str, bool]:
    """Append one generated rationale sentence (stopped at "." or a newline) to ``text``.

    Returns the new text and whether the rationale is finished: it reached "the answer is", or the line ended (newline,
    EOS, an empty sentence). A sentence cut by the token limit is continued in the next round.
    """
    text += seq.text + ("." if seq.stop_string == "." else "")
    finished = seq.finish_reason != "length" and (seq.stop_string != "." or not seq.text.strip())
    return text, finished or has_answer(seq.text)


def _method_classes() -> list[type[Method]]:
    """Every named :class:`Method` subclass, breadth first (each method module defines its own; importing any
    ``fastgate.methods.*`` module runs the package's ``__init__``, which imports them all)."""
    out, todo = [], list(Method.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls.name and cls not in out:
            out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def coerce_param(name: str, value: Any, annotation: Any) -> Any:
    """A parameter value of the field's type: strings (CLI, query strings) are parsed; other values must already have
    the type (an int is accepted for a float), so a JSON request cannot slip a float into ``k``. One parser for
    :func:`fastgate.methods.make_config` and the calibration's conditions (fastgate.methods.calibration).

    Raises:
        InputError: a value that is not of the field's type and does not parse as it."""
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(getattr(annotation, "__name__", str(annotation)),
                                                                    None)
    if kind is None:
        return value
    if kind is float:  # NaN compares false with every threshold: a gate would silently never (or always) fire
        number = _coerce_plain(name, value, float)
        if math.isnan(number):
            raise InputError(f"parameter {name} must be a number, got {value!r} (inf and -inf are allowed)")
        return number
    return _coerce_plain(name, value, kind)


def _coerce_plain(name: str, value: Any, kind: type) -> Any:
    """:func:`coerce_param` for the field type ``kind``."""
    if not isinstance(value, str):
        # numpy's scalars too (a library user's np.float32 threshold, np.int64 k); never a bool
        if kind is float and isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
            try:
                return float(value)
            except OverflowError:  # an integer beyond any float (a JSON request can send one)
                raise InputError(f"parameter {name} is out of range for a float, got {value!r}") from None
        if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
            return int(value)
        if kind is str and isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        raise InputError(f"parameter {name} expects {kind.__name__}, got {value!r}")
    try:
        if kind is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return kind(value)
    except ValueError:
        raise InputError(f"parameter {name} expects {kind.__name__}, got {value!r}") from None


def method_class(name: str) -> type[Method] | None:
    """The method class called ``name`` (None for an unknown name), found through the :class:`Method` interface, for
    the modules under the methods table that need one (calibration's defaults, the read gate's base method)."""
    return next((cls for cls in _method_classes() if cls.name == name and "name" in vars(cls)), None)  # not a subclass


def black_box_methods() -> list[str]:
    """The methods that run on a remote engine (``black_box``): they read only text and token log-probabilities."""
    names = []
    for cls in _method_classes():
        if cls.black_box and cls.name not in names:
            names.append(cls.name)
    order = ("never", "always", "flare", "scaar", "dtr")
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def black_box_refusal(method: str, engine: str) -> str:
    """The one line a method that reads hidden states answers when asked to run on a remote engine."""
    return (f"method {method} needs the model's hidden states, which the remote engine {engine} does not return; "
            f"on a remote engine use one of: {', '.join(black_box_methods())}")


def check_text(text: str, what: str) -> None:
    """Raise :class:`InputError` when ``text`` is not Unicode text a tokenizer can take: a lone surrogate (JSON's
    ``"\\ud800"``, which no UTF-8 encodes) made the tokenizer raise ``TypeError`` inside a batched call."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"the {what} is not valid Unicode text: a lone surrogate U+{ord(text[exc.start]):04X} at "
                         f"character {exc.start}") from None


def check_questions(engine: LLMEngine, config: MethodConfig, questions: list[str]) -> list[str]:
    """Strip ``questions`` and reject empty ones or ones that cannot fit the model context with the closed-book prompt
    around them and ``config.max_answer_tokens`` (passages may then be truncated). Needs only the tokenizer, so a
    server can check a request on its own thread while the engine decodes on another.

    Raises:
        InputError: not a list of strings, an empty question, one that is not Unicode text (a lone surrogate), one
            too long for the context, or an answer budget that leaves no room for any question.
    """
    if isinstance(questions, str):
        raise InputError("answer_batch takes a list of questions, not a string")
    if not questions:
        raise InputError("no questions given")
    scaffold = engine.count_tokens(closed_book_prompt(""))
    limit = engine.lm.max_context - config.max_answer_tokens - scaffold - 1
    if limit < 1:  # the answer's budget alone fills the context: no question is too long, the budget is too large
        raise InputError(f"max_answer_tokens = {config.max_answer_tokens} (--max-tokens) leaves no room for a question "
                         f"in this model's context ({engine.lm.max_context} tokens)")
    out = []
    for q in questions:
        if not isinstance(q, str):
            raise InputError(f"a question must be a string, got {type(q).__name__}")
        q = q.strip()
        if not q:
            raise InputError("the question is empty")
        check_text(q, "question")
        if len(q) > 8 * limit or engine.count_tokens(q) > limit:
            where = " (a remote engine's as --api-context says)" if engine.remote else ""
            raise InputError(
                f"the question is too long ({len(q)} characters); this model's context is "
                f"{engine.lm.max_context} tokens{where} and leaves room for about {limit} question tokens"
            )
        out.append(q)
    return out


class Method:
    """Base class: question validation, prompt building and running on the scheduler.

    Subclasses implement :meth:`program`, the paper's algorithm for one question; :meth:`answer_batch` runs one
    program per question on a :class:`~fastgate.scheduler.Scheduler`, which batches their requests.
    """

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    description: ClassVar[str] = ""
    needs_retriever: ClassVar[bool] = True
    default_retriever: ClassVar[str] = "bm25"  # what `fastgate ask` opens when --retriever is not given
    uses_retrievers: ClassVar[tuple[str, ...]] = ()  # other retrievers it searches too (the read gate: both)
    threshold: ClassVar[GateThreshold | None] = None  # the first gate's threshold parameter (gated methods)
    black_box: ClassVar[bool] = False  # needs only generated text and token log-probs: runs on a remote engine
    # the paper gives its threshold (--paper-defaults uses it); False: it belongs to the method's checkpoint
    paper_threshold: ClassVar[bool] = True

    def __init__(self, engine: LLMEngine, retriever: Retriever | None, config: MethodConfig | None = None) -> None:
        if engine.black_box and not self.black_box:
            raise InputError(black_box_refusal(self.name, engine.name))
        self.engine = engine
        self.retriever = retriever
        self.config = config or self.config_class()
        if not isinstance(self.config, self.config_class):
            raise InputError(f"{self.name} takes a {self.config_class.__name__}, got {type(self.config).__name__}")
        if self.needs_retriever and retriever is None:
            raise InputError(f"method {self.name} needs a retriever")
        for prefix in (FEW_SHOT_QA, COT_FEW_SHOT):  # most prompts start with these: prefill them once per engine
            engine.cache_prefix(prefix)

    @classmethod
    def preflight(cls, config: MethodConfig, model_name: str | None = None) -> None:
        """Cheap checks of a config before any model is loaded (e.g. that a checkpoint exists for ``model_name``)."""

    @classmethod
    def reads_from(cls, config: MethodConfig, retriever: str) -> str:
        """The retriever whose passages this method reads when run with ``retriever`` (calibration's replayed
        ``always`` reads the same, so a replayed read is this method's read)."""
        return retriever

    @classmethod
    def calibration_condition(cls, config: MethodConfig) -> dict[str, Any]:
        """Settings beyond the user's own parameters that a threshold calibrated for ``config`` holds for only (an
        entry's ``when``; the read gate: its base method and feature set, which one trained gate is)."""
        return {}

    @classmethod
    def parameters(cls) -> dict[str, Any]:
        """Parameter names and defaults of this method's config."""
        return {f.name: f.default for f in fields(cls.config_class)}

    @classmethod
    def inert_parameters(cls, config: MethodConfig) -> frozenset[str]:
        """The parameters that cannot change this config's answers (an evaluation may resume across their values)."""
        return frozenset()

    @classmethod
    def rows_at_once(cls, config: MethodConfig) -> int:
        """The most sequences one of this config's generations decodes together (its samples): a server refuses a
        request needing more than its ``max_rows`` before queueing it, and a default method needing more at start."""
        return 1

    # ------------------------------------------------------------------ helpers
    def validate(self, questions: list[str]) -> list[str]:
        """Strip questions and reject empty ones or ones that cannot fit the model context."""
        return check_questions(self.engine, self.config, questions)

    def answer_config(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.config.max_answer_tokens, stop=ANSWER_STOP)

    def closed_book(self, question: str, answer: bool = False) -> Generate:
        """The request for a greedy closed-book answer (``answer``: its text is the question's answer, see
        :class:`~fastgate.programs.Generate`)."""
        return Generate(closed_book_prompt(question), self.answer_config(), answer=answer)

    def fit_passages(self, question: str, hits: Sequence[Hit], build=None, max_new_tokens: int | None = None
                     ) -> list[Hit]:
        """The leading ``hits`` whose prompt ``build(question, passages)`` (default: the reading prompt) fits the
        model's context with ``max_new_tokens`` (default: the answer's) to generate; at least the first.

        Why: the engine cuts a prompt too long for its context on the left, where the instruction and the
        best-ranked passages stand (a large ``k`` or ``passage_words``): the answer then came from the lowest-ranked
        passages while the record listed them all. Ranked best first, the passages that do not fit are the last
        ones, and the record lists the ones read. A prompt of at most ``room - 8`` UTF-8 bytes is not tokenised (a
        token of the byte-level and byte-fallback tokenizers here holds at least one byte; 8 for special tokens). On a
        remote engine every hit is kept: its server's tokenizer is not here (``count_tokens`` is an estimate), and the
        server fits the prompt to its own context as before."""
        hits = list(hits)
        if len(hits) <= 1 or self.engine.remote:
            return hits
        budget = self.config.max_answer_tokens if max_new_tokens is None else max_new_tokens
        room = self.engine.lm.max_context - budget - 1  # the engine's room for a prompt (KVCacheManager.prompt_room)
        build = build or self._reading_prompt

        def fits(n: int) -> bool:
            prompt = build(question, hits[:n])
            return len(prompt.encode("utf-8", "surrogatepass")) + 8 <= room or self.engine.count_tokens(prompt) <= room

        if fits(len(hits)):
            return hits
        lo, hi = 1, len(hits) - 1  # the most that fit lies in [1, hi] (a prompt grows with each passage)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return hits[:lo]

    def _reading_prompt(self, question: str, hits: Sequence[Hit]) -> str:
        return rag_prompt(question, [h.passage for h in hits], self.config.passage_words)

    def with_passages(self, question: str, hits: Sequence[Hit], answer: bool = False) -> Generate:
        """The request for a greedy answer from ``hits`` (the caller's :meth:`fit_passages`: the ones that fit)."""
        return Generate(self._reading_prompt(question, hits), self.answer_config(), answer=answer)

    # ------------------------------------------------------------------ running
    def program(self, question: str) -> Program:  # pragma: no cover - abstract
        """This method's algorithm for one question, as a step program (see :mod:`fastgate.programs`)."""
        raise NotImplementedError

    def result(self, question: str, answer: str, trace, timings: dict[str, float]) -> MethodResult:
        """The :class:`MethodResult` of a finished program, from its trace."""
        return MethodResult(question=question, answer=answer, retrieved=trace.retrieval_calls > 0,
                            passages=list(trace.passages), retrieval_calls=trace.retrieval_calls,
                            lm_calls=trace.lm_calls, generated_tokens=trace.generated_tokens,
                            gate_steps=list(trace.gate_steps), timings=dict(timings), truncated=trace.truncated,
                            method=self.name, prompt_tokens=trace.prompt_tokens, finish_reason=trace.finish_reason)

    def answer(self, question: str) -> MethodResult:
        """Answer one question."""
        return self.answer_batch([question])[0]

    def answer_batch(self, questions: list[str]) -> list[MethodResult]:
        """Answer several questions: their programs run together on one scheduler, in input order."""
        from fastgate.scheduler import Scheduler

        return Scheduler(self.engine).answer(self, questions)  # it validates them
