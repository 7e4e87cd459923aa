"""The daemon's HTTP API (aiohttp): app factory, typed app keys, middlewares, handlers.

Routes (bodies: ``application/msgpack`` maps; block streams: kvtier.wire frames)::

    GET    /healthz                          liveness, no auth
    GET    /openapi.json                     OpenAPI 3 description, no auth
    PUT    /v1/namespaces/{ns}               register {"block_shape", "dtype"} (idempotent; 409 on
                                             another spec; 507 over --max-namespaces)
    GET    /v1/namespaces/{ns}               spec, limits and per-tier usage
    DELETE /v1/namespaces/{ns}               drop the namespace and all its blocks
    POST   /v1/namespaces/{ns}/lookup        {"block_hashes"} -> {"num_blocks", "media"}
    POST   /v1/namespaces/{ns}/get           {"block_hashes"} -> frames of the leading present blocks
    POST   /v1/namespaces/{ns}/put           frames -> {"stored": [bool, ...]}

``{ns}`` is the 32-byte namespace in hex. Errors are JSON ``{"error": message}`` with a 4xx
status (400 bad input, 401 auth, 404 unknown namespace, 409, 413 over a limit, 507).

Extending (kvtier.metrics): ``app = make_app(settings)``, then ``app.router.add_get(...)``;
handlers find the namespaces under ``request.app[REGISTRY]`` (``for ns in registry``:
``ns.store``) and paths that need no token go into ``app[PUBLIC_PATHS]``.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator

from aiohttp import web

from kvtier.checks import BatchTooLarge, check_block_hashes, namespace_hex, parse_namespace
from kvtier.dashboard import setup_observability
from kvtier.server import frames, observe
from kvtier.server.errors import Handler, error, errors_middleware
from kvtier.server.openapi import openapi
from kvtier.server.registry import Namespace, Registry, RegistryError, UnknownNamespace
from kvtier.server.settings import ServeConfig
from kvtier.wire import MSGPACK, pack, spec_from_wire, spec_to_wire, unpack_map

SETTINGS = web.AppKey("settings", ServeConfig)
REGISTRY = web.AppKey("registry", Registry)
PUBLIC_PATHS = web.AppKey("public_paths", set)
"""Paths served without a token (``/healthz``, ``/openapi.json``; add ``/metrics`` etc.)."""
OPENAPI_PATHS = web.AppKey("openapi_paths", dict)
"""OpenAPI path items of routes added to the app later (``{"/metrics": {"get": {...}}}``);
a route with none gets a minimal entry, so ``/openapi.json`` always lists every route."""


def make_app(settings: ServeConfig) -> web.Application:
    """The daemon's application. Its namespaces open when the app starts (cleanup context)
    and close, flushing to DISK, when it stops."""
    # Bodies read whole (register, lookup, get requests) are small: hashes only. Puts stream.
    client_max_size = 64 * settings.max_batch_blocks + (64 << 10)
    app = web.Application(client_max_size=client_max_size, middlewares=[errors_middleware, _auth])
    app[SETTINGS] = settings
    app[REGISTRY] = Registry(settings)
    app[PUBLIC_PATHS] = {"/healthz", "/openapi.json"}
    app[OPENAPI_PATHS] = {}
    app.cleanup_ctx.append(_registry_ctx)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/openapi.json", openapi_json)
    ns = "/v1/namespaces/{ns}"
    app.router.add_put(ns, register)
    app.router.add_get(ns, info)
    app.router.add_delete(ns, delete)
    app.router.add_post(ns + "/lookup", lookup)
    app.router.add_post(ns + "/get", get)
    app.router.add_post(ns + "/put", put)
    _setup_observability(app)
    observe.setup(app, _use_store, lambda request: _stores(app), app[OPENAPI_PATHS])
    return app


def _stores(app: web.Application) -> dict:
    """The namespaces' stores by namespace hex (what ``/v1/events`` serves)."""
    return {entry.namespace.hex(): entry.store for entry in app[REGISTRY] if not entry.closing}


@contextlib.asynccontextmanager
async def _use_store(request: web.Request) -> AsyncIterator:
    """The store of the request's ``{ns}``, in use for the call (400 bad, 404 unknown)."""
    namespace = _namespace(request)
    try:
        async with request.app[REGISTRY].use(namespace) as entry:
            yield entry.store
    except UnknownNamespace:
        raise _unknown(namespace) from None


def _setup_observability(app: web.Application) -> None:
    """``/metrics``, ``/v1/stats`` and ``/dashboard`` (kvtier.dashboard) over the namespaces'
    stores, by namespace hex. The page and its static files are public (they hold no data);
    ``/metrics`` and ``/v1/stats`` need the token when the daemon has one (a Prometheus scrape
    config sends it as ``authorization``; the page takes it from ``/dashboard#token=...``)."""
    setup_observability(app, lambda: _stores(app), public_paths=app[PUBLIC_PATHS], openapi_paths=app[OPENAPI_PATHS])


