"""The daemon's explain and KV-event routes, added by :func:`kvtier.server.app.make_app` with
one call (:func:`setup`), over the namespaces the caller may see::

    POST /v1/namespaces/{ns}/explain   where each block would hit and why the rest would miss
                                       (body and reply: kvtier.dashboard.explain)
    GET  /v1/events?namespace=NAME&cursor=N
                                       KV events as server-sent events, resumable
                                       (kvtier.dashboard.events)

Neither counts anything nor changes a store. The caller sees only the stores ``stores_for``
gives it (the daemon decides which, and by which names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncContextManager, Callable

from aiohttp import web

from kvtier.dashboard.events import StoresFor, setup_events
from kvtier.dashboard.explain import explain_response, read_body

if TYPE_CHECKING:
    from kvtier.store import TieredStore

UseStore = Callable[[web.Request], AsyncContextManager["TieredStore"]]
"""``use_store(request)``: the store of the request's ``{ns}``, held in use for the call
(raises the daemon's 400 or 404 for a bad or unknown namespace)."""


def setup(app: web.Application, use_store: UseStore, stores_for: StoresFor, openapi_paths: dict | None = None) -> None:
    """Add the routes of the module docstring (and their OpenAPI entries)."""

    async def explain(request: web.Request) -> web.Response:
        body = await read_body(request)
        async with use_store(request) as store:
            return await explain_response(store, body)

    app.router.add_post("/v1/namespaces/{ns}/explain", explain)
    setup_events(app, stores_for)
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
                "404": {"description": "unknown namespace"}}}},
    }
