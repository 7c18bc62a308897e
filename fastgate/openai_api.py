"""OpenAI-compatible endpoints of ``fastgate serve``: ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``GET /v1/models``, registered by :func:`fastgate.server.create_app` next to ``/v1/answer``.

How a request maps onto a gated answer:

- ``model`` picks the method: ``fastgate-<method>`` (``GET /v1/models`` lists one per method; ``fastgate`` alone is
  the server's default method). An unknown model gets 404 ``model_not_found``.
- The question is the last message of a chat, which must be the user's (earlier messages are not read: the methods
  use their own prompts; the response lists them under ``fastgate.ignored``), or the ``prompt`` of a completion (one
  string).
- Method parameters are the body's fields that are not standard ones (what the ``openai`` client sends as
  ``extra_body``), or a ``params`` object as in ``/v1/answer``; a name that is also a standard field (DTR's ``n``,
  SeaKR's ``temperature``, ``top_p``, ``seed``) keeps its OpenAI meaning at the top level and is a method parameter
  only inside ``params``.
- ``max_tokens`` (or ``max_completion_tokens``) bounds the answer: the method's ``max_answer_tokens``.
- ``temperature``, ``top_p``, ``seed``, ``user`` and other fields with no effect on an answer here are accepted and
  not applied (every method decodes its answer greedily and sets its own sampling); the response names them under
  ``fastgate.ignored``. Fields that would change the result and cannot be honoured get 400 unless they carry their
  neutral value: ``n`` > 1, ``logprobs``, ``top_logprobs`` (except for ``fastgate-never``, below), ``stop``,
  ``tools``, ``functions``, penalties, ``logit_bias``, a non-text ``response_format``, ``echo``, ``suffix``,
  ``best_of``, audio or predicted outputs.
- ``fastgate-never`` returns ``logprobs`` (completions: ``logprobs`` 0 or 1; chat: ``logprobs: true`` with
  ``top_logprobs`` 0 or 1) of the tokens of the generation its answer is (the answer is their text stripped); its
  answer is greedy, so the one top alternative is the chosen token.
- **Plain completions**: ``/v1/completions`` with the LM's own name as ``model`` (``GET /v1/models`` lists it; not on
  a server that itself generates remotely) completes the prompt as it is, like any inference server: ``max_tokens``
  (default 16), ``temperature`` (0: greedy; default 1), ``top_p``, ``top_k``, ``seed``, ``stop`` (up to 8),
  ``ignore_eos``, and ``logprobs`` up to 5 (:mod:`fastgate.completion`): every generated token with its log-prob,
  EOS and stop-string tokens included, and the stop string as ``stop_reason`` (as vLLM names it). This is what a
  remote engine (:mod:`fastgate.remote`) of another fastgate calls. Not streamed.

Responses are standard (``choices`` with ``finish_reason`` "length" when the answer's generation stopped at its token
limit, else "stop"; ``usage`` with the prompt and completion tokens summed over every LM call of the question, k
samples of one prompt counting its prompt once) plus one extension object, ``fastgate``: the ``fastgate ask --json``
record (retrieved, passages with ids and scores, gate steps, counters, timings) with ``replica`` (which server process
answered) and ``ignored``. Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

Streaming (``"stream": true``): server-sent events in OpenAI's chunk format. Gate decisions and searches arrive as
they happen, in chunks whose only content is ``fastgate`` (``{"event": "gate", "step": ...}``, ``{"event":
"retrieval", "queries": ..., "hits": ...}``); then the answer's text: where the method generates its answer in one
generation known to be final when it starts (``never``, ``always``, DTR and CBDR after retrieving, CBDR skipping,
SeaKR without passages) as it is decoded, otherwise (FLARE, SCAAR, Probing-RAG and SeaKR extract the answer from a
chain of thought; DTR's closed-book answer is final only once its gate skips) in one piece when it is known; then a
last chunk with ``finish_reason`` and the whole record under ``fastgate`` (``"event": "done"``), a ``usage`` chunk if
``stream_options.include_usage``, and ``data: [DONE]``. The content chunks concatenate to the non-streamed answer. A
client that disconnects cancels its program.
"""

