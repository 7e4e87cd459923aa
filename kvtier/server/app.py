"""The daemon's HTTP API (aiohttp): app factory, typed app keys, middlewares, handlers.

Routes (bodies: ``application/msgpack`` maps; block streams: kvtier.wire frames). Access:
``public`` needs no token, ``tenant`` acts on the caller's own namespaces, ``admin`` needs an
admin token (kvtier.server.tenants)::

    GET    /healthz                          public  liveness
    GET    /openapi.json                     public  OpenAPI 3 description
    POST   /v1/auth/hello                    public  open a signed session (kvtier.auth)
    PUT    /v1/namespaces/{ns}               tenant  register {"block_shape", "dtype"[, "name"]}
                                                     (idempotent; 409 another spec; 403 a namespace
                                                     the token file does not give the tenant; 507)
    GET    /v1/namespaces/{ns}               tenant  spec, limits and per-tier usage
    POST   /v1/namespaces/{ns}/lookup        tenant  {"block_hashes"} -> {"num_blocks", "media"}
    POST   /v1/namespaces/{ns}/get           tenant  {"block_hashes"} -> frames of the leading present blocks
    POST   /v1/namespaces/{ns}/put           tenant  frames -> {"stored": [bool, ...]}
    DELETE /v1/namespaces/{ns}               admin   drop the namespace (of the caller's tenant)
    POST   /v1/namespaces/{ns}/reset         admin   empty it, keep it registered
    POST   /v1/namespaces/{ns}/explain       tenant  where each block would hit, why the rest miss
    GET    /v1/events?namespace=LABEL        tenant  KV events (SSE) of the caller's namespaces
                                                     (kvtier.server.observe)
    /v1/admin/...                            admin   every tenant's namespaces (kvtier.server.admin)
    GET    /metrics, /v1/stats               tenant  the caller's namespaces; an admin's: all
    GET    /dashboard[/static/...]           public  the page (it holds no data)

``{ns}`` is the 32-byte namespace as 64 lowercase hex digits; every store is keyed by the
caller's tenant and the namespace, so two tenants never share a block. Errors are JSON
``{"error": message}`` (400, 401, 403, 404, 408, 409, 413, 415, 421, 503, 507).

One middleware (:func:`_calls`) runs, in order: errors (JSON, outermost:
kvtier.server.errors), the connection supervisor (deadlines, kvtier.server.connections), the
guard (Host, Origin, Content-Type: kvtier.server.guard), then auth and access
(kvtier.server.auth). They were four middlewares; one saves aiohttp's wrapper and a coroutine
per layer on every call (issue 17: per-request work on the lookup path).

Extending (kvtier.dashboard, explain, KV events): ``app = make_app(settings)``, then
``app.router.add_get(path, handler)`` and say who may call it: ``app[ACCESS][("GET", path)] =
"public" | "tenant" | "admin"`` (unlisted: admin), for a tenant route scope the answer to
``request[CALLER].tenant`` (``registry.of(tenant)``) or register a tenant's view of an admin
route in ``app[TENANT_VIEWS][path]``; a route that takes a body lists its media type in
``app[BODY_TYPES][(method, path)]``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from kvtier.checks import BatchTooLarge, CheckedHashes, checked_block_hashes, namespace_hex, parse_display_name, parse_namespace
from kvtier.dashboard import setup_observability
from kvtier.server import admin, channel, frames, observe
from kvtier.server.auth import CALLER, AuthError, Sessions, add_proof, authenticate, hello, unauthorized
from kvtier.server.connections import SUPERVISOR, Budget, Supervisor, own_deadline
from kvtier.server.errors import Handler, error, error_response
from kvtier.server.guard import ALLOWED_HOSTS, BODY_TYPES, check_request
from kvtier.server.keys import (ACCESS, OPENAPI_PATHS, PUBLIC_PATHS, REGISTRY, SESSIONS, SETTINGS, STAGING,
                                TENANT_VIEWS)
from kvtier.server.openapi import openapi
from kvtier.server.registry import Namespace, Registry, RegistryError, UnknownNamespace
from kvtier.server.settings import ServeConfig
from kvtier.server.streams import CLOSE_AFTER
from kvtier.server.tenants import Caller
from kvtier.server.views import VIEWS, TenantViews, tenant_metrics, tenant_stats
from kvtier.store.results import LookupResult
from kvtier.wire import FRAMES, MSGPACK, pack, spec_from_wire, spec_to_wire, unpack_map

__all__ = ["ACCESS", "OPENAPI_PATHS", "PUBLIC_PATHS", "REGISTRY", "SESSIONS", "SETTINGS", "STAGING",
           "TENANT_VIEWS", "make_app", "msgpack_response"]

NS = "/v1/namespaces/{ns}"


def make_app(settings: ServeConfig) -> web.Application:
    """The daemon's application. Its namespaces open when the app starts (cleanup context)
    and close, flushing to DISK, when it stops. Raises ``ValueError`` for a bad token file."""
    tenants = settings.tenants()
    # Bodies read whole (register, lookup, get requests) are small: hashes only. Puts stream.
    client_max_size = 64 * settings.max_batch_blocks + (64 << 10)
    supervisor = Supervisor(settings.idle_timeout_s, settings.request_timeout_s, settings.max_connections)
    app = web.Application(client_max_size=client_max_size, middlewares=[_calls(supervisor)])
    app[SETTINGS] = settings
    app[SUPERVISOR] = supervisor
    app[REGISTRY] = Registry(settings, tenants)
    app[SESSIONS] = Sessions(tenants)
    app[STAGING] = Budget(settings.max_staging_bytes)
    app[ALLOWED_HOSTS] = frozenset(h.lower().rstrip(".") for h in settings.allow_hosts)
    app[PUBLIC_PATHS] = set()
    app[OPENAPI_PATHS] = {}
    app[TENANT_VIEWS] = {}
    app[BODY_TYPES] = {("PUT", NS): MSGPACK, ("POST", NS + "/lookup"): MSGPACK, ("POST", NS + "/get"): MSGPACK,
                       ("POST", NS + "/put"): FRAMES}
    app[ACCESS] = {("GET", "/healthz"): "public", ("GET", "/openapi.json"): "public",
                   ("POST", "/v1/auth/hello"): "public", ("PUT", NS): "tenant", ("GET", NS): "tenant",
                   ("POST", NS + "/lookup"): "tenant", ("POST", NS + "/get"): "tenant",
                   ("POST", NS + "/put"): "tenant"}
    app.cleanup_ctx.append(_registry_ctx)
    app.on_response_prepare.append(add_proof)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_post("/v1/auth/hello", auth_hello)
    app.router.add_put(NS, register)
    app.router.add_get(NS, info)
    app.router.add_delete(NS, delete)
    app.router.add_post(NS + "/lookup", lookup)
    app.router.add_post(NS + "/get", get)
    app.router.add_post(NS + "/put", put)
    app.router.add_post(NS + "/reset", reset)
    channel.setup(app, client_max_size, (allowed_namespace, checked_hashes, lookup_now, lookup_off_loop))
    admin.setup(app)
    _setup_observability(app)
    observe.setup(app, _use_store, app[OPENAPI_PATHS])
    return app


@contextlib.asynccontextmanager
async def _use_store(request: web.Request) -> AsyncIterator:
    """The store of the caller's tenant's namespace ``{ns}``, in use for the call (400 bad,
    403 not the tenant's, 404 unknown)."""
    namespace = _namespace(request)
    try:
        async with request.app[REGISTRY].use(_caller(request).tenant.name, namespace) as entry:
            yield entry.store
    except UnknownNamespace:
        raise _unknown(namespace) from None


def _setup_observability(app: web.Application) -> None:
    """``/metrics``, ``/v1/stats`` and ``/dashboard`` (kvtier.dashboard) over the namespaces'
    stores, by label (never a namespace id). The page and its static files are public;
    a tenant's ``/metrics`` and ``/v1/stats`` show its own namespaces (kvtier.server.views)."""
    registry = app[REGISTRY]
    setup_observability(
        app, lambda: {entry.label: entry.store for entry in registry},
        public_paths=app[PUBLIC_PATHS], openapi_paths=app[OPENAPI_PATHS],
    )
    app[VIEWS] = views = TenantViews(registry, interval_s=1.0, max_samples=300)
    app.cleanup_ctx.append(views.sampler)
    app[ACCESS].update({("GET", "/metrics"): "tenant", ("GET", "/v1/stats"): "tenant",
                        ("GET", "/dashboard"): "public", ("GET", "/dashboard/static/{name}"): "public"})
    app[TENANT_VIEWS].update({"/metrics": tenant_metrics, "/v1/stats": tenant_stats})


async def _registry_ctx(app: web.Application) -> AsyncIterator[None]:
    registry = app[REGISTRY]
    await registry.open()
    try:
        yield
    finally:
        await registry.close()


# -- the middleware ----------------------------------------------------------------------------
def _calls(supervisor: Supervisor):
    """The daemon's one middleware (module docstring): errors_middleware(supervisor.middleware(
    guard_middleware(access(handler)))) in one coroutine."""

    @web.middleware
    async def calls(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            conn = supervisor.begin(request)
            try:
                check_request(request)
                response = await _access(request, handler)(request)
            finally:
                supervisor.end(conn)
        except Exception as exc:
            try:
                response = error_response(request, exc)
            except web.HTTPException as answer:  # aiohttp sends it as it is
                _close_after(request, answer)
                raise
        _close_after(request, response)
        return response

    return calls


def _close_after(request: web.Request, response: web.StreamResponse) -> None:
    """``Connection: close`` on the reply to a request whose body went past aiohttp's parser
    (kvtier.server.streams.BodyReceiver where this aiohttp gives no fresh parser: aiohttp
    closes the connection after it anyway)."""
    if request.get(CLOSE_AFTER):
        response.force_close()


def _access(request: web.Request, handler: Handler) -> Handler:
    """Authenticate (before any body is read), then apply the route's access: the handler to
    run (``handler``, or a tenant's view of an admin route); raises 401 or 403."""
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else None
    app = request.app
    # HEAD is GET without the body (aiohttp answers it on every GET route): GET's access
    method = "GET" if request.method == "HEAD" else request.method
    access = app[ACCESS].get((method, path), "admin")
    if access == "public" or request.path in app[PUBLIC_PATHS]:
        return handler
    try:
        caller = authenticate(request, app[REGISTRY].tenants, app[SESSIONS])
    except AuthError as exc:
        raise unauthorized(exc) from None
    request[CALLER] = caller
    if caller.admin:
        return handler
    view = app[TENANT_VIEWS].get(path)
    if view is not None:
        return view
    if access != "tenant" and path is not None:  # no route: the router's 404 or 405
        raise error(web.HTTPForbidden, f"{request.method} {path or request.path[:100]} needs an admin token")
    return handler


# -- helpers -----------------------------------------------------------------------------------
def msgpack_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=pack(obj), status=status, content_type=MSGPACK)


def _namespace(request: web.Request) -> bytes:
    """The path's namespace, if the caller's tenant may use it (400, 403)."""
    return allowed_namespace(_caller(request), request.match_info["ns"])


def allowed_namespace(caller: Caller, text: object) -> bytes:
    """The namespace ``text`` names (64 lowercase hex digits), if ``caller``'s tenant may use
    it: 400 (bad spelling), 403 (not the tenant's: token file)."""
    try:
        namespace = parse_namespace(text)
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None
    if not caller.tenant.allows(namespace):
        raise error(web.HTTPForbidden, f"tenant {caller.tenant.name} may not use namespace "
                                       f"{namespace_hex(namespace)} (token file)")
    return namespace


def _caller(request: web.Request) -> Caller:
    return request[CALLER]


def _unknown(namespace: bytes) -> web.HTTPException:
    return error(web.HTTPNotFound, f"unknown namespace {namespace_hex(namespace)}: register it first "
                                   "(PUT /v1/namespaces/{ns} with block_shape and dtype)")


async def _body_map(request: web.Request, what: str) -> dict:
    body = await request.read()  # over client_max_size: 413 from aiohttp, before it is all read
    try:
        return unpack_map(body, what)
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None


async def _hashes(request: web.Request, what: str) -> CheckedHashes:
    """The body's ``block_hashes``, checked once here (the store trusts a
    :class:`~kvtier.checks.CheckedHashes`): 400 bad, 413 over ``--max-batch-blocks``."""
    return checked_hashes(await _body_map(request, what), request.app[SETTINGS].max_batch_blocks)


def checked_hashes(obj: dict, max_batch_blocks: int) -> CheckedHashes:
    """``obj["block_hashes"]`` checked (:func:`kvtier.checks.checked_block_hashes`): 400 bad,
    413 over ``max_batch_blocks``."""
    try:
        return checked_block_hashes(obj.get("block_hashes"), max_batch_blocks)
    except BatchTooLarge as exc:
        raise error(web.HTTPRequestEntityTooLarge, f"{exc} (--max-batch-blocks)") from None
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None


def describe(entry: Namespace, settings: ServeConfig) -> dict:
    return {
        "namespace": namespace_hex(entry.namespace), "label": entry.label, **spec_to_wire(entry.spec),
        "max_batch_blocks": settings.max_batch_blocks, "max_block_bytes": settings.max_block_bytes,
        "durable": settings.durable, "channel": channel.PATH,
    }


# -- handlers ----------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def auth_hello(request: web.Request) -> web.Response:
    return await hello(request, request.app[SESSIONS])


async def openapi_json(request: web.Request) -> web.Response:
    app = request.app
    return web.json_response(openapi(app[SETTINGS], app[OPENAPI_PATHS], app.router.routes()))


async def register(request: web.Request) -> web.Response:
    namespace = _namespace(request)
    body = await _body_map(request, "register")
    try:
        spec = spec_from_wire(body)
        name = None if body.get("name") is None else parse_display_name(body["name"])
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None
    try:
        entry, created = await request.app[REGISTRY].register(_caller(request).tenant, namespace, spec, name)
    except RegistryError as exc:
        raise error(_STATUS[exc.status], str(exc)) from None
    return msgpack_response({**describe(entry, request.app[SETTINGS]), "created": created}, 201 if created else 200)


_STATUS = {400: web.HTTPBadRequest, 409: web.HTTPConflict, 413: web.HTTPRequestEntityTooLarge,
           507: web.HTTPInsufficientStorage}


async def info(request: web.Request) -> web.Response:
    namespace = _namespace(request)
    registry = request.app[REGISTRY]
    try:
        async with registry.use(_caller(request).tenant.name, namespace) as entry:
            usage = await registry.run_on(entry, entry.store.usage)
            return msgpack_response({**describe(entry, request.app[SETTINGS]), "usage": usage})
    except UnknownNamespace:
        raise _unknown(namespace) from None


async def delete(request: web.Request) -> web.Response:
    own_deadline(request)  # closes a store: may take long
    namespace = _namespace(request)
    if not await request.app[REGISTRY].delete(_caller(request).tenant.name, namespace):
        raise _unknown(namespace)
    return msgpack_response({"deleted": True})


async def reset(request: web.Request) -> web.Response:
    own_deadline(request)  # closes a store: may take long
    namespace = _namespace(request)
    held = await request.app[REGISTRY].reset(_caller(request).tenant.name, namespace)
    if held is None:
        raise _unknown(namespace)
    return msgpack_response({"reset": True, "blocks": held})


async def lookup(request: web.Request) -> web.Response:
    """Leading blocks present, and the fastest medium holding each."""
    namespace = _namespace(request)
    hashes = await _hashes(request, "lookup")
    caller = _caller(request)
    reply = lookup_now(request.app, caller, namespace, hashes)
    return msgpack_response(reply if reply is not None else await lookup_off_loop(request.app, caller, namespace, hashes))


def lookup_now(app: web.Application, caller: Caller, namespace: bytes, hashes: CheckedHashes) -> dict | None:
    """``{"num_blocks", "media"}`` of a lookup in ``caller``'s tenant's ``namespace`` (already
    checked against the tenant: :func:`_namespace`) answered on the event loop, or ``None``
    when the store's lock is busy (then :func:`lookup_off_loop`); raises the 404 of an unknown
    namespace. Nothing is awaited, so no delete or reset can come in between (they run on
    this loop too) and the call is not registered with :meth:`Registry.use`: its async
    context, ``asyncio.current_task`` and two coroutine frames were ~10% of the daemon's busy
    time under lookups (issue 17, bench/results/2026-12-03-quiet-6). Shared by ``POST
    .../lookup`` and the WebSocket channel (kvtier.server.channel)."""
    entry = app[REGISTRY].get(caller.tenant.name, namespace)
    if entry is None:
        raise _unknown(namespace)
    result = entry.store.lookup(hashes, blocking=False)
    return None if result is None else _lookup_body(result)


async def lookup_off_loop(app: web.Application, caller: Caller, namespace: bytes, hashes: CheckedHashes) -> dict:
    """:func:`lookup_now` of a store whose lock is busy: on the registry's threads, in a task
    of its own. A delete or reset of the namespace cuts its calls in flight
    (:meth:`Registry.use`), and cutting this one must not cut the caller's task, which for the
    channel is the whole connection (every later frame, other namespaces' too).

    Raises:
        web.HTTPNotFound: an unknown namespace.
        web.HTTPConflict: the namespace was deleted or reset while the lookup waited.
    """
    registry = app[REGISTRY]

    async def on_thread() -> dict:
        try:
            async with registry.use(caller.tenant.name, namespace) as entry:
                return _lookup_body(await registry.run_on(entry, entry.store.lookup, hashes))
        except UnknownNamespace:
            raise _unknown(namespace) from None

    call = asyncio.ensure_future(on_thread())
    try:
        return await call
    except asyncio.CancelledError:
        cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python >= 3.11
        if not call.cancelled() or cancelling is None or cancelling():  # the caller itself is cancelled
            raise
        raise error(web.HTTPConflict, f"namespace {namespace_hex(namespace)} was deleted or reset while this "
                                      "lookup waited for its store: look it up again") from None


def _lookup_body(result: LookupResult) -> dict:
    # Medium is a str enum: msgpack packs each as its name, no str() per block needed
    return {"num_blocks": result.num_hit_blocks, "media": result.media}


async def get(request: web.Request) -> web.StreamResponse:
    """The leading present blocks as frames, written from the store's pool (kvtier.server.frames)."""
    namespace = _namespace(request)
    registry = request.app[REGISTRY]
    hashes = await _hashes(request, "get")
    try:
        async with registry.use(_caller(request).tenant.name, namespace) as entry:
            return await frames.send_blocks(request, registry, entry, hashes)
    except UnknownNamespace:
        raise _unknown(namespace) from None


async def put(request: web.Request) -> web.Response:
    """Frames in, each verified then stored; ``{"stored": [bool per frame]}``."""
    namespace = _namespace(request)
    registry = request.app[REGISTRY]
    try:
        async with registry.use(_caller(request).tenant.name, namespace) as entry:
            stored = await frames.receive_blocks(request, registry, entry, request.app[STAGING])
    except UnknownNamespace:
        raise _unknown(namespace) from None
    return msgpack_response({"stored": stored})
