"""The native endpoint ``POST /v1/answer``: a question (with an optional method, its parameters and an answer-token
limit) in, the ``fastgate ask --json`` record out, non-finite gate scores as ``null``.

Calls :meth:`AnswerService.submit <fastgate.serving.service.AnswerService.submit>` and waits for the answer within the
HTTP timeout; errors go through :class:`~fastgate.entrypoints.http.errors.ErrorMap` (native format). Registered by
:func:`fastgate.entrypoints.http.app.create_app`.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoint's annotations at runtime
import time
from typing import Any

from fastapi import Request

from fastgate.entrypoints.http.common import finite, wait_answer
from fastgate.entrypoints.http.errors import NATIVE_RESPONSES, ErrorMap
from fastgate.entrypoints.http.metrics import HttpMetrics
from fastgate.entrypoints.http.protocol import AnswerRequest, AnswerResponse
from fastgate.errors import FastgateError

__all__ = ["add_answer_routes", "answer_question"]


async def answer_question(service: Any, body: AnswerRequest, timeout_s: float, errors: ErrorMap,
                          metrics: HttpMetrics, request: Any = None) -> Any:
    """The record answering ``body``, or an error response; ``request``: the HTTP request (a client that goes away
    cancels it)."""
    t0 = time.perf_counter()
    try:
        future = service.submit(body.question, body.method, body.params, body.max_tokens)
    except FastgateError as exc:
        return errors.native(exc, queued=False)
    try:
        record = await wait_answer(service, future, timeout_s, request)
    except Exception as exc:  # noqa: BLE001 - reported, the server keeps serving
        return errors.native(exc)
    try:
        out = finite(record)
    except Exception as exc:  # noqa: BLE001 - a record that cannot be sent: 500, counted
        return errors.native(exc)
    metrics.count(200)
    metrics.observe(time.perf_counter() - t0)
    return out


def add_answer_routes(app: Any, service: Any, request_model: type[AnswerRequest], timeout_s: float, errors: ErrorMap,
                      metrics: HttpMetrics) -> None:
    """Register ``POST /v1/answer`` on ``app``; ``request_model``: the server's :class:`AnswerRequest` (its limits,
    :func:`~fastgate.entrypoints.http.protocol.server_models`)."""

    async def answer(body: request_model, request: Request) -> Any:  # type: ignore[valid-type]
        return await answer_question(service, body, timeout_s, errors, metrics, request)

    # response_model_exclude_unset: the fields the record does not hold stay out (a method's `details`, a remote
    # engine's `weights`), so the body is the `ask --json` object key for key; FastAPI dropped `details` before
    app.post("/v1/answer", response_model=AnswerResponse, response_model_exclude_unset=True,
             responses=NATIVE_RESPONSES)(answer)
