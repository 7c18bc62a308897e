"""Plain completions on ``POST /v1/completions``: the LM's own name as ``model`` completes the prompt as it is, like
any inference server (``max_tokens`` default 16, ``temperature`` 0 greedy / default 1, ``top_p``, ``top_k``,
``seed``, ``stop`` up to 8, ``ignore_eos``, ``logprobs`` up to 5), with every generated token's log-probability and
the stop string as ``stop_reason`` (as vLLM names it). This is what a remote engine (:mod:`fastgate.engine.remote`) of
another fastgate calls. Not streamed; not on a server that itself generates remotely.

Calls :meth:`AnswerService.submit_completion <fastgate.serving.service.AnswerService.submit_completion>` (the program is
:mod:`fastgate.serving.completion`'s) and :mod:`fastgate.entrypoints.http.logprobs`; errors go through
:class:`~fastgate.entrypoints.http.errors.ErrorMap`. :class:`fastgate.entrypoints.http.openai.OpenAIServing` routes
here.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from typing import Any

from fastgate.config import GenerationConfig
from fastgate.entrypoints.http.common import MODEL_PREFIX, wait_answer
from fastgate.entrypoints.http.errors import ApiError, ErrorMap
from fastgate.entrypoints.http.logprobs import completion_logprobs
from fastgate.entrypoints.http.metrics import HttpMetrics
from fastgate.entrypoints.http.protocol import IGNORED_EXTRA, REFUSED, CompletionRequest, is_int, neutral
from fastgate.errors import FastgateError
from fastgate.serving.completion import MAX_TOP_LOGPROBS

__all__ = ["check_sampling", "is_plain_model", "plain_completion"]

_REFUSED_HERE = ("n", "best_of", "echo", "suffix", "presence_penalty", "frequency_penalty", "logit_bias")


def is_plain_model(service: Any, model: str) -> bool:
    """Whether ``model`` names the LM itself: plain completions (not on a remote engine)."""
    return model == service.model_name and not model.startswith(MODEL_PREFIX) and model != "fastgate" and \
        service.runtime.remote is None


def check_sampling(temperature: float | None, top_p: float | None) -> None:
    """OpenAI's ranges of ``temperature`` (0 to 2) and ``top_p`` (above 0, at most 1), NaN refused; None: not given.
    Plain completions apply them; the gated methods' routes accept and ignore them, refused out of range all the same.

    Raises:
        ApiError: 400 naming the field."""
    if temperature is not None and not 0 <= temperature <= 2:
        raise ApiError(400, "temperature must be between 0 and 2", "temperature", "invalid_value")
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(400, "top_p must be in (0, 1]", "top_p", "invalid_value")


def _config(body: CompletionRequest) -> tuple[GenerationConfig, int | None]:
    """The generation asked for and the number of top log-probabilities (None: no logprobs); :class:`ApiError` for a
    field out of range or not supported."""
    extra = dict(body.model_extra or {})
    if body.stream:
        raise ApiError(400, "plain completions are not streamed: ask without stream", "stream", "unsupported_parameter")
    if body.params:
        raise ApiError(400, "plain completions take no method parameters", "params")
    logprobs = extra.pop("logprobs", None)
    if logprobs is not None and not (is_int(logprobs, logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}", "logprobs",
                       "invalid_value")
    stop = extra.pop("stop", None)
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or len(stop) > 8
                             or any(not isinstance(x, str) or not x or len(x) > 64 for x in stop)):
        raise ApiError(400, "stop must be a non-empty string or a list of at most 8 of them", "stop", "invalid_value")
    top_k = extra.pop("top_k", None)
    if top_k is not None and not (is_int(top_k, top_k) and 0 <= top_k <= 1000) and top_k != -1:
        raise ApiError(400, "top_k must be an integer between 0 and 1000 (or -1: off)", "top_k", "invalid_value")
    ignore_eos = extra.pop("ignore_eos", None)
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be a boolean", "ignore_eos", "invalid_value")
    for name in _REFUSED_HERE:
        value = extra.pop(name, None)
        if value is not None and not neutral(REFUSED[name][0], value):
            raise ApiError(400, f"unsupported parameter {name}={json.dumps(value)[:80]}: {REFUSED[name][1]}", name,
                           "unsupported_parameter")
    for name in IGNORED_EXTRA:
        extra.pop(name, None)
    unknown = sorted(k for k, v in extra.items() if v is not None)
    if unknown:
        raise ApiError(400, f"unsupported parameter {unknown[0]} for a plain completion", unknown[0],
                       "unsupported_parameter")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    check_sampling(temperature, top_p)
    # a sampled completion without a seed draws afresh each time, as OpenAI's and vLLM's do (the engine seeds an
    # unseeded sampled row with 0, the same text for every request); a seed makes it repeatable
    seed = body.seed if body.seed is not None or temperature == 0 else secrets.randbits(63)
    config = GenerationConfig(max_new_tokens=body.max_tokens or 16, do_sample=temperature > 0,
                              temperature=temperature if temperature > 0 else 1.0, top_p=top_p,
                              top_k=max(0, top_k or 0), seed=seed, stop=tuple(stop or ()),
                              stop_at_eos=not ignore_eos)
    return config, logprobs


async def plain_completion(service: Any, body: CompletionRequest, prompt: str, timeout_s: float, errors: ErrorMap,
                           metrics: HttpMetrics, replica: str | None, request: Any = None) -> dict[str, Any]:
    """A plain completion of ``prompt`` by the LM, with token log-probabilities if asked for; :class:`ApiError` when
    it cannot be given. ``request``: the HTTP request (a client that goes away cancels it)."""
    t0 = time.perf_counter()
    try:
        config, logprobs = _config(body)
        future = service.submit_completion(prompt, config, config.seed, logprobs or 0)
    except FastgateError as exc:
        raise errors.error(exc, openai=True, queued=False) from None
    try:
        done = await wait_answer(service, future, timeout_s, request)
    except Exception as exc:  # noqa: BLE001 - reported, the server keeps serving
        raise errors.error(exc, openai=True) from None
    seq = done.generation
    lp = completion_logprobs(done.pieces, seq.token_logprobs, done.top) if logprobs is not None else None
    n_out = len(seq.token_ids)
    response = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": body.model,
                "choices": [{"index": 0, "text": seq.text, "logprobs": lp, "stop_reason": seq.stop_string,
                             "finish_reason": "length" if seq.finish_reason == "length" else "stop"}],
                "usage": {"prompt_tokens": seq.prompt_tokens, "completion_tokens": n_out,
                          "total_tokens": seq.prompt_tokens + n_out},
                "fastgate": {"finish": seq.finish_reason, "truncated": seq.truncated, "replica": replica,
                             "server_s": time.perf_counter() - t0}}
    metrics.count(200)  # once the response is built (the route answers an error building it with a counted 500)
    metrics.observe(time.perf_counter() - t0)
    return response
