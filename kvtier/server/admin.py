"""Admin routes of the daemon: every tenant's namespaces, listed, emptied or deleted (the
CLI's ``kvtier admin ls/clear/rm`` call them through
:class:`kvtier.tiers.remote.RemoteTier`). An admin token only (kvtier.server.tenants)::

    GET    /v1/admin/namespaces                           {"namespaces": [{tenant, namespace,
                                                          label, block_shape, dtype, usage}, ...]}
    POST   /v1/admin/reset                                empty every namespace -> {"reset": n,
                                                          "blocks": blocks they held}
    POST   /v1/admin/tenants/{tenant}/namespaces/{ns}/reset   empty one -> {"reset": true,
                                                          "blocks": blocks it held}
    DELETE /v1/admin/tenants/{tenant}/namespaces/{ns}     delete one -> {"deleted": true}

Emptying a namespace cuts its calls in flight, drops every block in every tier (DISK
included) and keeps it registered: the next put starts from nothing (kvtier.server.registry).
"""

from __future__ import annotations

from aiohttp import web

from kvtier.checks import namespace_hex, parse_namespace, parse_tenant
from kvtier.server.connections import own_deadline
from kvtier.server.errors import error
from kvtier.server.keys import REGISTRY
from kvtier.server.registry import Registry
from kvtier.wire import MSGPACK, pack, spec_to_wire

BASE = "/v1/admin"
ONE = BASE + "/tenants/{tenant}/namespaces/{ns}"


def setup(app: web.Application) -> None:
    """Add the admin routes (admin access: they are not listed in ``app[ACCESS]``)."""
    app.router.add_get(BASE + "/namespaces", list_namespaces)
    app.router.add_post(BASE + "/reset", reset_all)
    app.router.add_post(ONE + "/reset", reset_one)
    app.router.add_delete(ONE, delete_one)


def _reply(obj: object) -> web.Response:
    return web.Response(body=pack(obj), content_type=MSGPACK)


def _key(request: web.Request) -> tuple[str, bytes]:
    try:
        return parse_tenant(request.match_info["tenant"]), parse_namespace(request.match_info["ns"])
    except ValueError as exc:
        raise error(web.HTTPBadRequest, str(exc)) from None


def _registry(request: web.Request) -> Registry:
    return request.app[REGISTRY]


async def list_namespaces(request: web.Request) -> web.Response:
    registry = _registry(request)
    out = []
    for entry in registry:
        try:
            usage = await registry.run_on(entry, entry.store.usage)
        except Exception:  # closed under us: list it without usage
            usage = None
        out.append({"tenant": entry.tenant, "namespace": namespace_hex(entry.namespace), "label": entry.label,
                    **spec_to_wire(entry.spec), "usage": usage})
    return _reply({"namespaces": out})


async def reset_all(request: web.Request) -> web.Response:
    own_deadline(request)  # closes and reopens stores: may take long
    registry = _registry(request)
    done = blocks = 0
    for entry in list(registry):
        held = await registry.reset(entry.tenant, entry.namespace)
        if held is not None:
            done, blocks = done + 1, blocks + held
    return _reply({"reset": done, "blocks": blocks})


async def reset_one(request: web.Request) -> web.Response:
    own_deadline(request)  # closes and reopens stores: may take long
    tenant, namespace = _key(request)
    held = await _registry(request).reset(tenant, namespace)
    if held is None:
        raise error(web.HTTPNotFound, f"tenant {tenant} has no namespace {namespace_hex(namespace)}")
    return _reply({"reset": True, "blocks": held})


async def delete_one(request: web.Request) -> web.Response:
    own_deadline(request)  # closes and reopens stores: may take long
    tenant, namespace = _key(request)
    if not await _registry(request).delete(tenant, namespace):
        raise error(web.HTTPNotFound, f"tenant {tenant} has no namespace {namespace_hex(namespace)}")
    return _reply({"deleted": True})
