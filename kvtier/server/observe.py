"""The daemon's explain and KV-event routes, added by :func:`kvtier.server.app.make_app` with
one call (:func:`setup`), over the namespaces the caller may see::

    POST /v1/namespaces/{ns}/explain   where each block would hit and why the rest would miss
                                       (body and reply: kvtier.dashboard.explain)
    GET  /v1/events?namespace=NAME&cursor=N
                                       KV events as server-sent events, resumable
                                       (kvtier.dashboard.events)

Neither counts anything nor changes a store. Both are ``tenant`` routes: explain acts on the
caller's tenant's namespace ``{ns}`` (``use_store``); the stream serves the caller's own
namespaces by label (``tenant/name`` or ``tenant/ns-<opaque id>``, never a namespace id; an
admin's: every tenant's). A stream has no call deadline (``request_timeout_s``): it ends when
the client goes, the daemon stops, or its namespace is deleted or reset (its store is then
another: the client reconnects and starts from a snapshot). At most a quarter of
``--max-connections`` streams are open at once (503 beyond: :data:`STREAMS_SHARE`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, AsyncContextManager, Callable

from aiohttp import web

from kvtier.dashboard.events import setup_events
from kvtier.dashboard.explain import explain_response, read_body
from kvtier.server.auth import CALLER
from kvtier.server.connections import own_deadline
from kvtier.server.errors import error
from kvtier.server.guard import BODY_TYPES
from kvtier.server.keys import ACCESS, REGISTRY, SETTINGS
from kvtier.server.registry import Namespace, UnknownNamespace
from kvtier.wire import MSGPACK

if TYPE_CHECKING:
    from kvtier.store import TieredStore

STREAMS_SHARE = 4
"""Open event streams may hold at most 1/4 of ``--max-connections``: a stream has no call
deadline, so without a cap token holders could fill every connection with streams (503 beyond)."""

UseStore = Callable[[web.Request], AsyncContextManager["TieredStore"]]
"""``use_store(request)``: the store of the request's ``{ns}``, held in use for the call
(raises the daemon's 400 or 404 for a bad or unknown namespace)."""


def setup(app: web.Application, use_store: UseStore, openapi_paths: dict | None = None) -> None:
    """Add the routes of the module docstring (their access, body types and OpenAPI entries)."""
    registry = app[REGISTRY]

    async def explain(request: web.Request) -> web.Response:
        async with use_store(request) as store:  # the namespace checked before the body is read
            return await explain_response(store, await read_body(request))

    def visible(request: web.Request) -> list[Namespace]:
        caller = request[CALLER]
        return list(registry) if caller.admin else registry.of(caller.tenant.name)

    max_streams = max(1, app[SETTINGS].max_connections // STREAMS_SHARE)
    streams: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def in_use(request: web.Request, label: str) -> AsyncIterator[None]:
        entry = next((e for e in visible(request) if e.label == label), None)
        if entry is None:
            raise error(web.HTTPNotFound, f"unknown namespace {label[:80]!r}")
        if len(streams) >= max_streams:
            raise error(web.HTTPServiceUnavailable, f"{max_streams} event streams are open (1/{STREAMS_SHARE} of "
                        "--max-connections): try again later")
        own_deadline(request)  # a stream: it lasts until the client goes
        task = asyncio.current_task()
        streams.add(task)
        try:
            async with registry.use(entry.tenant, entry.namespace):
                yield
        except UnknownNamespace:
            raise error(web.HTTPNotFound, f"unknown namespace {label[:80]!r}") from None
        finally:
            streams.discard(task)

    app.router.add_post("/v1/namespaces/{ns}/explain", explain)
    setup_events(app, lambda request: {e.label: e.store for e in visible(request)}, around=in_use)
    app[ACCESS].update({("POST", "/v1/namespaces/{ns}/explain"): "tenant", ("GET", "/v1/events"): "tenant"})
    app[BODY_TYPES][("POST", "/v1/namespaces/{ns}/explain")] = (MSGPACK, "application/json")
    if openapi_paths is not None:
        openapi_paths.update(openapi_entries())


def openapi_entries() -> dict[str, Any]:
    ns = {"name": "ns", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}
    return {
        "/v1/namespaces/{ns}/explain": {"parameters": [ns], "post": {
            "summary": "Where each block of a prompt would hit and why the rest would miss (counts nothing)",
            "requestBody": {"content": {"application/msgpack": {"schema": {"type": "object"}},
                                        "application/json": {"schema": {"type": "object"}}}},
            "responses": {"200": {"description": "the explanation", "content": {"application/json": {
                "schema": {"type": "object"}}}}, "400": {"description": "bad body"},
                "404": {"description": "unknown namespace"}}}},
        "/v1/events": {"get": {
            "summary": "KV events (vLLM schema) as server-sent events; ?namespace=NAME&cursor=SEQ",
            "responses": {"200": {"description": "the stream", "content": {"text/event-stream": {
                "schema": {"type": "string"}}}}, "400": {"description": "bad cursor or no namespace"},
                "404": {"description": "unknown namespace"}, "503": {"description": "too many streams open"}}}},
    }
