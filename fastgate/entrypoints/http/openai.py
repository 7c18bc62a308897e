"""OpenAI-compatible endpoints of ``fastgate serve``: ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``GET /v1/models``, registered by :func:`fastgate.entrypoints.http.app.create_app` next to ``/v1/answer``.

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
  ``best_of``, audio or predicted outputs (:data:`fastgate.entrypoints.http.protocol.REFUSED`).
- ``fastgate-never`` returns ``logprobs`` (completions: ``logprobs`` 0 or 1; chat: ``logprobs: true`` with
  ``top_logprobs`` 0 or 1) of the tokens of the generation its answer is (the answer is their text stripped); its
  answer is greedy, so the one top alternative is the chosen token.
- **Plain completions**: ``/v1/completions`` with the LM's own name as ``model`` completes the prompt as it is
  (:mod:`fastgate.entrypoints.http.plain`).

Responses are standard (``choices`` with ``finish_reason`` "length" when the answer's generation stopped at its token
limit, else "stop"; ``usage`` with the prompt and completion tokens summed over every LM call of the question, k
samples of one prompt counting its prompt once) plus one extension object, ``fastgate``: the ``fastgate ask --json``
record (retrieved, passages with ids and scores, gate steps, counters, timings) with ``replica`` (which server process
answered) and ``ignored``. Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``
(:mod:`fastgate.entrypoints.http.errors`).

Streaming (``"stream": true``): server-sent events in OpenAI's chunk format. Gate decisions and searches arrive as
they happen, in chunks whose only content is ``fastgate`` (``{"event": "gate", "step": ...}``, ``{"event":
"retrieval", "queries": ..., "hits": ...}``); then the answer's text: where the method generates its answer in one
generation known to be final when it starts (``never``, ``always``, DTR and CBDR after retrieving, CBDR skipping,
SeaKR without passages) as it is decoded, otherwise (FLARE, SCAAR, Probing-RAG and SeaKR extract the answer from a
chain of thought; DTR's closed-book answer is final only once its gate skips) in one piece when it is known; then a
last chunk with ``finish_reason`` and the whole record under ``fastgate`` (``"event": "done"``), a ``usage`` chunk if
``stream_options.include_usage``, and ``data: [DONE]``. The content chunks concatenate to the non-streamed answer. A
client that disconnects cancels its program.

Calls :meth:`AnswerService.submit <fastgate.serving.service.AnswerService.submit>`, the method table
(:data:`fastgate.methods.METHODS`), :mod:`fastgate.entrypoints.http.plain`, :mod:`fastgate.entrypoints.http.streaming`
and :mod:`fastgate.entrypoints.http.logprobs`.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime
import asyncio
import json
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from fastgate.entrypoints.http.common import MODEL_PREFIX, NotAnswered, finite, sse, wait_answer
from fastgate.entrypoints.http.errors import OPENAI_RESPONSES, ApiError, ErrorMap
from fastgate.entrypoints.http.logprobs import chat_logprobs, completion_logprobs
from fastgate.entrypoints.http.metrics import HttpMetrics
from fastgate.entrypoints.http.plain import check_sampling, is_plain_model, plain_completion
from fastgate.entrypoints.http.protocol import (
    IGNORED_DECLARED,
    IGNORED_EXTRA,
    REFUSED,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIRequest,
    is_int,
    neutral,
)
from fastgate.entrypoints.http.streaming import POLL_S, AnswerStream, Events, chunk
from fastgate.errors import FastgateError
from fastgate.methods import METHODS

__all__ = ["OpenAIServing", "add_openai_routes", "usage"]


class OpenAIServing:
    """The OpenAI-compatible endpoints of one app (see the module docstring).

    Args:
        service: the :class:`~fastgate.serving.service.AnswerService` answering.
        timeout_s: the HTTP timeout of a request.
        errors: the app's error map (counts error responses).
        metrics: the app's metrics (answered requests and their latency).
        replica: this server's name in the responses' ``fastgate.replica`` (Ray Serve replicas differ).
    """

    def __init__(self, service: Any, timeout_s: float, errors: ErrorMap, metrics: HttpMetrics,
                 replica: str | None = None) -> None:
        self.service, self.timeout_s, self.errors, self.metrics, self.replica = \
            service, timeout_s, errors, metrics, replica
        self.default_method = service.config.method
        self.created_at = int(time.time())

    # ------------------------------------------------------------------------------------------------ endpoints
    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: one model per method this server runs (on a remote engine, the black-box ones), and
        the LM itself where it serves plain completions."""
        lm = self.service.model_name
        remote = self.service.runtime.remote is not None  # methods reading hidden states are refused there
        data = [{"id": MODEL_PREFIX + name, "object": "model", "created": self.created_at, "owned_by": "fastgate",
                 "fastgate": {"method": name, "description": cls.description, "default": name == self.default_method,
                              "lm": lm}}
                for name, cls in METHODS.items() if cls.black_box or not remote]
        if is_plain_model(self.service, lm):  # the LM itself: plain completions with token log-probabilities
            data.append({"id": lm, "object": "model", "created": self.created_at, "owned_by": "fastgate",
                         "fastgate": {"method": None, "description": "plain completions of the LM, with token "
                                      "log-probabilities (/v1/completions only)", "default": False, "lm": lm}})
        return {"object": "list", "data": data}

    def model(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{model_id}``: that model of :meth:`models` (``fastgate``: the default method's, as the
        completions take it); :class:`ApiError` 404 for one not served."""
        for card in self.models()["data"]:
            if card["id"] == model_id:
                return card
            if model_id == "fastgate" and card["fastgate"]["default"]:
                return {**card, "id": "fastgate"}
        known = ", ".join(card["id"] for card in self.models()["data"])
        raise ApiError(404, f"the model {model_id!r} does not exist; this server has: {known}", "model",
                       "model_not_found")

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        """``POST /v1/chat/completions``: the last message is the question."""
        try:
            ignored: list[str] = []
            last = body.messages[-1]
            if last.role != "user":
                raise ApiError(400, f"the last message must be the user's question (role user), not {last.role!r}",
                               "messages", "invalid_value")
            if isinstance(last.content, list):
                if any(p.type != "text" for p in last.content):
                    raise ApiError(400, "only text content parts are supported", "messages", "unsupported_parameter")
                question = "\n".join(p.text or "" for p in last.content)
            else:
                question = last.content or ""
            if len(body.messages) > 1:
                ignored.append("messages before the last")  # the methods use their own prompts
            max_tokens = body.max_tokens
            if body.max_completion_tokens is not None:
                if max_tokens is not None and max_tokens != body.max_completion_tokens:
                    raise ApiError(400, "max_tokens and max_completion_tokens differ", "max_completion_tokens",
                                   "invalid_value")
                max_tokens = body.max_completion_tokens
            return await self.answer(True, body, question, max_tokens, ignored, request)
        except Exception as exc:  # noqa: BLE001 - an ApiError, or one no route mapped: 500 in OpenAI's format
            return self.errors.openai(exc)

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        """``POST /v1/completions``: the prompt is the question, or plainly completed for the LM's own name."""
        try:
            prompt = body.prompt
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise ApiError(400, f"one prompt per request, got {len(prompt)}", "prompt", "unsupported_parameter")
                prompt = prompt[0]
            if is_plain_model(self.service, body.model):
                return await plain_completion(self.service, body, prompt, self.timeout_s, self.errors, self.metrics,
                                              self.replica, request)
            return await self.answer(False, body, prompt, body.max_tokens, [], request)
        except Exception as exc:  # noqa: BLE001 - an ApiError, or one no route mapped: 500 in OpenAI's format
            return self.errors.openai(exc)

    # ------------------------------------------------------------------------------------------------ an answer
    def method_of(self, model: str) -> str:
        """The method a model name picks; :class:`ApiError` 404 for a name that is not served."""
        if is_plain_model(self.service, model):
            raise ApiError(400, f"the model {model!r} is served for plain completions: use /v1/completions",
                           "model", "unsupported_model")
        if model == "fastgate":
            return self.default_method
        name = model[len(MODEL_PREFIX):] if model.startswith(MODEL_PREFIX) else None
        if name not in METHODS:
            known = ", ".join(card["id"] for card in self.models()["data"])  # the LM too, where it is served
            raise ApiError(404, f"the model {model!r} does not exist; this server has: {known}", "model",
                           "model_not_found")
        return name

    def options(self, body: OpenAIRequest, ignored: list[str], logprobs: dict[str, Any] | None = None
                ) -> tuple[str, dict[str, Any]]:
        """The method and its parameters; refused and ignored standard fields sorted out. ``logprobs``: where
        ``logprobs`` / ``top_logprobs`` go for fastgate-never, which returns them (refused for other methods)."""
        method = self.method_of(body.model)
        extra = dict(body.model_extra or {})
        if method == "never" and logprobs is not None:
            for name in ("logprobs", "top_logprobs"):
                logprobs[name] = extra.pop(name, None)
        for name, (check, why) in REFUSED.items():
            value = extra.pop(name, None)
            if value is not None and not neutral(check, value):
                raise ApiError(400, f"unsupported parameter {name}={json.dumps(value)[:80]}: {why}", name,
                               "unsupported_parameter")
        # accepted and not applied (greedy answers), but refused out of range as the plain completions refuse them:
        # a client's mistake is said, not silently ignored
        check_sampling(body.temperature, body.top_p)
        ignored += [n for n in IGNORED_DECLARED if getattr(body, n) is not None]
        ignored += [n for n in IGNORED_EXTRA if extra.pop(n, None) is not None]
        extra = {k: v for k, v in extra.items() if v is not None}  # null: the default, as for OpenAI's fields
        params = dict(body.params or {})
        twice = sorted(set(params) & set(extra))
        if twice:
            raise ApiError(400, f"parameter {twice[0]} is given both in params and beside it", twice[0],
                           "invalid_value")
        return method, {**params, **extra}

    def submit(self, question: str, method: str, params: dict[str, Any], max_tokens: int | None,
               listener: Callable[[dict], None] | None = None, answer_tokens: bool = False,
               field: str = "messages") -> Future:
        """Queue the question (the request's ``field``: ``messages`` or ``prompt``); :class:`ApiError` when the
        service refuses it, naming the offending field where the error says which."""
        try:
            return self.service.submit(question, method, params, max_tokens, listener=listener,
                                       answer_tokens=answer_tokens)
        except FastgateError as exc:
            err = self.errors.error(exc, openai=True, queued=False)
            if err.param is None:
                err.param = _param_of(str(exc), field)
            raise err from None

    def extension(self, record: dict[str, Any], ignored: list[str]) -> dict[str, Any]:
        """The response's ``fastgate`` object: the record, the replica and the ignored fields."""
        return {**finite(record), "replica": self.replica, "ignored": ignored}

    async def answer(self, chat: bool, body: OpenAIRequest, question: str, max_tokens: int | None,
                     ignored: list[str], request: Request) -> Any:
        """The gated answer to ``question`` as a chat completion (``chat``) or a completion, streamed if asked."""
        t0 = time.perf_counter()
        asked: dict[str, Any] = {}
        method, params = self.options(body, ignored, asked)
        top = _never_logprobs(chat, asked)  # None: no logprobs; else how many top alternatives (0 or 1)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream and top is not None:
            raise ApiError(400, "logprobs are not streamed: ask without stream", "logprobs", "unsupported_parameter")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self.stream(chat, rid, created, body.model, question, method, params, max_tokens, ignored,
                               include_usage, request, t0)
        future = self.submit(question, method, params, max_tokens, answer_tokens=top is not None,
                             field="messages" if chat else "prompt")
        try:
            record = await wait_answer(self.service, future, self.timeout_s, request)
        except Exception as exc:  # noqa: BLE001 - reported, the server keeps serving
            raise self.errors.error(exc, openai=True) from None
        tokens = record.pop("_answer_tokens", None)
        logprobs = None
        if top is not None and tokens is not None:  # the greedy answer: its chosen tokens are the top ones
            pieces, lps = tokens
            alts = [[(p, lp)] for p, lp in zip(pieces, lps)] if top else None
            logprobs = chat_logprobs(pieces, lps, alts) if chat else completion_logprobs(pieces, lps, alts,
                                                                                         stripped=True)
        answer, finish = record["answer"], record.get("finish_reason", "stop")
        choice = {"index": 0, "message": {"role": "assistant", "content": answer}} if chat else \
            {"index": 0, "text": answer}
        response = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": body.model, "choices": [{**choice, "finish_reason": finish, "logprobs": logprobs}],
                    "usage": usage(record), "fastgate": self.extension(record, ignored)}
        self.metrics.count(200)  # once the response is built (an error building it is a 500, counted as such)
        self.metrics.observe(time.perf_counter() - t0)
        return response

    def stream(self, chat: bool, rid: str, created: int, model: str, question: str, method: str,
               params: dict[str, Any], max_tokens: int | None, ignored: list[str], include_usage: bool,
               request: Request, t0: float) -> StreamingResponse:
        """The answer as server-sent events (see the module docstring); refused before any byte is streamed."""
        events = Events()
        future = self.submit(question, method, params, max_tokens, events.listener,
                             field="messages" if chat else "prompt")
        events.follow(future)
        service, timeout_s = self.service, self.timeout_s

        async def events_then_answer():
            text = AnswerStream()
            deadline = time.monotonic() + timeout_s
            counted = False  # the stream's outcome was counted (200, or its error event's status): else 499 at the end
            try:
                if chat:
                    yield sse(chunk(chat, rid, created, model, role=True))
                while True:
                    try:
                        event = await events.get(POLL_S)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return  # the finally clause cancels the program
                        if time.monotonic() > deadline:
                            service.cancel(future)
                            counted = True  # 504, counted by openai_event: not a client gone away too
                            yield sse(self.errors.openai_event(NotAnswered(timeout_s)))
                            yield "data: [DONE]\n\n"
                            return
                        continue
                    if event is Events.END:
                        break
                    if event["event"] == "answer":
                        delta = text.update(event["text"], event["stop"], event["done"])
                        if delta:
                            yield sse(chunk(chat, rid, created, model, delta))
                    else:
                        yield sse(chunk(chat, rid, created, model, ext=finite(event)))
                try:
                    record = future.result()
                except Exception as exc:  # noqa: BLE001 - the stream has started: the error is its last event
                    counted = True
                    yield sse(self.errors.openai_event(exc))
                    yield "data: [DONE]\n\n"
                    return
                rest = text.finish(record["answer"])
                if rest:
                    yield sse(chunk(chat, rid, created, model, rest))
                yield sse(chunk(chat, rid, created, model, finish=record.get("finish_reason", "stop"),
                                ext={"event": "done", **self.extension(record, ignored)}))
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": created, "model": model, "choices": [], "usage": usage(record)})
                yield "data: [DONE]\n\n"
                counted = True
                self.metrics.count(200)
                self.metrics.observe(time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - a chunk that could not be built: the headers (200) are sent,
                counted = True  # so the error is the stream's last event, as a failed program's is, then [DONE]
                yield sse(self.errors.openai_event(exc))
                yield "data: [DONE]\n\n"
            finally:  # the client went away (the response task is cancelled) or the stream ended
                if not future.done():
                    service.cancel(future)
                if not counted:  # the client went away, before or after its answer was ready: counted as a
                    self.errors.count(499)  # non-streamed request's is

        return StreamingResponse(events_then_answer(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _param_of(message: str, field: str) -> str | None:
    """The request field a service error names (OpenAI's ``param``): the question's (``field``), ``max_tokens`` or a
    method parameter; None where it names none."""
    if message.startswith(("the question", "a question", "question ")):
        return field
    if message.startswith("max_tokens"):
        return "max_tokens"
    named = re.match(r"(?:unknown parameter\(s\) for \S+: |parameter '?)([A-Za-z_]\w*)", message)
    return named.group(1) if named else None


def usage(record: dict[str, Any]) -> dict[str, int]:
    """``usage`` of a gated answer: prompt and completion tokens over every LM call of the question."""
    prompt, completion = int(record.get("prompt_tokens", 0)), int(record.get("generated_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _never_logprobs(chat: bool, asked: dict[str, Any]) -> int | None:
    """How many top alternatives fastgate-never returns per token (0 or 1), or None when no logprobs are asked for:
    the chat format's ``logprobs: true`` + ``top_logprobs``, the completions format's integer ``logprobs``."""
    lp, top = asked.get("logprobs"), asked.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise ApiError(400, "logprobs must be true or false", "logprobs", "invalid_value")
        if top is not None and not lp and not is_int(top, 0):
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        n = 0 if top is None else top
        if not lp:
            return None
    else:
        if top is not None and not is_int(top, 0):
            raise ApiError(400, "top_logprobs is a chat field; completions take an integer logprobs", "top_logprobs",
                           "invalid_value")
        if lp is None:
            return None
        n = lp
    if not (isinstance(n, int) and not isinstance(n, bool)) or not 0 <= n <= 1:
        raise ApiError(400, "fastgate-never returns logprobs of its answer's tokens with at most one top "
                       "alternative (its greedy choice); plain completions of the LM (its own model name) return up "
                       "to 5", "top_logprobs" if chat else "logprobs", "invalid_value")
    return n


def add_openai_routes(app: Any, serving: OpenAIServing, chat_request: type[ChatCompletionRequest],
                      completion_request: type[CompletionRequest]) -> None:
    """Register the OpenAI-compatible endpoints of ``serving`` on ``app``; the request models are the server's
    (their limits: :func:`~fastgate.entrypoints.http.protocol.server_models`)."""

    async def chat_completions(body: chat_request, request: Request) -> Any:  # type: ignore[valid-type]
        return await serving.chat_completions(body, request)

    async def completions(body: completion_request, request: Request) -> Any:  # type: ignore[valid-type]
        return await serving.completions(body, request)

    async def models() -> Any:
        return serving.models()

    async def model(model_id: str) -> Any:  # the OpenAI client's models.retrieve
        try:
            return serving.model(model_id)
        except ApiError as exc:
            return serving.errors.openai(exc)

    app.post("/v1/chat/completions", response_model=ChatCompletion, responses=OPENAI_RESPONSES)(chat_completions)
    app.post("/v1/completions", response_model=Completion, responses=OPENAI_RESPONSES)(completions)
    app.get("/v1/models", response_model=ModelList)(models)
    app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=OPENAI_RESPONSES)(model)