# no `from __future__ import annotations`: FastAPI and pydantic read the annotations of the models and endpoints
# defined inside add_openai_routes at runtime
import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastgate.completion import chat_logprobs, completion_logprobs
from fastgate.errors import CheckpointError, FastgateError, InputError
from fastgate.service import AnswerService, OverloadedError

__all__ = ["MODEL_PREFIX", "OPENAI_PATHS", "AnswerStream", "add_openai_routes", "openai_error", "stable_text",
           "validation_message"]

log = logging.getLogger(__name__)

MODEL_PREFIX = "fastgate-"
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
_POLL_S = 0.25  # while no event comes, a stream checks this often whether its client has gone


def _is_int(v: Any, n: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == n


# standard fields that would change the result and cannot be honoured: refused unless null or neutral
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: _is_int(v, 1), "one answer per question: n must be 1"),
    "best_of": (lambda v: _is_int(v, 1), "one answer per question: best_of must be 1"),
    "logprobs": (lambda v: v is False or _is_int(v, 0), "token log-probabilities are returned by fastgate-never "
                 "and by plain completions of the LM (its own model name) only"),
    "top_logprobs": (lambda v: _is_int(v, 0), "token log-probabilities are returned by fastgate-never and by plain "
                     "completions of the LM (its own model name) only"),
    "echo": (lambda v: v is False, "the prompt is not echoed"),
    "suffix": (lambda v: v == "", "suffixes are not supported"),
    "stop": (lambda v: v == "" or v == [], "each method stops its generations itself"),
    "presence_penalty": (lambda v: v == 0 and not isinstance(v, bool), "penalties are not supported"),
    "frequency_penalty": (lambda v: v == 0 and not isinstance(v, bool), "penalties are not supported"),
    "logit_bias": (lambda v: v == {}, "logit_bias is not supported"),
    "tools": (lambda v: v == [], "tool calls are not supported"),
    "tool_choice": (lambda v: v == "none", "tool calls are not supported"),
    "functions": (lambda v: v == [], "function calls are not supported"),
    "function_call": (lambda v: v == "none", "function calls are not supported"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type") == "text" and len(v) == 1,
                        "the answer is text; structured output is not supported"),
    "modalities": (lambda v: v == ["text"], "the answer is text"),
    "audio": (lambda v: False, "audio output is not supported"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "web_search_options": (lambda v: False, "web search is not supported; the server retrieves from its index"),
    "reasoning_effort": (lambda v: False, "reasoning effort is not supported"),
}
# standard fields with no effect on the answer here: accepted, not applied, named in fastgate.ignored
_IGNORED_DECLARED = ("temperature", "top_p", "seed", "user")
_IGNORED_EXTRA = ("store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
                  "verbosity")


class _ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 404: "invalid_request_error", 503: "overloaded_error",
            504: "timeout_error"}.get(status, "server_error")


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The body of an OpenAI-style error."""
    return {"error": {"message": message, "type": _error_type(status), "param": param, "code": code}}


def stable_text(text: str, stop: list[str] | tuple[str, ...]) -> str:
    """The part of a generation's text so far that no later token can change: without a trailing incomplete UTF-8
    character (decoded as U+FFFD until its last byte comes) and without a tail that may be the start of a stop string
    (the decode loop cuts the text there once the stop string is complete)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[:len(text) - hold]


class AnswerStream:
    """Turns snapshots of the answer generation's text into content deltas whose concatenation is the answer (the
    methods answer ``text.strip()``): leading whitespace is dropped and trailing whitespace held back until more text
    follows it. Text once sent cannot be taken back, so if a snapshot does not extend what was sent (a tokenizer whose
    decoding of a longer sequence rewrites earlier text), streaming stops and :meth:`finish` sends the rest."""

    def __init__(self) -> None:
        self.sent = ""
        self.broken = False

    def update(self, text: str, stop: list[str], done: bool) -> str:
        """The new content of snapshot ``text`` (``done``: the generation's final text)."""
        if self.broken:
            return ""
        stable = text.strip() if done else stable_text(text, stop).strip()
        if not stable.startswith(self.sent):
            self.broken = True
            return ""
        delta, self.sent = stable[len(self.sent):], stable
        return delta

    def finish(self, answer: str) -> str:
        """What is left to send of the final ``answer``."""
        if answer.startswith(self.sent):
            delta, self.sent = answer[len(self.sent):], answer
            return delta
        log.warning("streamed text %r is not a prefix of the answer %r; the record has the answer", self.sent, answer)
        return ""


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, default=_scalar)}\n\n"


