"""The HTTP side of a client of the ``kvtier serve`` daemon, shared by
:class:`kvtier.tiers.remote.RemoteTier` (cache traffic) and the admin commands: one pooled
connection set per daemon (kvtier.tiers.transport), the signed session over ``http://``
(kvtier.auth), statuses turned into failure reasons, the pause after a failure
(kvtier.tiers.backoff), and the admin calls (list, empty, delete namespaces).
"""

from __future__ import annotations

import http.client
import itertools
import logging
import threading
import time
from collections import Counter
from typing import Any

import urllib3
from urllib3.exceptions import HTTPError, MaxRetryError
from urllib3.util.retry import Retry

from kvtier import auth
from kvtier.checks import check_namespace, namespace_hex, parse_tenant
from kvtier.tiers.backoff import MAX_S, MIN_S, Backoff
from kvtier.auth import endpoint
from kvtier.tiers.transport import (WATCHDOG, Call, Channel, ChannelClosed, Failed, _Headers, _Stale, call, discard, is_timeout,
                                    make_pool, quick_request, read_capped)
from kvtier.wire import unpack_map

logger = logging.getLogger("kvtier.tiers.remote")

SMALL_REPLY_NBYTES = 4 << 10
"""Largest reply read for register, hello, admin deletes and error messages."""
_ADMIN_TIMEOUT_S = 300.0
"""Admin calls (emptying every namespace closes and reopens every store) may take this long."""
RESET_ONE_TIMEOUT_S = 30.0
"""Emptying one namespace (closing and reopening one store) may take this long."""
CHANNEL_RETRY_S = 60.0
"""After the daemon (or a proxy in front of it) refused the lookup channel's upgrade, lookups
go over HTTP for this long before the upgrade is tried again."""


class _Retry(Retry):
    """Retries only fast failures: a timeout is not retried (the wait would double)."""

    def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
        if is_timeout(error):
            raise MaxRetryError(_pool, url, error)
        return super().increment(method, url, response, error, _pool, _stacktrace)


class _Session:
    """This client's signed session with the daemon (kvtier.auth), opened lazily."""

    def __init__(self, token: str) -> None:
        self.token, self.key_id = token, auth.key_id(token)
        self.lock = threading.Lock()
        self.sid: str | None = None
        self.key = b""
        self._counter = itertools.count(1)

    def sign(self, method: str, path_qs: str, endpoint: str) -> tuple[str, int]:
        with self.lock:
            sid, key, n = self.sid, self.key, next(self._counter)
        sig = auth.request_signature(key, method, path_qs, n, endpoint)
        return auth.format_params(auth.SESSION, id=sid, n=n, sig=sig), n

    def proves(self, response, counter: int | None) -> bool:
        proof = response.headers.get(auth.PROOF_HEADER, "")
        return counter is not None and auth.equal(proof, auth.response_proof(self.key, counter, response.status))


