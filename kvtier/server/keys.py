"""The daemon application's typed keys (``app[REGISTRY]``, ...), in one module that the route
modules (kvtier.server.app, kvtier.server.admin, kvtier.server.views) share."""

from __future__ import annotations

from aiohttp import web

from kvtier.server.auth import Sessions
from kvtier.server.connections import Budget
from kvtier.server.registry import Registry
from kvtier.server.settings import ServeConfig

SETTINGS = web.AppKey("settings", ServeConfig)
REGISTRY = web.AppKey("registry", Registry)
SESSIONS = web.AppKey("sessions", Sessions)
STAGING = web.AppKey("staging", Budget)
"""Staging bytes of every put in flight together (``--max-staging-bytes``)."""
PUBLIC_PATHS = web.AppKey("public_paths", set)
"""Concrete paths served without a token (the dashboard's page and static files)."""
ACCESS = web.AppKey("access", dict)
"""``{(method, route path template): "public" | "tenant" | "admin"}``; a route not listed
is admin."""
TENANT_VIEWS = web.AppKey("tenant_views_routes", dict)
"""``{route path template: handler}`` a non-admin caller gets instead of the route's own."""
OPENAPI_PATHS = web.AppKey("openapi_paths", dict)
"""OpenAPI path items of routes added to the app later (``{"/metrics": {"get": {...}}}``);
a route with none gets a minimal entry, so ``/openapi.json`` always lists every route."""
