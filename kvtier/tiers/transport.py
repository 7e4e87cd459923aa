"""HTTP to the ``kvtier serve`` daemon for :class:`kvtier.tiers.remote.RemoteTier`: connection
pools over TCP (``http://``, ``https://``) or a Unix socket (``unix:///path``), one overall
deadline per call, and capped reads.

Deadlines (issue 12: "a daemon that trickles a small reply blocks lookup far past
remote_timeout_s"): a per-read socket timeout does not bound a call, since a daemon that sends
a byte now and then keeps every read within it. So every call runs in a :func:`call` context
with a deadline; each socket the call sends on is armed with it (:class:`_Watchdog`: one
thread that shuts a socket down when its deadline passes, which makes a blocked send or
recv return at once), from the request line to the last byte of the reply. Replies are read
with a cap (:func:`read_capped`): a huge reply to a small call is refused, not buffered.

The same context signs requests (kvtier.auth): the signature names the address of the
socket the request actually goes out on, known only once connected, so it is made in
:meth:`_Armed.request`.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import HTTPError, NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from kvtier.auth import endpoint
from kvtier.checks import parse_unix_url


class Failed(Exception):
    """A call that did not complete; ``reason`` is its ``errors`` key."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Watchdog:
    """One thread that shuts down sockets whose deadline has passed. It is woken only when
    a socket is armed with a deadline before its next check (under steady traffic of calls
    with the same timeout: about once per timeout, not once per call: a thread switch per
    lookup would cost more than the lookup's own client work)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, socket.socket]] = {}
        self._next = 0
        self._wakes_at = float("inf")  # when the thread checks next (inf: not started)
        self._thread: threading.Thread | None = None

    def arm(self, sock: socket.socket, deadline: float) -> int:
        with self._cond:
            self._next += 1
            self._armed[self._next] = (deadline, sock)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-remote-watchdog", daemon=True)
                self._thread.start()
            if deadline < self._wakes_at:
                self._wakes_at = deadline  # set here too: arms before the thread wakes do not notify again
                self._cond.notify()
            return self._next

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for token, (deadline, sock) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[token]
                        try:
                            sock.shutdown(socket.SHUT_RDWR)  # the blocked send or recv returns at once
                        except OSError:
                            pass
                next_deadline = min((d for d, _ in self._armed.values()), default=now + 60.0)
                self._wakes_at = max(now + 0.001, next_deadline)
                self._cond.wait(self._wakes_at - now)


WATCHDOG = _Watchdog()
Signer = Callable[[str, str, str], tuple[str, int]]
"""``signer(method, path_qs, endpoint) -> (Authorization value, counter)``."""


class Call:
    """One call's deadline, the sockets armed for it, and how its requests are signed."""

    def __init__(self, deadline: float, signer: Signer | None) -> None:
        self.deadline, self.signer = deadline, signer
        self.tokens: list[int] = []
        self.counter: int | None = None

    def expired(self) -> bool:
        return time.monotonic() > self.deadline


_CURRENT = threading.local()


@contextmanager
def call(timeout_s: float, signer: Signer | None = None) -> Iterator[Call]:
    """Run the block as one call of at most ``timeout_s`` seconds (on this thread)."""
    ctx = Call(time.monotonic() + timeout_s, signer)
    outer = getattr(_CURRENT, "call", None)
    _CURRENT.call = ctx
    try:
        yield ctx
    finally:
        _CURRENT.call = outer
        for token in ctx.tokens:
            WATCHDOG.disarm(token)


_ONE_SEND_NBYTES = 64 << 10
"""A bytes body up to this size goes out in one send with the request's headers."""


class _Armed:
    """Connection mixin: connect, arm the socket with the current call's deadline and sign
    the request, then send it: a small bytes body (lookup, get request, register) in the same
    ``send`` as the headers (urllib3 sends them apart: two packets, and two wake-ups and
    parser runs on the daemon per call)."""

    _body_with_headers: bytes | None = None

    def request(self, method: str, url: str, body: Any = None, headers: Any = None, **kwargs: Any) -> None:
        self._body_with_headers = None
        if isinstance(body, bytes) and len(body) <= _ONE_SEND_NBYTES:
            headers = {**(headers or {}), "Content-Length": str(len(body))}
            body, self._body_with_headers = None, body
        ctx: Call | None = getattr(_CURRENT, "call", None)
        if ctx is not None and ctx.expired():
            raise urllib3.exceptions.ReadTimeoutError(None, url, "call deadline passed")  # type: ignore[arg-type]
        if self.sock is None:  # type: ignore[attr-defined]
            self.connect()  # type: ignore[attr-defined]
        if ctx is not None:
            ctx.tokens.append(WATCHDOG.arm(self.sock, ctx.deadline))  # type: ignore[attr-defined]
            if ctx.signer is not None:
                value, ctx.counter = ctx.signer(method, url, endpoint(self.sock.getpeername()))  # type: ignore
                headers = {**(headers or {}), "Authorization": value}
        super().request(method, url, body=body, headers=headers, **kwargs)  # type: ignore[misc]

    def send(self, data: Any) -> None:
        """The first send after the headers were buffered (``http.client``'s header block)
        carries the small body along."""
        if self._body_with_headers is not None and isinstance(data, bytes):
            data, self._body_with_headers = data + self._body_with_headers, None
        super().send(data)  # type: ignore[misc]