async def _registry_ctx(app: web.Application) -> AsyncIterator[None]:
    registry = app[REGISTRY]
    await registry.open()
    try:
        yield
    finally:
        await registry.close()


# -- middlewares -------------------------------------------------------------------------------
@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """``Authorization: Bearer <token>``, compared in constant time (before any body is read)."""
    token = request.app[SETTINGS].token
    if token is not None and request.path not in request.app[PUBLIC_PATHS]:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            exc = error(web.HTTPUnauthorized, "expected Authorization: Bearer <token>")
            exc.headers["WWW-Authenticate"] = 'Bearer realm="kvtier"'
            raise exc
    return await handler(request)


# -- helpers -----------------------------------------------------------------------------------
def msgpack_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=pack(obj), status=status, content_type=MSGPACK)


def _namespace(request: web.Request) -> bytes:
    try:
        return parse_namespace(request.match_info["ns"])
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None


def _unknown(namespace: bytes) -> web.HTTPException:
    return error(web.HTTPNotFound, f"unknown namespace {namespace_hex(namespace)}: register it first "
                                   "(PUT /v1/namespaces/{ns} with block_shape and dtype)")


async def _body_map(request: web.Request, what: str) -> dict:
    body = await request.read()  # over client_max_size: 413 from aiohttp, before it is all read
    try:
        return unpack_map(body, what)
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None


async def _hashes(request: web.Request, what: str) -> list:
    obj = await _body_map(request, what)
    try:
        return check_block_hashes(obj.get("block_hashes"), request.app[SETTINGS].max_batch_blocks)
    except BatchTooLarge as exc:
        raise error(web.HTTPRequestEntityTooLarge, f"{exc} (--max-batch-blocks)") from None
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None


def _describe(entry: Namespace, settings: ServeConfig) -> dict:
    return {
        "namespace": namespace_hex(entry.namespace), **spec_to_wire(entry.spec),
        "max_batch_blocks": settings.max_batch_blocks, "max_block_bytes": settings.max_block_bytes,
        "durable": settings.durable,
    }


# -- handlers ----------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "namespaces": len(request.app[REGISTRY].namespaces)})


async def openapi_json(request: web.Request) -> web.Response:
    app = request.app
    return web.json_response(openapi(app[SETTINGS], app[OPENAPI_PATHS], app.router.routes()))


async def register(request: web.Request) -> web.Response:
    namespace = _namespace(request)
    try:
        spec = spec_from_wire(await _body_map(request, "register"))
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None
    try:
        entry, created = await request.app[REGISTRY].register(namespace, spec)
    except RegistryError as exc:
        raise error(_STATUS[exc.status], str(exc)) from None
    return msgpack_response({**_describe(entry, request.app[SETTINGS]), "created": created}, 201 if created else 200)


_STATUS = {400: web.HTTPBadRequest, 409: web.HTTPConflict, 413: web.HTTPRequestEntityTooLarge,
           507: web.HTTPInsufficientStorage}


async def info(request: web.Request) -> web.Response:
    namespace = _namespace(request)
    registry = request.app[REGISTRY]
    try:
        async with registry.use(namespace) as entry:
            usage = await registry.run(entry.store.usage)
            return msgpack_response({**_describe(entry, request.app[SETTINGS]), "usage": usage})
    except UnknownNamespace:
        raise _unknown(namespace) from None


async def delete(request: web.Request) -> web.Response:
    namespace = _namespace(request)
    if not await request.app[REGISTRY].delete(namespace):
        raise _unknown(namespace)
    return msgpack_response({"deleted": True})


async def lookup(request: web.Request) -> web.Response:
    """Leading blocks present, and the fastest medium holding each."""
    namespace = _namespace(request)
    registry = request.app[REGISTRY]
    hashes = await _hashes(request, "lookup")
    try:
        async with registry.use(namespace) as entry:
            # inline when the store's lock is free (microseconds: no thread hop on the hot
            # path), else on the registry's threads
            result = entry.store.lookup(hashes, blocking=False)
            if result is None:
                result = await registry.run(entry.store.lookup, hashes)
    except UnknownNamespace:
        raise _unknown(namespace) from None
    return msgpack_response({"num_blocks": result.num_hit_blocks, "media": [str(m) for m in result.media]})


async def get(request: web.Request) -> web.StreamResponse:
    """The leading present blocks as frames, written from the store's pool (kvtier.server.frames)."""
    namespace = _namespace(request)
    registry = request.app[REGISTRY]
    hashes = await _hashes(request, "get")
    try:
        async with registry.use(namespace) as entry:
            return await frames.send_blocks(request, registry, entry, hashes)
    except UnknownNamespace:
        raise _unknown(namespace) from None


async def put(request: web.Request) -> web.Response:
    """Frames in, each verified then stored; ``{"stored": [bool per frame]}``."""
    namespace = _namespace(request)
    registry = request.app[REGISTRY]
    try:
        async with registry.use(namespace) as entry:
            stored = await frames.receive_blocks(request, registry, entry, request.app[SETTINGS])
    except UnknownNamespace:
        raise _unknown(namespace) from None
    return msgpack_response({"stored": stored})
