"""The one error map of ``fastgate serve``: which status code and message an exception becomes, for every endpoint.

- an :class:`ApiError` a route raises: its own status;
- ``OverloadedError`` (the queue is full): 503 with ``Retry-After`` (the service's estimate), code ``overloaded``;
- ``InputError``, ``CheckpointError``: 422 natively, 400 on the OpenAI endpoints, code ``invalid_value``;
- ``RemoteError`` (the server behind a remote engine failed, after its retries): 502, code ``upstream_error``;
- ``OutOfMemory`` (a tick could not allocate what its batch needed; the server serves on): 503 with ``Retry-After``,
  code ``out_of_memory``;
- :class:`~fastgate.entrypoints.http.common.ClientGone` (the client closed the connection before its answer; the
  request is cancelled): 499, code ``client_closed`` (nobody reads it: counted in the metrics);
- :class:`~fastgate.entrypoints.http.common.NotAnswered` (the HTTP timeout) and the scheduler's ``CancelledError`` (the
  service's own timeout): 504 ``not answered within N s``, code ``timeout``;
- any other ``FastgateError`` raised while submitting (e.g. the service is stopping): 503 with ``Retry-After: 5``,
  code ``unavailable``;
- anything else: 500 ``internal error: <type>: <message>``, code ``internal_error`` (the server keeps serving).

Invalid request bodies (FastAPI's validation) get 422 on the native endpoints and 400 on the OpenAI ones; a body
larger than ``ServiceConfig.max_body_bytes`` gets 413, code ``body_too_large``, before more of it is read (a question
is at most 4,000 characters: nothing valid comes near 1 MiB, and without a bound uvicorn holds any body whole). The two
formats: native ``{"error": message}``; OpenAI ``{"error": {"message", "type", "param", "code"}}``. Every error
response is counted in the app's metrics by its status.

Imports :mod:`fastgate.entrypoints.http.common` and :mod:`fastgate.entrypoints.http.protocol`; the routes
(:mod:`fastgate.entrypoints.http.answer`, :mod:`fastgate.entrypoints.http.openai`,
:mod:`fastgate.entrypoints.http.plain`,
:mod:`fastgate.entrypoints.http.streaming`) call :class:`ErrorMap`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastgate.entrypoints.http.common import OPENAI_PATHS, ClientGone, NotAnswered
from fastgate.entrypoints.http.protocol import ErrorBody, ErrorResponse
from fastgate.errors import CheckpointError, FastgateError, InputError, OutOfMemory, RemoteError
from fastgate.scheduler import CancelledError as ProgramCancelled
from fastgate.serving.service import OverloadedError

_log = logging.getLogger(__name__)

__all__ = ["NATIVE_RESPONSES", "OPENAI_RESPONSES", "ApiError", "BodyLimit", "ErrorMap", "openai_error",
           "validation_message"]

# the error responses each endpoint documents in /openapi.json
NATIVE_RESPONSES: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (422, 502, 503, 504)}
OPENAI_RESPONSES: dict[int | str, dict[str, Any]] = {s: {"model": ErrorBody} for s in (400, 404, 500, 502, 503, 504)}


class ApiError(Exception):
    """An error response: status, message and, in OpenAI's format, the offending field and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
            413: "invalid_request_error",
            502: "upstream_error", 503: "overloaded_error",
            504: "timeout_error"}.get(status, "server_error")


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The body of an OpenAI-style error."""
    return {"error": {"message": message, "type": _error_type(status), "param": param, "code": code}}


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending field of a FastAPI ``RequestValidationError``."""
    parts, param = [], None
    for e in exc.errors()[:5]:
        if e.get("type") == "json_invalid":  # its loc is ("body", offset): a place in the text, not a field
            offset = [x for x in e.get("loc", ()) if x != "body"]
            parts.append(f"the body is not valid JSON{f' at character {offset[0]}' if offset else ''} "
                         f"({(e.get('ctx') or {}).get('error', e.get('msg', 'invalid'))})")
            continue
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts), param