class _TCP(_Armed, HTTPConnection):
    pass


class _TLS(_Armed, HTTPSConnection):
    pass


class _Unix(_Armed, HTTPConnection):
    """HTTP over a Unix socket (``socket_path``); ``Host: localhost``."""

    socket_path = ""

    def _new_conn(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise NewConnectionError(self, f"cannot connect to {self.socket_path}: {exc}") from exc
        return sock


class _UnixPool(HTTPConnectionPool):
    ConnectionCls = _Unix

    def __init__(self, socket_path: str, **kwargs: Any) -> None:
        super().__init__("localhost", **kwargs)
        self.socket_path = socket_path

    def _new_conn(self):
        conn = super()._new_conn()
        conn.socket_path = self.socket_path
        return conn


class _TCPPool(HTTPConnectionPool):
    ConnectionCls = _TCP


class _TLSPool(HTTPSConnectionPool):
    ConnectionCls = _TLS


def make_pool(url: str, **kwargs: Any) -> tuple[HTTPConnectionPool, str, str]:
    """``(pool, base path, kind)`` for ``url``: ``kind`` is ``"http"``, ``"https"`` or
    ``"unix"``. Raises ``ValueError`` for any other URL."""
    if url.startswith("unix:"):
        return _UnixPool(parse_unix_url(url), **kwargs), "", "unix"
    parsed = urllib3.util.parse_url(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"expected a daemon URL like http://127.0.0.1:8765 or unix:///run/kvtier/kvtier.sock, "
                         f"got {url!r}")
    cls = _TLSPool if parsed.scheme == "https" else _TCPPool
    return cls(parsed.host, port=parsed.port, **kwargs), (parsed.path or "").rstrip("/"), parsed.scheme


def is_timeout(error: object) -> bool:
    """A connect or read timeout (urllib3 makes a refused connection a kind of timeout)."""
    return isinstance(error, Urllib3Timeout) and not isinstance(error, NewConnectionError)


class Reader:
    """Exact reads from a streamed response body, straight into caller memory where the
    underlying ``http.client`` response allows it (urllib3's own ``readinto`` goes through
    an intermediate bytes object). Raises :class:`Failed` on a cut, a stall or the call's
    deadline (enforced from outside by the watchdog)."""

    def __init__(self, response, ctx: Call) -> None:
        self.response, self.ctx = response, ctx
        fp = getattr(response, "_fp", None)
        self._raw = fp if isinstance(fp, http.client.HTTPResponse) else None

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return bytes(buf)

    def readinto(self, view: memoryview) -> None:
        offset = 0
        while offset < len(view):
            if self.ctx.expired():
                raise Failed("timeout")
            try:
                n = (self._raw or self.response).readinto(view[offset:])
            except (TimeoutError, Urllib3Timeout):
                raise Failed("timeout") from None
            except (OSError, HTTPError, http.client.HTTPException, ValueError):
                raise Failed("timeout" if self.ctx.expired() else "unavailable") from None
            if not n:  # the stream ended early: the daemon went away, or the watchdog cut it
                raise Failed("timeout" if self.ctx.expired() else "unavailable")
            offset += n

    def finish(self, clean: bool) -> None:
        """Return the connection to the pool after a complete stream; drop it otherwise."""
        if clean:
            try:
                self.response.read()  # the chunked terminator: the connection can be reused
                self.response.release_conn()
                return
            except (OSError, HTTPError, http.client.HTTPException, ValueError):
                pass
        discard(self.response, drop=True)


def read_capped(response, cap: int, ctx: Call) -> bytes:
    """The whole body of ``response`` (streamed), at most ``cap`` bytes; raises
    :class:`Failed` ("protocol") beyond, before reading it all, or ("timeout") past the
    call's deadline. The connection goes back to the pool only after a clean read."""
    declared = response.headers.get("Content-Length")
    if declared is not None and (not declared.isdigit() or int(declared) > cap):
        discard(response, drop=True)
        raise Failed("protocol")
    out = bytearray()
    try:
        if declared is not None:  # one read of the declared length (no second read to find the end)
            body = response.read(int(declared))
            if len(body) < int(declared):
                raise OSError("the reply ended before its Content-Length")
            response.release_conn()
            return body
        while True:
            piece = response.read(min(64 << 10, cap + 1 - len(out)))
            if not piece:
                break
            out += piece
            if len(out) > cap:
                discard(response, drop=True)
                raise Failed("protocol")
    except (OSError, HTTPError, http.client.HTTPException, ValueError):
        discard(response, drop=True)
        raise Failed("timeout" if ctx.expired() else "unavailable") from None
    response.release_conn()
    return bytes(out)


def discard(response, drop: bool = False) -> None:
    """Let go of a response: close its connection (``drop``) or hand it back to the pool."""
    try:
        if drop:
            response.close()
        else:
            response.drain_conn()
        response.release_conn()
    except (OSError, HTTPError, http.client.HTTPException, ValueError):
        pass