def _scalar(obj: Any) -> Any:
    """numpy and torch scalars as Python numbers."""
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def add_openai_routes(app, service: AnswerService, timeout_s: float, count: Callable[[int], None],
                      observe: Callable[[float], None], replica: str | None = None) -> None:
    """Register the OpenAI-compatible endpoints on ``app`` (see the module docstring).

    Args:
        count: called with the status code of every answered request (metrics).
        observe: called with the seconds of every request answered with 200.
        replica: this server's name in the responses' ``fastgate.replica`` (Ray Serve replicas differ).
    """
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

    from fastgate.methods import METHODS
    from fastgate.scheduler import CancelledError as ProgramCancelled
    from fastgate.server import _finite

    cfg = service.config
    limit = cfg.max_tokens_limit
    created_at = int(time.time())
    Scalar = StrictBool | StrictInt | StrictFloat | StrictStr

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="allow")
        type: StrictStr = Field(max_length=64)
        text: StrictStr | None = None

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: StrictStr = Field(max_length=64)
        content: StrictStr | list[TextPart] | None = None

    class StreamOptions(BaseModel):
        model_config = ConfigDict(extra="allow")
        include_usage: StrictBool | None = None

    class _Request(BaseModel):
        # extra fields are the method's parameters (the openai client's extra_body)
        model_config = ConfigDict(extra="allow")
        model: StrictStr = Field(max_length=128, description="fastgate-<method> (GET /v1/models), or fastgate for "
                                                             f"the default method ({cfg.method})")
        max_tokens: StrictInt | None = Field(None, ge=1, le=limit, description="maximum answer tokens")
        stream: StrictBool | None = Field(None, description="server-sent events: gate steps, retrievals, the answer")
        stream_options: StreamOptions | None = None
        params: dict[StrictStr, Scalar] | None = Field(
            None, description="method parameters (see `fastgate methods`); names that are not standard fields may "
                              "also be given beside the standard fields")
        temperature: StrictFloat | StrictInt | None = Field(None, description="accepted, not applied (greedy answers)")
        top_p: StrictFloat | StrictInt | None = Field(None, description="accepted, not applied (greedy answers)")
        seed: StrictInt | None = Field(None, description="accepted, not applied (answers are deterministic)")
        user: StrictStr | None = Field(None, max_length=256, description="accepted, not applied")

    class ChatCompletionRequest(_Request):
        """An OpenAI chat completion request: the last message (the user's) is the question."""

        messages: list[Message] = Field(min_length=1, max_length=1024)
        max_completion_tokens: StrictInt | None = Field(None, ge=1, le=limit, description="as max_tokens")

    class CompletionRequest(_Request):
        """An OpenAI completion request: the prompt is the question."""

        prompt: StrictStr | list[StrictStr]

    class Usage(BaseModel):
        prompt_tokens: int
        completion_tokens: int
        total_tokens: int

    class ChatMessage(BaseModel):
        role: str
        content: str

    class ChatChoice(BaseModel):
        index: int
        message: ChatMessage
        finish_reason: str
        logprobs: dict[str, Any] | None = None

    class ChatCompletion(BaseModel):
        """An OpenAI chat completion, with the gated answer's signals under ``fastgate``."""

        id: str
        object: str
        created: int
        model: str
        choices: list[ChatChoice]
        usage: Usage
        fastgate: dict[str, Any]

    class CompletionChoice(BaseModel):
        index: int
        text: str
        finish_reason: str
        logprobs: dict[str, Any] | None = None
        stop_reason: str | None = None

    class Completion(BaseModel):
        """An OpenAI completion, with the gated answer's signals under ``fastgate``."""

        id: str
        object: str
        created: int
        model: str
        choices: list[CompletionChoice]
        usage: Usage
        fastgate: dict[str, Any]

    class ModelCard(BaseModel):
        id: str
        object: str
        created: int
        owned_by: str
        fastgate: dict[str, Any]

    class ModelList(BaseModel):
        object: str
        data: list[ModelCard]

    class ErrorDetail(BaseModel):
        message: str
        type: str
        param: str | None
        code: str | None

    class ErrorBody(BaseModel):
        error: ErrorDetail

    errors = {s: {"model": ErrorBody} for s in (400, 404, 500, 503, 504)}

    def fail(exc: _ApiError) -> JSONResponse:
        count(exc.status)
        return JSONResponse(openai_error(exc.status, exc.message, exc.param, exc.code), status_code=exc.status,
                            headers=exc.headers)

    def plain_model(model: str) -> bool:
        """Whether ``model`` names the LM itself: plain completions (not on a remote engine)."""
        return model == service.model_name and not model.startswith(MODEL_PREFIX) and model != "fastgate" and \
            service.runtime.remote is None

    def method_of(model: str) -> str:
        if plain_model(model):
            raise _ApiError(400, f"the model {model!r} is served for plain completions: use /v1/completions",
                            "model", "unsupported_model")
        if model == "fastgate":
            return cfg.method
        name = model[len(MODEL_PREFIX):] if model.startswith(MODEL_PREFIX) else None
        if name not in METHODS:
            known = ", ".join(MODEL_PREFIX + m for m in METHODS)
            raise _ApiError(404, f"the model {model!r} does not exist; this server has: {known}", "model",
                            "model_not_found")
        return name

    def options(body: _Request, ignored: list[str], logprobs: dict[str, Any] | None = None
                ) -> tuple[str, dict[str, Any]]:
        """The method and its parameters; refused and ignored standard fields sorted out. ``logprobs``: where
        ``logprobs`` / ``top_logprobs`` go for fastgate-never, which returns them (refused for other methods)."""
        method = method_of(body.model)
        extra = dict(body.model_extra or {})
        if method == "never" and logprobs is not None:
            for name in ("logprobs", "top_logprobs"):
                logprobs[name] = extra.pop(name, None)
        for name, (neutral, why) in _REFUSED.items():
            value = extra.pop(name, None)
            if value is not None and not _neutral(neutral, value):
                raise _ApiError(400, f"unsupported parameter {name}={json.dumps(value)[:80]}: {why}", name,
                                "unsupported_parameter")
        ignored += [n for n in _IGNORED_DECLARED if getattr(body, n) is not None]
        ignored += [n for n in _IGNORED_EXTRA if extra.pop(n, None) is not None]
        extra = {k: v for k, v in extra.items() if v is not None}  # null: the default, as for OpenAI's fields
        params = dict(body.params or {})
        twice = sorted(set(params) & set(extra))
        if twice:
            raise _ApiError(400, f"parameter {twice[0]} is given both in params and beside it", twice[0])
        return method, {**params, **extra}

    def submit(question: str, method: str, params: dict[str, Any], max_tokens: int | None, listener=None,
               answer_tokens: bool = False):
        try:
            return service.submit(question, method, params, max_tokens, listener=listener,
                                  answer_tokens=answer_tokens)
        except OverloadedError as exc:
            raise _ApiError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after_s)}) \
                from None
        except (InputError, CheckpointError) as exc:
            raise _ApiError(400, str(exc), code="invalid_value") from None
        except FastgateError as exc:  # e.g. the service is stopping
            raise _ApiError(503, str(exc), code="unavailable", headers={"Retry-After": "5"}) from None

    def extension(record: dict[str, Any], ignored: list[str]) -> dict[str, Any]:
        return {**_finite(record), "replica": replica, "ignored": ignored}

    def usage(record: dict[str, Any]) -> dict[str, int]:
        prompt, completion = int(record.get("prompt_tokens", 0)), int(record.get("generated_tokens", 0))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def run(chat: bool, body: _Request, question: str, max_tokens: int | None, ignored: list[str],
                  request: Request) -> Any:
        t0 = time.perf_counter()
        asked: dict[str, Any] = {}
        method, params = options(body, ignored, asked)
        top = _never_logprobs(chat, asked)  # None: no logprobs; else how many top alternatives (0 or 1)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream and top is not None:
            raise _ApiError(400, "logprobs are not streamed: ask without stream", "logprobs", "unsupported_parameter")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return stream(chat, rid, created, body.model, question, method, params, max_tokens, ignored,
                          include_usage, request, t0)
        future = submit(question, method, params, max_tokens, answer_tokens=top is not None)
        try:
            record = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except asyncio.TimeoutError:
            service.cancel(future)  # dropped if queued, else its program stops at the next tick
            raise _ApiError(504, f"not answered within {timeout_s:g} s", code="timeout") from None
        except (InputError, CheckpointError) as exc:
            raise _ApiError(400, str(exc), code="invalid_value") from None
        except ProgramCancelled:  # the service's own timeout
            raise _ApiError(504, f"not answered within {cfg.timeout_s:g} s", code="timeout") from None
        except Exception as exc:  # noqa: BLE001 - reported, the server keeps serving
            raise _ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error") from None
        count(200)
        observe(time.perf_counter() - t0)
        tokens = record.pop("_answer_tokens", None)
        logprobs = None
        if top is not None and tokens is not None:  # the greedy answer: its chosen tokens are the top ones
            pieces, lps = tokens
            alts = [[(p, lp)] for p, lp in zip(pieces, lps)] if top else None
            logprobs = chat_logprobs(pieces, lps, alts) if chat else completion_logprobs(pieces, lps, alts)
        answer, finish = record["answer"], record.get("finish_reason", "stop")
        choice = {"index": 0, "message": {"role": "assistant", "content": answer}} if chat else \
            {"index": 0, "text": answer}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": body.model, "choices": [{**choice, "finish_reason": finish, "logprobs": logprobs}],
                "usage": usage(record), "fastgate": extension(record, ignored)}

    async def plain(body: CompletionRequest, prompt: str) -> Any:
        """A plain completion of ``prompt`` by the LM, with token log-probabilities if asked for."""
        from fastgate.completion import MAX_TOP_LOGPROBS
        from fastgate.config import GenerationConfig

        t0 = time.perf_counter()
        extra = dict(body.model_extra or {})
        if body.stream:
            raise _ApiError(400, "plain completions are not streamed: ask without stream", "stream",
                            "unsupported_parameter")
        if body.params:
            raise _ApiError(400, "plain completions take no method parameters", "params")
        logprobs = extra.pop("logprobs", None)
        if logprobs is not None and not (_is_int(logprobs, logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise _ApiError(400, f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}", "logprobs",
                            "invalid_value")
        stop = extra.pop("stop", None)
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and (not isinstance(stop, list) or len(stop) > 8
                                 or any(not isinstance(x, str) or not x or len(x) > 64 for x in stop)):
            raise _ApiError(400, "stop must be a non-empty string or a list of at most 8 of them", "stop",
                            "invalid_value")
        top_k = extra.pop("top_k", None)
        if top_k is not None and not (_is_int(top_k, top_k) and 0 <= top_k <= 1000) and top_k != -1:
            raise _ApiError(400, "top_k must be an integer between 0 and 1000 (or -1: off)", "top_k", "invalid_value")
        ignore_eos = extra.pop("ignore_eos", None)
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise _ApiError(400, "ignore_eos must be a boolean", "ignore_eos", "invalid_value")
        for name in ("n", "best_of", "echo", "suffix", "presence_penalty", "frequency_penalty", "logit_bias"):
            value = extra.pop(name, None)
            if value is not None and not _neutral(_REFUSED[name][0], value):
                raise _ApiError(400, f"unsupported parameter {name}={json.dumps(value)[:80]}: {_REFUSED[name][1]}",
                                name, "unsupported_parameter")
        for name in _IGNORED_EXTRA:
            extra.pop(name, None)
        unknown = sorted(k for k, v in extra.items() if v is not None)
        if unknown:
            raise _ApiError(400, f"unsupported parameter {unknown[0]} for a plain completion", unknown[0],
                            "unsupported_parameter")
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        top_p = 1.0 if body.top_p is None else float(body.top_p)
        if not 0 <= temperature <= 2:
            raise _ApiError(400, "temperature must be between 0 and 2", "temperature", "invalid_value")
        if not 0 < top_p <= 1:
            raise _ApiError(400, "top_p must be in (0, 1]", "top_p", "invalid_value")
        try:
            config = GenerationConfig(max_new_tokens=body.max_tokens or 16, do_sample=temperature > 0,
                                      temperature=temperature if temperature > 0 else 1.0, top_p=top_p,
                                      top_k=max(0, top_k or 0), seed=body.seed, stop=tuple(stop or ()),
                                      stop_at_eos=not ignore_eos)
            future = service.submit_completion(prompt, config, body.seed, logprobs or 0)
        except OverloadedError as exc:
            raise _ApiError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after_s)}) \
                from None
        except InputError as exc:
            raise _ApiError(400, str(exc), code="invalid_value") from None
        except FastgateError as exc:
            raise _ApiError(503, str(exc), code="unavailable", headers={"Retry-After": "5"}) from None
        try:
            done = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except asyncio.TimeoutError:
            service.cancel(future)
            raise _ApiError(504, f"not answered within {timeout_s:g} s", code="timeout") from None
        except InputError as exc:
            raise _ApiError(400, str(exc), code="invalid_value") from None
        except ProgramCancelled:
            raise _ApiError(504, f"not answered within {cfg.timeout_s:g} s", code="timeout") from None
        except Exception as exc:  # noqa: BLE001 - reported, the server keeps serving
            raise _ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error") from None
        count(200)
        observe(time.perf_counter() - t0)
        seq = done.generation
        lp = completion_logprobs(done.pieces, seq.token_logprobs, done.top) if logprobs is not None else None
        n_out = len(seq.token_ids)
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": body.model,
                "choices": [{"index": 0, "text": seq.text, "logprobs": lp, "stop_reason": seq.stop_string,
                             "finish_reason": "length" if seq.finish_reason == "length" else "stop"}],
                "usage": {"prompt_tokens": seq.prompt_tokens, "completion_tokens": n_out,
                          "total_tokens": seq.prompt_tokens + n_out},
                "fastgate": {"finish": seq.finish_reason, "truncated": seq.truncated, "replica": replica,
                             "server_s": time.perf_counter() - t0}}

    def stream(chat: bool, rid: str, created: int, model: str, question: str, method: str, params: dict[str, Any],
               max_tokens: int | None, ignored: list[str], include_usage: bool, request: Request, t0: float):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        end = object()

        def listener(event: dict) -> None:  # on the scheduler's thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        future = submit(question, method, params, max_tokens, listener)  # refused before any byte is streamed

        def ended(_f) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, end)
            except RuntimeError:  # the event loop has closed (server shutdown)
                pass

        future.add_done_callback(ended)

        def chunk(content: str | None = None, finish: str | None = None, ext: dict | None = None,
                  role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if content is not None:
                    delta["content"] = content
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                   "model": model, "choices": [choice]}
            if ext is not None:
                out["fastgate"] = ext
            return out

        async def events_then_answer():
            text = AnswerStream()
            deadline = time.monotonic() + timeout_s
            try:
                if chat:
                    yield _sse(chunk(role=True))
                while True:
                    try:
                        event = await asyncio.wait_for(events.get(), _POLL_S)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return  # the finally clause cancels the program
                        if time.monotonic() > deadline:
                            service.cancel(future)
                            count(504)
                            yield _sse(openai_error(504, f"not answered within {timeout_s:g} s", code="timeout"))
                            yield "data: [DONE]\n\n"
                            return
                        continue
                    if event is end:
                        break
                    if event["event"] == "answer":
                        delta = text.update(event["text"], event["stop"], event["done"])
                        if delta:
                            yield _sse(chunk(delta))
                    else:
                        yield _sse(chunk(ext=_finite(event)))
                try:
                    record = future.result()
                except Exception as exc:  # noqa: BLE001 - the stream has started: the error is its last event
                    if isinstance(exc, (InputError, CheckpointError)):
                        status, message = 400, str(exc)
                    elif isinstance(exc, ProgramCancelled):  # the service's own timeout
                        status, message = 504, f"not answered within {cfg.timeout_s:g} s"
                    else:
                        status, message = 500, f"internal error: {type(exc).__name__}: {exc}"
                    count(status)
                    yield _sse(openai_error(status, message))
                    yield "data: [DONE]\n\n"
                    return
                rest = text.finish(record["answer"])
                if rest:
                    yield _sse(chunk(rest))
                yield _sse(chunk(finish=record.get("finish_reason", "stop"),
                                 ext={"event": "done", **extension(record, ignored)}))
                if include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": created, "model": model, "choices": [], "usage": usage(record)})
                yield "data: [DONE]\n\n"
                count(200)
                observe(time.perf_counter() - t0)
            finally:  # the client went away (the response task is cancelled) or the stream ended
                if not future.done():
                    service.cancel(future)

        return StreamingResponse(events_then_answer(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        try:
            ignored: list[str] = []
            last = body.messages[-1]
            if last.role != "user":
                raise _ApiError(400, f"the last message must be the user's question (role user), not {last.role!r}",
                                "messages")
            if isinstance(last.content, list):
                if any(p.type != "text" for p in last.content):
                    raise _ApiError(400, "only text content parts are supported", "messages")
                question = "\n".join(p.text or "" for p in last.content)
            else:
                question = last.content or ""
            if len(body.messages) > 1:
                ignored.append("messages before the last")  # the methods use their own prompts
            max_tokens = body.max_tokens
            if body.max_completion_tokens is not None:
                if max_tokens is not None and max_tokens != body.max_completion_tokens:
                    raise _ApiError(400, "max_tokens and max_completion_tokens differ", "max_completion_tokens")
                max_tokens = body.max_completion_tokens
            return await run(True, body, question, max_tokens, ignored, request)
        except _ApiError as exc:
            return fail(exc)

    @app.post("/v1/completions", response_model=Completion, responses=errors)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        try:
            prompt = body.prompt
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise _ApiError(400, f"one prompt per request, got {len(prompt)}", "prompt")
                prompt = prompt[0]
            if plain_model(body.model):
                return await plain(body, prompt)
            return await run(False, body, prompt, body.max_tokens, [], request)
        except _ApiError as exc:
            return fail(exc)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Any:
        lm = service.model_name
        data = [{"id": MODEL_PREFIX + name, "object": "model", "created": created_at, "owned_by": "fastgate",
                 "fastgate": {"method": name, "description": cls.description, "default": name == cfg.method,
                              "lm": lm}}
                for name, cls in METHODS.items()]
        if plain_model(lm):  # the LM itself: plain completions with token log-probabilities
            data.append({"id": lm, "object": "model", "created": created_at, "owned_by": "fastgate",
                         "fastgate": {"method": None, "description": "plain completions of the LM, with token "
                                      "log-probabilities (/v1/completions only)", "default": False, "lm": lm}})
        return {"object": "list", "data": data}


def _never_logprobs(chat: bool, asked: dict[str, Any]) -> int | None:
    """How many top alternatives fastgate-never returns per token (0 or 1), or None when no logprobs are asked for:
    the chat format's ``logprobs: true`` + ``top_logprobs``, the completions format's integer ``logprobs``."""
    lp, top = asked.get("logprobs"), asked.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise _ApiError(400, "logprobs must be true or false", "logprobs", "invalid_value")
        if top is not None and not lp and not _is_int(top, 0):
            raise _ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        n = 0 if top is None else top
        if not lp:
            return None
    else:
        if top is not None and not _is_int(top, 0):
            raise _ApiError(400, "top_logprobs is a chat field; completions take an integer logprobs", "top_logprobs",
                            "invalid_value")
        if lp is None:
            return None
        n = lp
    if not (isinstance(n, int) and not isinstance(n, bool)) or not 0 <= n <= 1:
        raise _ApiError(400, "fastgate-never returns logprobs of its answer's tokens with at most one top "
                        "alternative (its greedy choice); plain completions of the LM (its own model name) return up "
                        "to 5", "top_logprobs" if chat else "logprobs", "invalid_value")
    return n


def _neutral(check: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(check(value))
    except Exception:  # noqa: BLE001 - a value the check cannot compare is not the neutral one
        return False


def validation_message(exc) -> tuple[str, str | None]:
    """A one-line message and the offending field of a FastAPI ``RequestValidationError``."""
    parts, param = [], None
    for e in exc.errors()[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts), param
