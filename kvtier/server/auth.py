"""Authentication and access of the daemon: who is calling (kvtier.server.tenants), over which
scheme (kvtier.auth), and whether the route lets them.

Schemes accepted on every transport:

- ``Bearer <token>`` (curl, Prometheus, the dashboard page; kvtier's client sends it only over
  the Unix socket and https: elsewhere whoever answers in the daemon's place would read it);
- ``KVTier-Session`` after ``POST /v1/auth/hello`` (kvtier.auth: the token never travels,
  the daemon proves it holds it in ``KVTier-Proof`` on every reply);
- nothing, when the daemon has no token (every caller: tenant ``default``, admin).

A header that is not printable ASCII (not UTF-8, latin-1 bytes, control characters) is a 401
like any wrong token, never a 500 (issue 12).

Access per route (``app[ACCESS]``, by method and the route's path template): ``public`` (no token),
``tenant`` (any caller; the handler scopes to ``request[CALLER].tenant``), ``admin``. A route
that is not listed is ``admin``: an endpoint added later shows nothing to a tenant until it
says how (``app[TENANT_VIEWS]``: a handler that non-admin callers get instead).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from kvtier import auth
from kvtier.server.errors import error
from kvtier.server.tenants import Caller, Tenant, Tenants
from kvtier.wire import MSGPACK, pack

logger = logging.getLogger(__name__)

_KEY = getattr(web, "RequestKey", None)  # aiohttp >= 3.12; plain strings before
CALLER = _KEY("kvtier_caller", Caller) if _KEY else "kvtier_caller"
"""``request[CALLER]``: the :class:`~kvtier.server.tenants.Caller` of an authenticated request."""
_PROOF = _KEY("kvtier_proof", tuple) if _KEY else "kvtier_proof"
SESSION_TTL_S = 3600.0
MAX_SESSIONS = 4096
MAX_SESSIONS_PER_KEY = 256
"""A token's own sessions beyond this push out its oldest, never another token's."""
_WINDOW = 1024
"""Counters a session remembers: a counter at or below the oldest kept is refused."""


class AuthError(Exception):
    """401: ``message`` for the caller; ``renew``: the session is unknown (the client says
    hello again)."""

    def __init__(self, message: str, renew: bool = False) -> None:
        super().__init__(message)
        self.renew = renew


@dataclass
class _Session:
    tenant: Tenant
    key: bytes
    expires: float
    key_id: str = ""
    floor: int = 0
    seen: set[int] = field(default_factory=set)

    def use(self, counter: int) -> bool:
        """Accept each counter once (a window of the last :data:`_WINDOW`)."""
        if counter <= self.floor or counter in self.seen:
            return False
        self.seen.add(counter)
        if len(self.seen) > _WINDOW:
            self.floor = sorted(self.seen)[_WINDOW // 2]
            self.seen = {c for c in self.seen if c > self.floor}
        return True


class Sessions:
    """The daemon's sessions (memory only: a restart forgets them, see kvtier.auth)."""

    def __init__(self, tenants: Tenants, max_sessions: int = MAX_SESSIONS, ttl_s: float = SESSION_TTL_S) -> None:
        self.tenants, self.max_sessions, self.ttl_s = tenants, max_sessions, ttl_s
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._by_key: dict[str, OrderedDict[str, None]] = {}

    def hello(self, header: str) -> tuple[dict, str]:
        """``(reply body, proof)`` for a valid hello; raises :class:`AuthError`."""
        try:
            p = auth.parse_params(header, auth.HELLO, auth.HELLO_PARAMS)
        except ValueError as exc:
            raise AuthError(f"expected Authorization: {auth.HELLO} key=.., nonce=.., ts=.., sig=.. ({exc})") from None
        found = self.tenants.key(p["key"])
        if found is None or not auth.equal(auth.hello_signature(found[0], p["key"], p["nonce"], p["ts"]), p["sig"]):
            raise AuthError("unknown key or wrong signature")
        if abs(time.time() - p["ts"]) > auth.HELLO_WINDOW_S:
            raise AuthError(f"hello timestamp more than {auth.HELLO_WINDOW_S} s from the daemon's clock")
        token, tenant = found
        sid, server_nonce = os.urandom(auth.SESSION_NBYTES).hex(), auth.nonce()
        key = auth.session_key(token, sid, p["nonce"], server_nonce)
        self._sessions[sid] = _Session(tenant, key, time.monotonic() + self.ttl_s, p["key"])
        own = self._by_key.setdefault(p["key"], OrderedDict())
        own[sid] = None
        while len(own) > MAX_SESSIONS_PER_KEY:
            self._drop(next(iter(own)))
        while len(self._sessions) > self.max_sessions:
            self._drop(next(iter(self._sessions)))
        body = {"session": sid, "nonce": server_nonce, "ttl_s": self.ttl_s}
        return body, auth.hello_proof(token, p["nonce"], sid, server_nonce)

    def verify(self, header: str, method: str, path_qs: str, endpoint: str) -> tuple[Tenant, bytes, int]:
        """``(tenant, session key, counter)`` of a signed call; raises :class:`AuthError`."""
        try:
            p = auth.parse_params(header, auth.SESSION, auth.SESSION_PARAMS)
        except ValueError as exc:
            raise AuthError(f"expected Authorization: {auth.SESSION} id=.., n=.., sig=.. ({exc})") from None
        session = self._sessions.get(p["id"])
        now = time.monotonic()
        if session is None or session.expires < now:
            self._drop(p["id"])
            raise AuthError("unknown or expired session: say hello again", renew=True)
        if not auth.equal(auth.request_signature(session.key, method, path_qs, p["n"], endpoint), p["sig"]):
            raise AuthError("wrong signature (a request signed for another address, method or path)")
        if not session.use(p["n"]):
            raise AuthError("counter already used or too old: say hello again", renew=True)
        session.expires = now + self.ttl_s
        self._sessions.move_to_end(p["id"])
        self._by_key[session.key_id].move_to_end(p["id"])
        return session.tenant, session.key, p["n"]

    def _drop(self, sid: str) -> None:
        session = self._sessions.pop(sid, None)
        if session is not None:
            own = self._by_key.get(session.key_id)
            if own is not None:
                own.pop(sid, None)
                if not own:
                    del self._by_key[session.key_id]


