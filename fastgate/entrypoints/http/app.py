"""The FastAPI application of ``fastgate serve`` and the uvicorn server running it.

:func:`create_app` builds the app on an :class:`~fastgate.serving.service.AnswerService`: the request models with the
service's limits (:func:`fastgate.entrypoints.http.protocol.server_models`), one error map and one metrics registry
shared by every route, the native routes (:mod:`fastgate.entrypoints.http.answer`), the OpenAI-compatible ones
(:mod:`fastgate.entrypoints.http.openai`), ``GET /healthz`` and ``GET /metrics``. FastAPI serves the schema at
``/openapi.json``.

The serving extras (FastAPI, pydantic, prometheus-client) are imported once they are known to be installed, so that a
missing one is reported with its install hint.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime
import os
import sys
import time
from typing import Any

from fastgate.entrypoints import DEFAULT_HOST, DEFAULT_PORT
from fastgate.entrypoints.http.common import require_serving, version

__all__ = ["create_app", "serve"]


def create_app(service: Any, timeout_s: float | None = None, replica: str | None = None) -> Any:
    """The FastAPI application serving ``service`` (which the caller starts and stops); ``timeout_s``: the HTTP
    timeout (default: the service's); ``replica`` names this server process in OpenAI responses and ``/healthz`` (Ray
    Serve runs several)."""
    require_serving()
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    from fastgate.entrypoints.http.answer import add_answer_routes
    from fastgate.entrypoints.http.errors import ErrorMap
    from fastgate.entrypoints.http.metrics import CONTENT_TYPE_LATEST, HttpMetrics
    from fastgate.entrypoints.http.openai import OpenAIServing, add_openai_routes
    from fastgate.entrypoints.http.protocol import server_models

    cfg = service.config
    timeout = timeout_s if timeout_s is not None else cfg.timeout_s
    models = server_models(cfg)
    http_metrics = HttpMetrics()
    errors = ErrorMap(cfg.timeout_s, http_metrics.count)

    app = FastAPI(title="fastgate", version=version(),
                  description="Adaptive retrieval-augmented generation gated on the model's own signals.")
    errors.install(app, cfg.max_body_bytes)
    add_answer_routes(app, service, models.answer, timeout, errors, http_metrics)

    @app.get("/healthz")
    async def healthz() -> Any:
        # 503 once the scheduler stopped: a load balancer or liveness probe reads the status code, not the body
        return JSONResponse(status_code=200 if service.running else 503, content={
                "status": "ok" if service.running else "stopped", "model": service.model_name,
                "dtype": service.dtype_name, "weights": service.weights_name, "step": service.step_name,
                "method": cfg.method, "queue_depth": service.queue_depth,
                "live_programs": service.live_programs, "kv_budget_mb": cfg.kv_budget_mb,
                "kv_used_mb": round(service.kv_used_bytes / 2**20, 1), "layout": service.layout,
                "device": service.device_name, "device_reserved_mb": None if (held := service.device_reserved_bytes)
                is None else round(held / 2**20, 1), "replica": replica, "pid": os.getpid()})

    openai = OpenAIServing(service, timeout, errors, http_metrics, replica)
    add_openai_routes(app, openai, models.chat, models.completion)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(http_metrics.render(service), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(service: Any, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, log_level: str = "info") -> None:
    """Start ``service``, serve it over HTTP until interrupted, then drain and stop it."""
    require_serving()
    import uvicorn

    _check_port(host, port)  # before the model loads: a busy port is known in a millisecond
    app = create_app(service)
    started = time.perf_counter()
    service.start()
    if log_level in ("info", "debug", "trace"):
        warm = f" (warm-up {service.warmup_s:.1f} s)" if getattr(service, "warmup_s", None) is not None else ""
        print(f"fastgate: ready in {time.perf_counter() - started:.1f} s{warm}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        service.stop()


def _check_port(host: str, port: int) -> None:
    """Raise :class:`~fastgate.errors.InputError` when ``host:port`` cannot be listened on: every address the host
    resolves to is bound as asyncio's server binds it (``SO_REUSEADDR``; IPv6 sockets IPv6 only; ``""``: every
    interface)."""
    import errno
    import socket

    from fastgate.errors import InputError

    if not 0 <= port <= 65535:  # getaddrinfo would wrap it
        raise InputError(f"port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a socket in TIME_WAIT is no conflict
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                hint = " (another server on that port? pass --port)" if exc.errno == errno.EADDRINUSE else ""
                raise InputError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
