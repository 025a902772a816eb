"""Every error answer of kvpool's aiohttp servers (the router and the engines) as a JSON object.

aiohttp answers some requests before any handler or middleware sees them: a request line or a
header it cannot parse, a header line too long, a body that does not match its framing (a
``Content-Length`` shorter than the bytes sent leaves the rest to be parsed as the next request).
Those answers are plain text (``400 Bad Request`` and the parser's message). This module makes
them, and a 404/405 of the routing or an exception a handler leaves, the server's own JSON error
shape.

Contract:
    * ``ErrorBody``: ``(status, message) -> dict``, the JSON error object of one server:
      ``engine_error_body`` gives the engines' ``{"error": reason}``; the router passes its OpenAI
      object (``router.ApiError``'s body).
    * ``runner(app, error_body, **kwargs)``: an ``aiohttp.web.AppRunner`` (same keyword arguments)
      whose every protocol-level error answer is ``error_body(status, reason)`` as JSON, with the
      connection closed (as aiohttp does). The reason is one line of at most 200 characters
      (``400 Bad Request: <the parser's first line>``); a 500 says ``internal error`` and the
      exception's type, never a traceback. A 4xx is not logged as an exception (a client's
      mistake is not the server's error); a 5xx is, as aiohttp logs it.
    * ``read_body(request)``: the body's bytes; a body that breaks its framing (a bad chunk, a
      broken ``Content-Encoding``) is ``HTTPBadRequest`` naming it (a 400, not a 500), one over the
      app's ``client_max_size`` aiohttp's ``HTTPRequestEntityTooLarge`` (413).
    * ``json_errors(error_body)``: a middleware that answers an ``HTTPException`` >= 400 raised by
      the routing or a handler (404, 405, 413 ...) as ``error_body(status, "METHOD PATH: reason")``.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import zlib

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from kvpool.errors import printable

ErrorBody = Callable[[int, str], dict]

#: The longest reason an error answer carries.
MAX_REASON_CHARS = 200


def engine_error_body(status: int, message: str) -> dict:
    """The engines' error object: ``{"error": reason}``."""
    return {"error": message}


def _phrase(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


def protocol_reason(status: int, exc: BaseException | None, message: str | None) -> str:
    """One line naming a protocol-level error: the status, then the parser's first line (a 5xx:
    ``internal error`` and the exception's type)."""
    if status >= 500:
        detail = f"internal error ({type(exc).__name__})" if exc is not None else "internal error"
    else:
        text = message or (getattr(exc, "message", None) if exc is not None else None) or (str(exc) if exc else "")
        lines = [line.strip() for line in str(text).splitlines() if line.strip()]
        detail = lines[0].rstrip(":").strip() if lines else (type(exc).__name__ if exc is not None else "")
    reason = f"{_phrase(status)}: {printable(detail)}" if detail else _phrase(status)
    return reason[:MAX_REASON_CHARS]


class _Handler(RequestHandler):
    """aiohttp's connection handler with JSON error answers (``error_body`` set by ``_Server``)."""

    error_body: ErrorBody = staticmethod(engine_error_body)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            super().handle_error(request, status, exc, message)  # logs it; raises if a response has begun
        elif request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        else:
            self.log_debug("Bad request from %s: %s", request.remote, exc or message)
        resp = web.json_response(self.error_body(status, protocol_reason(status, exc, message)), status=status)
        resp.force_close()
        return resp


class _Server(web.Server):
    """An aiohttp ``Server`` whose connections are ``_Handler``s."""

    error_body: ErrorBody = staticmethod(engine_error_body)

    def __call__(self) -> RequestHandler:
        handler = _Handler(self, loop=self._loop, **self._kwargs)
        handler.error_body = self.error_body
        return handler


class _Runner(web.AppRunner):
    def __init__(self, app: web.Application, error_body: ErrorBody, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._error_body = error_body

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app's startup, then its Server
        server.__class__ = _Server  # the same object; only how it makes connection handlers differs
        server.error_body = self._error_body
        return server


def runner(app: web.Application, error_body: ErrorBody = engine_error_body, **kwargs: Any) -> web.AppRunner:
    """An ``AppRunner`` for ``app`` whose protocol-level error answers are ``error_body`` JSON."""
    return _Runner(app, error_body, **kwargs)


async def read_body(request: web.Request) -> bytes:
    """The request's body (see the contract: a broken one is a 400 naming why)."""
    try:
        return await request.read()
    except (HttpProcessingError, RequestPayloadError, zlib.error) as e:
        lines = str(e).strip().splitlines()
        raise web.HTTPBadRequest(reason=f"the body cannot be read: {printable(lines[0] if lines else type(e).__name__)[:150]}") from None


def json_errors(error_body: ErrorBody = engine_error_body) -> Callable:
    """A middleware: an ``HTTPException`` >= 400 from the routing or a handler as ``error_body`` JSON."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            reason = f"{request.method} {printable(request.path)[:100]}: {e.reason}"
            resp = web.json_response(error_body(e.status, reason), status=e.status)
            if e.status == 413:
                resp.force_close()  # the rest of the body is not read
            return resp

    return middleware