class ErrorMap:
    """The map of one app (see the module docstring), counting every error response it writes.

    Args:
        service_timeout_s: the service's own timeout (``ServiceConfig.timeout_s``), named when it cancels a program.
        count: called with the status code of every error response (metrics).
    """

    def __init__(self, service_timeout_s: float, count: Callable[[int], None]) -> None:
        self.service_timeout_s = service_timeout_s
        self.count = count

    def error(self, exc: BaseException, *, openai: bool, queued: bool = True) -> ApiError:
        """What ``exc`` becomes; ``openai``: the OpenAI endpoints (invalid input is 400 there, 422 natively);
        ``queued``: raised once the request was queued (while answering), else by submitting it."""
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, OverloadedError):
            return ApiError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after_s)})
        if isinstance(exc, (InputError, CheckpointError)):
            return ApiError(400 if openai else 422, str(exc), code="invalid_value")
        if isinstance(exc, NotAnswered):
            return ApiError(504, str(exc), code="timeout")
        if isinstance(exc, OutOfMemory):  # a batch too big for the memory: the server serves on, a retry may pass
            return ApiError(503, str(exc), code="out_of_memory", headers={"Retry-After": "5"})
        if isinstance(exc, RemoteError):  # the server behind a remote engine failed: not this server's fault
            return ApiError(502, str(exc), code="upstream_error")
        if isinstance(exc, ClientGone):  # nobody reads it; nginx's status for it, counted as such in the metrics
            return ApiError(499, str(exc), code="client_closed")
        if isinstance(exc, ProgramCancelled):  # the service's own timeout
            return ApiError(504, f"not answered within {self.service_timeout_s:g} s", code="timeout")
        if isinstance(exc, FastgateError) and not queued:  # e.g. the service is stopping
            return ApiError(503, str(exc), code="unavailable", headers={"Retry-After": "5"})
        if not getattr(exc, "fastgate_logged", False):  # the operator's traceback, once (a failed tick's error
            _log.error("internal error answering a request", exc_info=exc)  # is every request's of that tick, and
            with contextlib.suppress(AttributeError):  # the service logged it already)
                exc.fastgate_logged = True  # type: ignore[attr-defined]
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")

    def native(self, exc: BaseException, *, queued: bool = True) -> JSONResponse:
        """The native error response (``{"error": message}``) of ``exc``."""
        err = self.error(exc, openai=False, queued=queued)
        self.count(err.status)
        return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)

    def openai(self, exc: BaseException, *, queued: bool = True, headers: dict[str, str] | None = None
               ) -> JSONResponse:
        """The OpenAI error response of ``exc`` (with ``headers`` too: a 405's ``Allow``)."""
        err = self.error(exc, openai=True, queued=queued)
        self.count(err.status)
        return JSONResponse(openai_error(err.status, err.message, err.param, err.code), status_code=err.status,
                            headers={**(headers or {}), **(err.headers or {})} or None)

    def openai_event(self, exc: BaseException) -> dict[str, Any]:
        """The OpenAI error body of ``exc`` as a stream's last event (the status is sent already: 200), with the
        param and code the same error has outside a stream (``timeout``, ``invalid_value``...); counted in the metrics
        under the status it stands for, the request's outcome."""
        err = self.error(exc, openai=True)
        self.count(err.status)
        return openai_error(err.status, err.message, err.param, err.code)

    def install(self, app: Any, max_body_bytes: int | None = None) -> None:
        """Answer invalid request bodies on ``app``: 400 in OpenAI's format on its paths (OpenAI clients expect it),
        else 422 natively; bodies over ``max_body_bytes`` with 413 (:class:`BodyLimit`)."""
        if max_body_bytes is not None:
            app.add_middleware(BodyLimit, max_bytes=max_body_bytes, errors=self)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            message, param = validation_message(exc)
            if request.url.path in OPENAI_PATHS:
                return self.openai(ApiError(400, message, param, "invalid_value"))
            return self.native(ApiError(422, message))

        @app.exception_handler(Exception)
        async def _internal(request: Request, exc: Exception) -> JSONResponse:
            # an error no route mapped (the routes catch their own: this is a response FastAPI could not render): a
            # 500 in the path's own format where Starlette would answer plain text. Not counted: Starlette's
            # ServerErrorMiddleware calls this after a response started too (a client gone mid-stream; the route
            # counted that request), sending nothing then; it logs the traceback itself
            message = f"internal error: {type(exc).__name__}: {exc}"
            if request.url.path in OPENAI_PATHS:
                return JSONResponse(openai_error(500, message, None, "internal_error"), status_code=500)
            return JSONResponse({"error": message}, status_code=500)

        @app.exception_handler(StarletteHTTPException)
        async def _unparsed(request: Request, exc: StarletteHTTPException):
            # FastAPI answers a body it cannot decode at all (not UTF-8) with a bare 400 {"detail": ...}, raised from
            # the UnicodeDecodeError; such a body is invalid input like any other: the path's own error format and
            # status. A path or method OpenAI's API has and this server does not (/v1/embeddings, GET
            # /v1/chat/completions) gets OpenAI's format, which its clients read; every other HTTP error stays
            # FastAPI's.
            path = request.url.path
            if isinstance(exc.__cause__, _TooLarge):  # FastAPI turned BodyLimit's error into a 400 "error parsing"
                return exc.__cause__.response(path, self)
            if exc.status_code == 405 and path == "/v1/answer":  # the native endpoint's own format
                return self.native(ApiError(405, f"{request.method} is not allowed here: POST /v1/answer",
                                            headers=exc.headers))
            if exc.status_code in (404, 405) and path.startswith("/v1/") and path != "/v1/answer":
                what = "no such endpoint" if exc.status_code == 404 else f"{request.method} is not allowed here"
                return self.openai(ApiError(exc.status_code, f"{what}: {request.method} {path} (this server has "
                                            "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET "
                                            "/v1/models/{id})",
                                            None, "not_found" if exc.status_code == 404 else "method_not_allowed"),
                                   headers=exc.headers)
            # FastAPI's body parsing raises its 400 from what failed: not UTF-8, or a JSON parser's error (a body
            # nested 100,000 deep: RecursionError); any such cause is the body's fault
            if exc.status_code != 400 or exc.__cause__ is None:
                return await http_exception_handler(request, exc)
            why = "not UTF-8" if isinstance(exc.__cause__, UnicodeDecodeError) else type(exc.__cause__).__name__
            message = f"invalid request: the body is not JSON in UTF-8 ({exc.detail}: {why})"
            if request.url.path in OPENAI_PATHS:
                return self.openai(ApiError(400, message, None, "invalid_value"))
            return self.native(ApiError(422, message))


