"""HTTP serving: ``fastgate serve`` (FastAPI + uvicorn) in front of an :class:`~fastgate.service.AnswerService`.

Endpoints: ``POST /v1/answer`` (the ``fastgate ask --json`` record), the OpenAI-compatible
``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models`` with streaming
(:mod:`fastgate.openai_api`; OpenAI-style error bodies and 400 for invalid input there), ``GET /healthz``,
``GET /metrics`` (Prometheus) and the OpenAPI schema at ``/openapi.json``. Status codes: 422 invalid input (with a
message saying what is wrong), 503 + ``Retry-After`` when the queue is full, 504 when a request is not answered within
the timeout, 500 only for an internal failure (the server keeps running). Non-finite gate scores (an eigenscore with
no valid sample is +inf) are sent as ``null``: JSON has no infinity.
"""

# no `from __future__ import annotations`: FastAPI and pydantic read the annotations of the models and endpoints
# defined inside create_app at runtime
import asyncio
import math
import os
import time
from typing import Any

from fastgate.errors import FastgateError, InputError
from fastgate.service import AnswerService, OverloadedError

__all__ = ["create_app", "serve"]


def _lazy_imports():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError as exc:
        raise InputError(f"serving needs {exc.name}: pip install 'fastgate[serve]'") from None


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def create_app(service: AnswerService, timeout_s: float | None = None, replica: str | None = None):
    """The FastAPI application serving ``service`` (which the caller starts and stops); ``replica`` names this server
    process in OpenAI responses and ``/healthz`` (Ray Serve runs several)."""
    _lazy_imports()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

    from fastgate.openai_api import OPENAI_PATHS, add_openai_routes, openai_error, validation_message

    cfg = service.config
    timeout = timeout_s if timeout_s is not None else cfg.timeout_s

    class AnswerRequest(BaseModel):
        """A question to answer with gated retrieval."""

        model_config = ConfigDict(extra="forbid")
        question: StrictStr = Field(min_length=1, max_length=cfg.max_question_chars,
                                    description="the question (whitespace-only questions are refused)")
        method: StrictStr | None = Field(None, max_length=64,
                                         description=f"never | always | flare | probing | dtr | seakr | scaar | cbdr "
                                                     f"(default: {cfg.method})")
        params: dict[StrictStr, StrictBool | StrictInt | StrictFloat | StrictStr] | None = Field(
            None, description="method parameters (see `fastgate methods`), e.g. {\"k\": 2}")
        max_tokens: StrictInt | None = Field(None, ge=1, le=cfg.max_tokens_limit, description="maximum answer tokens")

    class Passage(BaseModel):
        id: str
        title: str
        score: float | None

    class GateStepModel(BaseModel):
        gate: str
        score: float | None
        threshold: float | None
        retrieve: bool

    class AnswerResponse(BaseModel):
        """The same object as ``fastgate ask --json``."""

        method: str
        question: str
        answer: str
        retrieved: bool
        passages: list[Passage]
        retrieval_calls: int
        lm_calls: int
        generated_tokens: int
        gate_steps: list[GateStepModel]
        timings: dict[str, float | None]
        truncated: bool
        prompt_tokens: int
        finish_reason: str
        model: str
        retriever: str | None

    class ErrorResponse(BaseModel):
        error: str

    registry = CollectorRegistry()
    requests_total = Counter("fastgate_requests_total", "HTTP answer requests by status code", ["status"],
                             registry=registry)
    latency = Histogram("fastgate_request_latency_seconds", "answer request latency", registry=registry,
                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128))
    rows = Histogram("fastgate_generation_rows",
                     "sequences per decode step (per closed generation call without the decode loop)",
                     registry=registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    class_latency = Histogram("fastgate_answer_latency_seconds", "submit-to-answer latency by whether it retrieved",
                              ["retrieved"], registry=registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128))
    live = Gauge("fastgate_live_programs", "requests whose programs are running", registry=registry)
    gen_calls = Gauge("fastgate_generation_calls_total",
                      "decode steps (closed generation calls without the decode loop)", registry=registry)
    shared_calls = Gauge("fastgate_shared_generation_calls_total",
                         "decode steps whose rows came from programs of more than one method", registry=registry)
    ticks = Gauge("fastgate_scheduler_ticks_total", "scheduler ticks that ran requests", registry=registry)
    cancelled = Gauge("fastgate_cancelled_total", "requests whose programs were cancelled (timeout, disconnect)",
                      registry=registry)
    answered = Gauge("fastgate_answered_total", "questions answered", registry=registry)
    retrieved = Gauge("fastgate_retrieved_total", "answered questions that read retrieved passages",
                      registry=registry)
    searches = Gauge("fastgate_searches_total", "retrieval calls: searches, read or not (the read gate searches "
                     "every question)", registry=registry)
    retrieval_rate = Gauge("fastgate_retrieval_rate", "retrieved / answered", registry=registry)
    depth = Gauge("fastgate_queue_depth", "requests waiting for a batch", registry=registry)

    app = FastAPI(title="fastgate", version=_version(),
                  description="Adaptive retrieval-augmented generation gated on the model's own signals.")
    error_responses = {422: {"model": ErrorResponse}, 503: {"model": ErrorResponse}, 504: {"model": ErrorResponse}}

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        requests_total.labels(str(status)).inc()
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path in OPENAI_PATHS:  # OpenAI clients expect 400 and their error shape
            message, param = validation_message(exc)
            requests_total.labels("400").inc()
            return JSONResponse(openai_error(400, message, param, "invalid_value"), status_code=400)
        parts = []
        for e in exc.errors()[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            parts.append(f"{where}: {e.get('msg', 'invalid')}")
        return error(422, "invalid request: " + "; ".join(parts))

    @app.post("/v1/answer", response_model=AnswerResponse, responses=error_responses)
    async def answer(body: AnswerRequest) -> Any:
        t0 = time.perf_counter()
        try:
            future = service.submit(body.question, body.method, body.params, body.max_tokens)
        except OverloadedError as exc:
            return error(503, str(exc), {"Retry-After": str(exc.retry_after_s)})
        except InputError as exc:
            return error(422, str(exc))
        except FastgateError as exc:  # e.g. the service is stopping
            return error(503, str(exc), {"Retry-After": "5"})
        try:
            record = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
        except asyncio.TimeoutError:
            service.cancel(future)  # dropped if queued, else its program stops at the next tick
            return error(504, f"not answered within {timeout:g} s")
        except InputError as exc:
            return error(422, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported, the server keeps serving
            return error(500, f"internal error: {type(exc).__name__}: {exc}")
        requests_total.labels("200").inc()
        latency.observe(time.perf_counter() - t0)
        return _finite(record)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok" if service.running else "stopped", "model": service.model_name,
                "dtype": service.dtype_name, "step": service.step_name, "method": cfg.method,
                "queue_depth": service.queue_depth,
                "live_programs": service.live_programs, "kv_budget_mb": cfg.kv_budget_mb,
                "kv_used_mb": round(service.kv_used_bytes / 2**20, 1), "layout": service.layout, "replica": replica,
                "pid": os.getpid()}

    add_openai_routes(app, service, timeout, count=lambda status: requests_total.labels(str(status)).inc(),
                      observe=latency.observe, replica=replica)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        m = service.metrics
        new_rows, latencies = m.drain()
        for n in new_rows:
            rows.observe(n)
        for was_retrieved, seconds in latencies:
            class_latency.labels("yes" if was_retrieved else "no").observe(seconds)
        live.set(service.live_programs)
        gen_calls.set(m.generation_calls)
        shared_calls.set(m.shared_generation_calls)
        ticks.set(m.ticks_total)
        cancelled.set(m.cancelled)
        answered.set(m.answered)
        retrieved.set(m.retrieved)
        searches.set(m.searches)
        retrieval_rate.set(m.retrieved / m.answered if m.answered else 0.0)
        depth.set(service.queue_depth)
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app


def _version() -> str:
    from fastgate import __version__

    return __version__


def serve(service: AnswerService, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Start ``service``, serve it over HTTP until interrupted, then drain and stop it."""
    _lazy_imports()
    import uvicorn

    app = create_app(service)
    service.start()
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        service.stop()