def endpoint_of(request: web.Request) -> str:
    """The address the request's connection arrived on (``""`` on a Unix socket)."""
    transport = request.transport
    return auth.endpoint(transport.get_extra_info("sockname")) if transport is not None else ""


def authenticate(request: web.Request, tenants: Tenants, sessions: Sessions) -> Caller:
    """The caller of ``request``; raises :class:`AuthError`."""
    if tenants.open:
        return Caller(tenants.default)
    value = request.headers.get("Authorization", "")
    if not value.isascii() or not value.isprintable():  # not UTF-8 / latin-1 bytes: never a 500
        raise AuthError("expected an Authorization header of printable ASCII")
    scheme, _, rest = value.partition(" ")
    if scheme.lower() == "bearer":
        tenant = tenants.bearer(rest.strip())
        if tenant is None:
            raise AuthError("wrong bearer token")
        return Caller(tenant)
    if scheme == auth.SESSION:
        tenant, key, counter = sessions.verify(value, request.method, request.path_qs, endpoint_of(request))
        request[_PROOF] = (key, counter)
        return Caller(tenant)
    raise AuthError(f"expected Authorization: Bearer <token> or {auth.SESSION} (see {auth.HELLO_PATH})")


def unauthorized(exc: AuthError) -> web.HTTPException:
    out = error(web.HTTPUnauthorized, str(exc))
    out.headers["WWW-Authenticate"] = (f'{auth.SESSION} error="renew"' if exc.renew
                                       else f'Bearer realm="kvtier", {auth.SESSION}')
    return out


async def hello(request: web.Request, sessions: Sessions) -> web.Response:
    """``POST /v1/auth/hello``: open a session (kvtier.auth)."""
    value = request.headers.get("Authorization", "")
    if not value.isascii() or not value.isprintable():
        raise unauthorized(AuthError("expected an Authorization header of printable ASCII"))
    try:
        body, proof = sessions.hello(value)
    except AuthError as exc:
        raise unauthorized(exc) from None
    response = web.Response(body=pack(body), content_type=MSGPACK)
    response.headers[auth.PROOF_HEADER] = proof
    return response


async def add_proof(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: ``KVTier-Proof`` on every reply to a signed call."""
    proof = request.get(_PROOF)
    if proof is not None:
        key, counter = proof
        response.headers[auth.PROOF_HEADER] = auth.response_proof(key, counter, response.status)
