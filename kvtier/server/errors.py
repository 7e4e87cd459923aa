"""HTTP errors of the daemon: every 4xx/5xx is JSON ``{"error": message}``.

:func:`error` builds one (handlers and the frame streams raise it); :func:`errors_middleware`
turns aiohttp's own errors (404 route, 405, 413 body too large) and unexpected exceptions
(500, logged; the daemon keeps serving) into the same shape. Logs that a caller can repeat
at will go through :data:`LOG` (:class:`RateLimitedLog`): one line per kind every
``interval_s``, with the count of those left out, so a client that sends garbage in a loop
cannot fill the disk or drown other messages (issue 12).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RateLimitedLog:
    """At most one log line per ``kind`` every ``interval_s``; the next line that gets out
    says how many were left out since. Thread-safe."""

    def __init__(self, interval_s: float = 10.0, max_kinds: int = 256) -> None:
        self.interval_s, self.max_kinds = interval_s, max_kinds
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def allow(self, kind: str) -> int | None:
        """``None`` to leave this one out; else how many were left out before it."""
        now = time.monotonic()
        with self._lock:
            last, dropped = self._last.get(kind, (float("-inf"), 0))
            if now - last < self.interval_s:
                self._last[kind] = (last, dropped + 1)
                return None
            if len(self._last) >= self.max_kinds and kind not in self._last:
                self._last.clear()
            self._last[kind] = (now, 0)
            return dropped

    def log(self, log: logging.Logger, level: int, kind: str, msg: str, *args, exc_info: bool = False) -> None:
        dropped = self.allow(kind)
        if dropped is None or not log.isEnabledFor(level):
            return
        if dropped:
            msg += f" ({dropped} more like it in the last {self.interval_s:g} s not logged)"
        log.log(level, msg, *args, exc_info=exc_info)


LOG = RateLimitedLog()


class RateLimitedLogger(logging.LoggerAdapter):
    """A logger whose warnings and errors go through :data:`LOG` (one per message per
    interval): the daemon hands it to aiohttp, which logs a traceback for every request it
    cannot parse."""

    def log(self, level: int, msg, *args, **kwargs) -> None:
        if level >= logging.WARNING:
            dropped = LOG.allow(f"{self.logger.name}: {msg}")
            if dropped is None:
                return
            if dropped:
                msg = f"{msg} ({dropped} more like it in the last {LOG.interval_s:g} s not logged)"
        super().log(level, msg, *args, **kwargs)


class TooLarge(web.HTTPClientError):
    """413 with a free-form body (aiohttp's HTTPRequestEntityTooLarge wants the sizes)."""

    status_code = 413


def error(cls: type[web.HTTPException], message: str) -> web.HTTPException:
    """An HTTP error whose body is ``{"error": message}``."""
    if cls is web.HTTPRequestEntityTooLarge:
        cls = TooLarge
    return cls(text=json.dumps({"error": message}), content_type="application/json")


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as JSON with a message; an unexpected exception is a 500, logged (rate
    limited), and the daemon keeps serving (:func:`error_response`)."""
    try:
        return await handler(request)
    except Exception as exc:
        return error_response(request, exc)


def error_response(request: web.Request, exc: Exception) -> web.StreamResponse:
    """What :func:`errors_middleware` answers for ``exc`` raised by a handler: an HTTP error
    that is not JSON yet (aiohttp's 404, 405, 413) as ``{"error": message}``, anything
    unexpected as a logged 500; re-raises a JSON error or a status below 400 (aiohttp sends
    it as it is) and a reset connection."""
    if isinstance(exc, web.HTTPException):
        if exc.status < 400 or exc.content_type == "application/json":
            raise exc
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.json_response({"error": message}, status=exc.status, headers=headers)
    if isinstance(exc, ConnectionResetError):
        raise exc
    LOG.log(logger, logging.ERROR, f"500 {type(exc).__name__}", "%s %s failed", request.method,
            request.path[:200], exc_info=exc)
    return web.json_response({"error": f"internal error: {type(exc).__name__}: {exc}"}, status=500)
