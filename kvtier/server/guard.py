"""What a browser must never get the daemon to do (issue 12: DNS rebinding, cross-origin posts).

Checked on every request, before authentication (:func:`guard_middleware`):

- **Host** (TCP only; a Unix socket has no name): an IP literal, ``localhost``, or a name given
  with ``--allow-host``. A page of ``evil.example`` whose name an attacker re-points at
  127.0.0.1 sends ``Host: evil.example``: refused (421), whatever its token.
- **Origin**: a request that carries one (browsers add it to cross-origin and non-GET calls)
  must come from the daemon's own origin (its dashboard); ``Sec-Fetch-Site: cross-site`` is
  refused too (403).
- **Path**: no percent-encoding (``%``) anywhere in it: a namespace, a tenant or a file has one
  spelling, and ``%30`` x 64 is not it (400, like any other spelling of a name: kvtier.checks).
- **Content-Type**: each route that takes a body names its media type (``app[BODY_TYPES]``:
  ``application/msgpack`` or ``application/x-kvtier-frames``; explain also takes
  ``application/json``); anything else, a missing type
  included, is a 415, and so is a body sent to a route that takes none, or any
  ``Content-Encoding`` (a compressed body would be inflated past the size checks). A browser
  can send ``text/plain`` across origins without asking first: it stores nothing here.
"""

from __future__ import annotations

import functools
import ipaddress

from aiohttp import web

from kvtier.server.errors import Handler, error

BODY_TYPES = web.AppKey("body_types", dict)
"""``{(method, route path template): media type (or a tuple of them)}`` of the routes that
take a body."""
ALLOWED_HOSTS = web.AppKey("allowed_hosts", frozenset)
"""Host names accepted besides IP literals and ``localhost`` (lowercase, no trailing dot)."""


@functools.lru_cache(maxsize=256)
def host_allowed(host_header: str, allowed: frozenset[str]) -> bool:
    """Whether ``Host: host_header`` names this daemon (module docstring). Memoized (a pure
    function; a client sends the same Host on every request, and parsing an IP address
    costs more than the rest of the guard)."""
    host = host_header.strip()
    if host.startswith("["):  # [v6]:port
        end = host.find("]")
        name, rest = host[1:end], host[end + 1 :]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isascii() and rest[1:].isdigit())):
            return False
    else:
        name, _, port = host.partition(":")
        if port and not (port.isascii() and port.isdigit()):
            return False
    name = name.lower().rstrip(".")
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name == "localhost" or name in allowed


def _tcp(request: web.Request) -> bool:
    transport = request.transport
    return transport is not None and isinstance(transport.get_extra_info("sockname"), tuple)


@web.middleware
async def guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    check_request(request)
    return await handler(request)


def check_request(request: web.Request) -> None:
    """The checks of the module docstring; raises the HTTP error (JSON) of the first that fails."""
    if "%" in request.raw_path.partition("?")[0]:
        raise error(web.HTTPBadRequest, "expected a path without percent-encoding (every name here has one "
                    "spelling: a namespace is 64 lowercase hex digits)")
    if _tcp(request) and not host_allowed(request.headers.get("Host", ""), request.app[ALLOWED_HOSTS]):
        raise error(web.HTTPMisdirectedRequest, "expected a Host header naming this daemon (an IP address, "
                    "localhost, or a name given with --allow-host)")
    origin = request.headers.get("Origin")
    if origin is not None and origin not in (f"http://{request.host}", f"https://{request.host}"):
        raise error(web.HTTPForbidden, f"cross-origin request refused (Origin {origin[:100]!r})")
    if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
        raise error(web.HTTPForbidden, "cross-site request refused")
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise error(web.HTTPUnsupportedMediaType, "expected no Content-Encoding")
    route = request.match_info.route.resource
    expected = request.app[BODY_TYPES].get((request.method, route.canonical)) if route is not None else None
    accepted = (expected,) if isinstance(expected, str) else expected
    if accepted is not None and request.content_type not in accepted:
        raise error(web.HTTPUnsupportedMediaType, f"expected Content-Type: {' or '.join(sorted(accepted))}, got "
                    f"{request.headers.get('Content-Type', '(none)')[:100]!r}")
    if expected is None and route is not None and request.body_exists:
        raise error(web.HTTPUnsupportedMediaType, f"expected no body for {request.method} {route.canonical}")