class _TooLarge(Exception):
    """Raised from a request's ``receive`` once its body passed the limit (FastAPI's body parsing re-raises it as a
    400 HTTPException from it: :meth:`ErrorMap.install`'s handler answers that one)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"request body too large: at most {max_bytes:,} bytes")

    def response(self, path: str, errors: ErrorMap) -> JSONResponse:
        """The 413 response in ``path``'s error format; the connection is closed (the rest of the body is unread)."""
        err = ApiError(413, str(self), None, "body_too_large", headers={"Connection": "close"})
        return errors.openai(err) if path in OPENAI_PATHS else errors.native(err)


class BodyLimit:
    """ASGI middleware: a request whose body is larger than ``max_bytes`` gets 413 (in its path's error format).

    A declared ``Content-Length`` over the limit is refused before anything is read; a chunked body is counted as it
    arrives and refused at the first message past the limit (the route reading it never sees the rest). A plain ASGI
    middleware, not a ``BaseHTTPMiddleware``: that one would buffer streamed responses."""

    def __init__(self, app: Any, max_bytes: int, errors: ErrorMap) -> None:
        self.app, self.max_bytes, self.errors = app, max_bytes, errors

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen, started = 0, False

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:  # raised through a route that reads its body itself (FastAPI's parsing: the handler's 400)
            if started:  # a route answered before reading its whole body: nothing left to say
                return
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        await _TooLarge(self.max_bytes).response(scope.get("path", ""), self.errors)(scope, receive, send)
