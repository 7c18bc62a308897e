"""HTTP serving: ``fastgate serve`` (FastAPI + uvicorn) in front of an :class:`~fastgate.serving.service.AnswerService`.

Endpoints: ``POST /v1/answer`` (the ``fastgate ask --json`` record; :mod:`fastgate.entrypoints.http.answer`), the
OpenAI-compatible ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models`` with streaming
(:mod:`fastgate.entrypoints.http.openai`; OpenAI-style error bodies and 400 for invalid input there), ``GET /healthz``,
``GET /metrics`` (Prometheus) and the OpenAPI schema at ``/openapi.json``. Status codes
(:mod:`fastgate.entrypoints.http.errors`):
422 invalid input (with a message saying what is wrong), 503 + ``Retry-After`` when the queue is full, 504 when a
request is not answered within the timeout, 500 only for an internal failure (the server keeps running). Non-finite
gate scores (an eigenscore with no valid sample is +inf) are sent as ``null``: JSON has no infinity.

The modules, from the bottom up: :mod:`~fastgate.entrypoints.http.common` (shared helpers, no web framework),
:mod:`~fastgate.entrypoints.http.protocol` (every request and response model), :mod:`~fastgate.entrypoints.http.errors`
(the one map from exceptions to status codes), :mod:`~fastgate.entrypoints.http.metrics`,
:mod:`~fastgate.entrypoints.http.logprobs`,
:mod:`~fastgate.entrypoints.http.streaming` and :mod:`~fastgate.entrypoints.http.plain` (pieces of the OpenAI
responses), the routes (:mod:`~fastgate.entrypoints.http.answer`, :mod:`~fastgate.entrypoints.http.openai`) and
:mod:`~fastgate.entrypoints.http.app` (the app). Importing this
package needs none of the serving extras; :func:`create_app` and :func:`serve` say which one is missing.
"""

from __future__ import annotations

from fastgate.entrypoints.http.app import create_app, serve
from fastgate.entrypoints.http.common import MODEL_PREFIX, OPENAI_PATHS

__all__ = ["MODEL_PREFIX", "OPENAI_PATHS", "create_app", "serve"]
