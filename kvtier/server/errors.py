"""HTTP errors of the daemon: every 4xx/5xx is JSON ``{"error": message}``.

:func:`error` builds one (handlers and the frame streams raise it); :func:`errors_middleware`
turns aiohttp's own errors (404 route, 405, 413 body too large) and unexpected exceptions
(500, logged; the daemon keeps serving) into the same shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
    """Every error as JSON with a message; an unexpected exception is a 500, logged, and the
    daemon keeps serving."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.json_response({"error": message}, status=exc.status, headers=headers)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": f"internal error: {type(exc).__name__}: {exc}"}, status=500)