class _Head:
    """Status and headers of a reply (what :meth:`_Session.proves` reads)."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, _Headers(headers)


class DaemonClient:
    """Connections, authentication and failure bookkeeping of one daemon (see
    :class:`~kvtier.tiers.remote.RemoteTier` for the arguments)."""

    def __init__(
        self, url: str, token: str | None = None, timeout_s: float = 2.0, *, max_connections: int = 16,
        retries: int = 2, backoff_s: float = MIN_S, max_backoff_s: float = MAX_S,
    ) -> None:
        self.backoff = Backoff(backoff_s, max_backoff_s)
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.errors: Counter = Counter()
        self._pool, base, kind = make_pool(
            self.url, maxsize=max_connections, block=False, timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
            retries=_Retry(total=retries, connect=retries, read=retries, redirect=0, status=0, other=0,
                           backoff_factor=backoff_s / 2, allowed_methods=None, raise_on_status=False),
        )
        self._root = base
        self._base = base + "/v1/namespaces/"
        # Small calls go through quick_request on open pooled connections (plain HTTP and
        # Unix sockets): the Host header http.client would send.
        host = self._pool.host
        self._quick_host: str | None = None
        if kind == "unix":
            self._quick_host = "localhost"
        elif kind == "http":
            host = f"[{host}]" if ":" in host else host
            self._quick_host = host if self._pool.port in (None, 80) else f"{host}:{self._pool.port}"
        self._session = _Session(token) if token and kind == "http" else None
        self._headers = {"Authorization": f"Bearer {token}"} if token and self._session is None else {}
        self._lock = threading.Lock()
        self._logged: set[str] = set()  # kinds of warnings already logged
        self._closed = False
        # The lookup channel (kvtier.server.channel): its path once a registration reply named
        # it (plain HTTP and Unix sockets only), idle channels, when HTTP is used instead until
        self._channel_path: str | None = None
        self._channels: list[Channel] = []
        self._max_channels = max_connections
        self._channel_off_until = 0.0

    def close(self) -> None:
        """Release the pooled connections; later calls are misses. Idempotent."""
        self._closed = True
        self._pool.close()
        self._drop_channels()

    # -- the lookup channel -----------------------------------------------------------------------
    def _offer_channel(self, path: object) -> None:
        """A registration reply's ``channel`` path: lookups use it from now on (over plain
        HTTP and Unix sockets; https stays on HTTP)."""
        if (isinstance(path, str) and path.startswith("/v1/") and path.isascii() and path.isprintable()
                and " " not in path and self._quick_host is not None):
            self._channel_path = self._root + path

    def _channel_exchange(self, ctx: Call, payload: bytes, cap: int) -> bytes | None:
        """One request message and its reply on the lookup channel (a pooled WebSocket, or a
        new one), bounded by the call's deadline (the watchdog). ``None``: the channel is not
        available (no daemon offered it, the daemon or a proxy refused the upgrade: HTTP for
        :data:`CHANNEL_RETRY_S`, a session to renew): the caller goes over HTTP. Raises
        :class:`Failed` like an HTTP exchange (``skipped``, ``timeout``, ``unavailable``,
        ``unauthorized``, ``unproven``, ``protocol``)."""
        if self._closed:
            raise Failed("unavailable")
        if self._channel_path is None or time.monotonic() < self._channel_off_until:
            return None
        if self.backoff.paused():
            raise Failed("skipped")
        for attempt in range(2):
            with self._lock:
                channel = self._channels.pop() if self._channels else None
            if channel is None:
                channel = self._open_channel(ctx)
                if channel is None:
                    return None
            try:
                ctx.tokens.append(WATCHDOG.arm(channel.sock, ctx.deadline))
                data = channel.exchange(payload, cap)
            except _Stale:  # a channel the daemon closed (idle, restarted): the others are too
                channel.close()
                self._drop_channels()
                if attempt == 0 and not ctx.expired():
                    continue
                self._down("channel closed")
                raise Failed("timeout" if ctx.expired() else "unavailable") from None
            except ValueError:
                channel.close()
                raise Failed("protocol") from None
            except (OSError, ChannelClosed) as exc:
                channel.close()
                if isinstance(exc, ChannelClosed) and exc.code == 1009:
                    raise Failed("rejected") from None  # a frame over the daemon's cap
                self._down(exc)
                raise Failed("timeout" if ctx.expired() or isinstance(exc, TimeoutError) else "unavailable") from None
            with self._lock:
                if len(self._channels) < self._max_channels and not self._closed:
                    self._channels.append(channel)
                    channel = None
            if channel is not None:
                channel.close()
            self._up()
            return data
        raise AssertionError("unreachable")

    def _drop_channels(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, []
        for channel in channels:
            channel.close()

    def _open_channel(self, ctx: Call) -> Channel | None:
        """A new channel: connect (as the pool's connections do), upgrade with this client's
        credentials (Bearer, or signed for the socket's peer with the 101 proven: kvtier.auth).
        ``None`` when the upgrade is refused. Raises :class:`Failed`."""
        assert self._channel_path is not None and self._quick_host is not None
        conn = self._pool._new_conn()
        try:
            conn.connect()
        except (OSError, HTTPError) as exc:
            conn.close()
            self._down(exc)
            raise Failed("timeout" if is_timeout(exc) or ctx.expired() else "unavailable") from None
        sock = conn.sock
        ctx.tokens.append(WATCHDOG.arm(sock, ctx.deadline))
        headers, counter = dict(self._headers), None
        try:
            if self._session is not None:
                headers["Authorization"], counter = self._session.sign("GET", self._channel_path,
                                                                       endpoint(sock.getpeername()))
            status, reply, rest = Channel.handshake(sock, self._quick_host, self._channel_path, headers)
        except (_Stale, OSError, ValueError) as exc:
            conn.close()
            if isinstance(exc, ValueError):
                raise Failed("protocol") from None
            self._down(exc)
            raise Failed("timeout" if ctx.expired() else "unavailable") from None
        head = _Head(status, reply)
        if status == 401 and self._session is not None and 'error="renew"' in reply.get("www-authenticate", ""):
            conn.close()
            with self._session.lock:
                self._session.sid = None  # the HTTP call that follows says hello again
            return None
        if status in (101, 401) and self._session is not None and not self._session.proves(head, counter):
            conn.close()  # as on HTTP: a reply without the proof is refused, whatever it says
            self._warn("unproven", "daemon %s did not prove it holds the token (is another process "
                       "listening on its port?): its replies are refused", self.url)
            self._down("no proof of the token")
            raise Failed("unproven")
        if status == 401:
            conn.close()
            raise Failed("unauthorized")
        if status != 101:  # an older daemon, a proxy that does not pass upgrades: HTTP for a while
            conn.close()
            self._warn("channel refused", "daemon %s refused the lookup channel's upgrade (HTTP %d): lookups go "
                       "over HTTP", self.url, status)
            self._channel_off_until = time.monotonic() + CHANNEL_RETRY_S
            return None
        return Channel(sock, conn, rest)

    # -- admin (raise: these are commands, not cache traffic) ----------------------------------
    def namespaces(self) -> list[dict]:
        """Every tenant's namespaces (admin token): ``[{"tenant", "namespace" (hex), "label",
        "block_shape", "dtype", "usage"}]``. Raises ``PermissionError`` (401/403),
        ``RuntimeError`` (unreachable, another error)."""
        reply = self._admin("GET", "/v1/admin/namespaces", cap=(4 << 20))
        return list(reply.get("namespaces", []))

    def reset(self, namespace: bytes | None = None, tenant: str | None = None) -> int:
        """Empty namespaces on the daemon (admin token): every tier of one ``namespace`` (of
        ``tenant``, default the token's own tenant), or of every namespace of every tenant
        when ``namespace`` is None; they stay registered. Returns how many were emptied.
        Raises ``PermissionError``, ``RuntimeError``, ``LookupError`` (no such namespace)."""
        if namespace is None:
            return int(self._admin("POST", "/v1/admin/reset").get("reset", 0))
        self._admin("POST", self._admin_path(namespace, tenant) + "/reset")
        return 1

    def delete(self, namespace: bytes, tenant: str | None = None) -> None:
        """Delete ``namespace`` (of ``tenant``, default the token's own) and all its blocks
        (admin token). Raises ``PermissionError``, ``RuntimeError``, ``LookupError``."""
        self._admin("DELETE", self._admin_path(namespace, tenant))
        self._forget(namespace)

    def _forget(self, namespace: bytes) -> None:
        """A namespace deleted on the daemon (RemoteTier registers it again lazily)."""

    def _admin_path(self, namespace: bytes, tenant: str | None) -> str:
        ns = namespace_hex(check_namespace(namespace))
        if tenant is None:
            return f"/v1/namespaces/{ns}"
        return f"/v1/admin/tenants/{parse_tenant(tenant)}/namespaces/{ns}"

    def _admin(self, method: str, path: str, cap: int = SMALL_REPLY_NBYTES, timeout_s: float = _ADMIN_TIMEOUT_S) -> dict:
        try:
            with call(timeout_s) as ctx:  # emptying namespaces takes a while: not cache traffic
                self._ensure_session(ctx)
                response = self._request(ctx, method, self._root + path, b"", None, probe=False,
                                         read_timeout_s=timeout_s)
                if response.status in (200, 201):
                    return unpack_map(read_capped(response, cap, ctx), "admin reply")
                message = self._error_text(response, ctx)
        except Failed as exc:
            raise RuntimeError(f"daemon {self.url}: {exc.reason}") from None
        except ValueError as exc:
            raise RuntimeError(f"daemon {self.url}: {exc}") from None
        if response.status in (401, 403):
            raise PermissionError(f"daemon {self.url} answered {response.status}: {message}")
        if response.status == 404:
            raise LookupError(f"daemon {self.url}: {message}")
        raise RuntimeError(f"daemon {self.url} answered {response.status}: {message}")

    # -- HTTP -------------------------------------------------------------------------------------
    def _request(self, ctx: Call, method: str, path: str, body: Any, content_type: str | None, *,
                 headers: dict | None = None, probe: bool = True, read_timeout_s: float | None = None,
                 quick_cap: int | None = None):
        """One HTTP exchange (urllib3 retries fast failures), signed and proven when the
        daemon is reached over ``http://`` with a token; a session the daemon forgot (it
        restarted) is opened again once. Any status comes back, its body unread. Raises
        :class:`Failed` when the daemon cannot be reached, does not prove itself, or is busy.
        ``quick_cap``: an idempotent call with a small bytes body whose reply is at most that
        many bytes, sent through :func:`~kvtier.tiers.transport.quick_request` when a pooled
        connection is open (its reply is read whole)."""
        for attempt in range(2):
            response = self._exchange(ctx, method, path, body, content_type, headers, probe, read_timeout_s,
                                      quick_cap)
            if self._session is None:
                return response
            if response.status == 401 and 'error="renew"' in response.headers.get("WWW-Authenticate", ""):
                discard(response, drop=True)
                with self._session.lock:
                    self._session.sid = None
                if attempt == 0:
                    self._ensure_session(ctx)
                    continue
                raise Failed("unauthorized")
            if not self._session.proves(response, ctx.counter):
                discard(response, drop=True)
                self._warn("unproven", "daemon %s did not prove it holds the token (is another process "
                           "listening on its port?): its replies are refused", self.url)
                self._down("no proof of the token")
                raise Failed("unproven")
            return response
        raise AssertionError("unreachable")

    def _exchange(self, ctx: Call, method: str, path: str, body: Any, content_type: str | None,
                  headers: dict | None, probe: bool, read_timeout_s: float | None = None,
                  quick_cap: int | None = None):
        if self._closed:
            raise Failed("unavailable")
        if probe and self.backoff.paused():
            raise Failed("skipped")
        all_headers = {**self._headers, **(headers or {})}
        if content_type is not None:
            all_headers["Content-Type"] = content_type
        if quick_cap is not None and self._quick_host is not None and isinstance(body, bytes) and not read_timeout_s:
            try:
                response = quick_request(self._pool, self._quick_host, method, path, body, all_headers, quick_cap, ctx)
            except Failed as exc:
                if exc.reason != "protocol":
                    self._down(exc.reason)
                raise
            if response is not None:
                return self._checked(response)
        try:
            longer = {"timeout": urllib3.Timeout(connect=self.timeout_s, read=read_timeout_s)} if read_timeout_s else {}
            response = self._pool.urlopen(method, path, body=body, headers=all_headers, preload_content=False,
                                          decode_content=False, redirect=False, **longer)
        except MaxRetryError as exc:
            self._down(exc.reason)
            raise Failed("timeout" if is_timeout(exc.reason) or ctx.expired() else "unavailable") from None
        except (HTTPError, OSError, http.client.HTTPException) as exc:
            self._down(exc)
            raise Failed("timeout" if is_timeout(exc) or ctx.expired() else "unavailable") from None
        return self._checked(response)

    def _checked(self, response):
        """``response``, unless it says the daemon is busy (503 with Retry-After) or failing (5xx)."""
        if response.status == 503 and response.headers.get("Retry-After"):
            discard(response, drop=True)
            raise Failed("busy")  # up, but no room now: no pause
        if response.status >= 500:
            discard(response, drop=True)
            self._down(f"HTTP {response.status}")
            raise Failed("unavailable")
        self._up()
        return response

    def _ensure_session(self, ctx: Call) -> None:
        """Open the signed session if there is none (``POST /v1/auth/hello``, kvtier.auth)."""
        session = self._session
        if session is None:
            return
        ctx.signer = None
        with session.lock:
            if session.sid is None:
                self._hello(ctx, session)
        ctx.signer = session.sign

    def _hello(self, ctx: Call, session: _Session) -> None:
        nonce, ts = auth.nonce(), int(time.time())
        value = auth.format_params(auth.HELLO, key=session.key_id, nonce=nonce, ts=ts,
                                   sig=auth.hello_signature(session.token, session.key_id, nonce, ts))
        response = self._exchange(ctx, "POST", self._root + auth.HELLO_PATH, b"", None, {"Authorization": value}, True)
        self._check_status(response, ctx)
        try:
            reply = unpack_map(read_capped(response, SMALL_REPLY_NBYTES, ctx), "hello")
            sid, server_nonce = reply["session"], reply["nonce"]
            proof = auth.hello_proof(session.token, nonce, str(sid), str(server_nonce))
        except (ValueError, KeyError):
            raise Failed("protocol") from None
        if not auth.equal(response.headers.get(auth.PROOF_HEADER, ""), proof):
            self._warn("unproven", "daemon %s did not prove it holds the token (is another process listening "
                       "on its port?): its replies are refused", self.url)
            self._down("no proof of the token")
            raise Failed("unproven")
        session.sid, session.key = sid, auth.session_key(session.token, sid, nonce, server_nonce)

    def _check_status(self, response, ctx: Call) -> None:
        if response.status in (200, 201):
            return
        message = self._error_text(response, ctx)
        reason = {401: "unauthorized", 403: "unauthorized", 404: "unregistered"}.get(response.status, "rejected")
        self._warn(f"HTTP {response.status}", "daemon %s answered %d: %s", self.url, response.status, message)
        raise Failed(reason)

    def _error_text(self, response, ctx: Call) -> str:
        """The error message of a reply (at most 4 KiB read; more: the connection is dropped)."""
        try:
            data = read_capped(response, SMALL_REPLY_NBYTES, ctx)
        except Failed:
            return "(no readable body)"
        return data[:300].decode("utf-8", "replace") if data else "(no body)"

    # -- bookkeeping ------------------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1

    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        """A warning the first time for each kind, debug after (a caller in a loop)."""
        level = logging.DEBUG if kind in self._logged else logging.WARNING
        self._logged.add(kind)
        logger.log(level, msg, *args)

    def _down(self, cause: Any) -> None:
        if not self.backoff.down:
            logger.warning("daemon %s unreachable (%s): its blocks are misses until it is back", self.url, cause)
        self.backoff.failed()

    def _up(self) -> None:
        if self.backoff.succeeded():
            logger.info("daemon %s reachable again", self.url)
