"""Helpers every module of :mod:`fastgate.entrypoints.http` shares, with no web framework imported: the check that the
serving
extras are installed, waiting for an answer within the HTTP timeout, JSON-safe records (no infinities), server-sent
events, the paths of the OpenAI endpoints and their model-name prefix, and the version the app reports.

Imports nothing of :mod:`fastgate.entrypoints.http` (every other module of the package may import it); calls
:mod:`fastgate.errors` and :func:`fastgate.serving.runtime.finite` only.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import Future
from typing import Any

from fastgate.errors import MissingDependencyError
from fastgate.serving.runtime import finite  # the records' JSON (re-exported: the routes import it from here)

__all__ = ["DISCONNECT_POLL_S", "MODEL_PREFIX", "OPENAI_PATHS", "ClientGone", "NotAnswered", "finite",
           "require_serving", "sse", "version", "wait_answer"]

MODEL_PREFIX = "fastgate-"  # OpenAI model names: fastgate-<method>
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")  # OpenAI's error format and 400 there
# how often a request waiting for its answer checks that its client is still connected (a check costs microseconds)
DISCONNECT_POLL_S = 0.25


def require_serving() -> None:
    """Raise :class:`~fastgate.errors.MissingDependencyError` (a FastgateError and an ImportError) with the install
    hint when the serving extras are missing."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(exc.name or "fastapi", "pip install 'fastgate[serve]'") from None


class NotAnswered(Exception):
    """A request not answered within the HTTP timeout (it has been cancelled)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"not answered within {timeout_s:g} s")
        self.timeout_s = timeout_s


class ClientGone(Exception):
    """The client closed its connection before its answer (the request has been cancelled)."""

    def __init__(self) -> None:
        super().__init__("the client closed the connection before the answer")


async def wait_answer(service: Any, future: Future, timeout_s: float, request: Any = None) -> Any:
    """The result of a submitted request, or :class:`NotAnswered` after ``timeout_s``; the request's own error is
    raised as it is. ``request``: the HTTP request, checked every :data:`DISCONNECT_POLL_S`: a client that went away
    raises :class:`ClientGone`. Either way the request is cancelled (dropped if queued, else its program stops at the
    next tick), so an abandoned request (a remote engine's client that gave up and retries) does no more work. So is
    it when the waiting handler is itself cancelled (``asyncio.CancelledError``, raised on)."""
    waited = asyncio.wrap_future(future)
    waited.add_done_callback(_consume)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                service.cancel(future)
                raise NotAnswered(timeout_s)
            done, _ = await asyncio.wait((waited,), timeout=left if request is None else min(left, DISCONNECT_POLL_S))
            if done:
                return waited.result()
            if request is not None and await request.is_disconnected():
                service.cancel(future)
                raise ClientGone
    except asyncio.CancelledError:
        # the server cancels its handlers on a forced shutdown (uvicorn, at a second SIGINT): their clients already
        # have a 500, and a request left running was answered for nobody by stop(drain=True) (the process lived on
        # 57 s); it stops here as a client's that went away
        service.cancel(future)  # of an answered one: nothing
        raise


def _consume(waited: asyncio.Future) -> None:
    """Read a finished future's error: a request given up and then cancelled has one nobody awaits (asyncio would log
    "Future exception was never retrieved" for each)."""
    if not waited.cancelled():
        waited.exception()


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, default=_scalar)}\n\n"


def _scalar(obj: Any) -> Any:
    """numpy and torch scalars as Python numbers."""
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def version() -> str:
    """fastgate's version, as the app (and its OpenAPI schema) reports it."""
    from fastgate.version import __version__

    return __version__
