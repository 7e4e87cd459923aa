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

import base64
import hashlib
import http.client
import os
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


class QuickResponse:
    """The reply of :func:`quick_request`, read whole (status line, headers, a body of its
    ``Content-Length``): the parts of urllib3's response interface that :func:`read_capped`,
    :func:`discard` and the daemon client use."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes, pool, conn) -> None:
        self.status, self.headers, self._body = status, _Headers(headers), body
        self._pool, self._conn = pool, conn

    def read(self, amt: int | None = None) -> bytes:
        body = self._body if amt is None else self._body[:amt]
        self._body = self._body[len(body) :]
        return body

    def release_conn(self) -> None:
        """Hand the connection back to the pool (closed first when the daemon said it closes it)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            if self.headers.get("Connection", "").lower() == "close":
                conn.close()
            self._pool._put_conn(conn)

    def drain_conn(self) -> None:
        self._body = b""

    def close(self) -> None:
        """Drop the connection (closed, its pool slot freed)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            self._pool._put_conn(conn)


class _Headers(dict):
    """Reply headers by lowercase name (the first of repeated ones), looked up in any case."""

    def get(self, name: str, default=None):  # type: ignore[override]
        return super().get(name.lower(), default)


QUICK_HEAD_NBYTES = 16 << 10
"""Most bytes of status line and headers :func:`quick_request` reads (the daemon sends ~200)."""


def quick_request(pool, host_header: str, method: str, url: str, body: bytes, headers: dict[str, str], cap: int,
                  ctx: Call) -> QuickResponse | None:
    """A small idempotent call (a lookup) on a pooled connection that is already open,
    written and read here rather than by urllib3 and ``http.client``, whose request building
    and (``email`` package) header parsing were about 2/3 of a lookup's client CPU on
    loopback (issue 17): one ``sendall`` of the request line, headers and body, then
    ``recv`` until the headers end and the ``Content-Length`` body is in.

    Same rules as the urllib3 path: the socket is armed with the call's deadline (the
    watchdog), the request signed for the socket's peer (kvtier.auth), a reply over ``cap``
    bytes refused before its body is read (``protocol``), and so is a reply without a
    ``Content-Length`` (the daemon always sends one for small calls) or one whose headers
    exceed :data:`QUICK_HEAD_NBYTES`.

    Returns ``None``, having sent nothing or got no byte back, when there is no open pooled
    connection, the call's deadline already passed, or the connection turns out closed or
    reset (a keep-alive the daemon dropped): the caller then goes through urllib3 (which
    connects and retries). Raises :class:`Failed` (``timeout``, ``unavailable``,
    ``protocol``) once the reply has begun or the wait timed out."""
    if ctx.expired():
        return None
    try:
        conn = pool._get_conn()
    except HTTPError:  # the pool was closed: urllib3 says so the usual way
        return None
    sock = getattr(conn, "sock", None)
    if sock is None:  # a new connection: urllib3 connects it
        pool._put_conn(conn)
        return None
    try:
        lines = [f"{method} {url} HTTP/1.1", f"Host: {host_header}", "Accept-Encoding: identity",
                 f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        ctx.tokens.append(WATCHDOG.arm(sock, ctx.deadline))
        if ctx.signer is not None:
            value, ctx.counter = ctx.signer(method, url, endpoint(sock.getpeername()))
            lines.append(f"Authorization: {value}")
        _send_request(sock, lines, body)
        status, reply_headers, rest = _read_head(sock)
    except _Stale:
        conn.close()
        pool._put_conn(conn)
        if ctx.expired():  # the watchdog shut it down: a daemon that never answered
            raise Failed("timeout") from None
        return None
    except Failed:
        conn.close()
        pool._put_conn(conn)
        raise
    except (OSError, ValueError) as exc:  # a timeout, a reset after the reply began, a bad header
        conn.close()
        pool._put_conn(conn)
        if isinstance(exc, ValueError):
            raise Failed("protocol") from None
        raise Failed("timeout" if ctx.expired() or isinstance(exc, TimeoutError) else "unavailable") from None
    response = QuickResponse(status, reply_headers, b"", pool, conn)
    declared = reply_headers.get("content-length")
    if declared is None or not declared.isdigit() or int(declared) > cap:
        response.close()
        raise Failed("protocol")
    try:
        response._body = _read_exactly(sock, int(declared), rest)
    except OSError:
        response.close()
        raise Failed("timeout" if ctx.expired() else "unavailable") from None
    return response


class _Stale(Exception):
    """The connection was closed or reset before any byte of the reply came."""


def _send_request(sock: socket.socket, lines: list[str], body: bytes = b"") -> None:
    """One ``sendall`` of a request's line and headers (``lines``) and ``body``; raises
    :class:`_Stale` when the connection turns out closed (a keep-alive the daemon dropped)."""
    try:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    except (BrokenPipeError, ConnectionResetError):
        raise _Stale from None


def _read_head(sock: socket.socket, upgrade: bool = False) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers by lowercase name, bytes read past them)``; raises :class:`_Stale`,
    ``ValueError`` (not HTTP/1.x, headers too long), ``OSError``."""
    buf = b""
    while True:
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            if buf:
                raise
            raise _Stale from None
        if not data:
            if buf:
                raise ConnectionResetError("the reply ended inside its headers")
            raise _Stale
        start = max(0, len(buf) - 3)
        buf += data
        end = buf.find(b"\r\n\r\n", start)
        if end >= 0:
            break
        if len(buf) > QUICK_HEAD_NBYTES:
            raise ValueError("reply headers too long")
    head, rest = buf[:end].decode("latin-1"), buf[end + 4 :]
    status_line, *lines = head.split("\r\n")
    version, _, tail = status_line.partition(" ")
    code = tail[:3]
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise ValueError(f"bad header line {line[:80]!r}")
        headers.setdefault(name.lower(), value.strip())
    if "transfer-encoding" in headers and not upgrade:
        raise ValueError("a chunked reply to a small call")
    return int(code), headers, rest


def _read_exactly(sock: socket.socket, n: int, got: bytes) -> bytes:
    if len(got) >= n:
        if len(got) > n:
            raise ConnectionResetError("bytes after the reply (HTTP/1.1 allows one call at a time)")
        return got
    buf = bytearray(n)
    buf[: len(got)] = got
    view, offset = memoryview(buf), len(got)
    while offset < n:
        k = sock.recv_into(view[offset:])
        if not k:
            raise ConnectionResetError("the reply ended inside its body")
        offset += k
    return bytes(buf)


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


# -- the lookup channel (WebSocket, RFC 6455) ----------------------------------------------------
CHANNEL_PROTOCOL = "kvtier.v1"
"""The subprotocol of the daemon's lookup channel (kvtier.server.channel)."""
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_BINARY, _CLOSE, _PING, _PONG = 0x2, 0x8, 0x9, 0xA


class ChannelClosed(Exception):
    """The daemon closed the channel (a close frame): ``code`` (1009: a frame over its cap)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"channel closed ({code}): {reason}")
        self.code = code


class Channel:
    """A client WebSocket on a connected socket (RFC 6455), for the daemon's lookup channel:
    one binary message each way per :meth:`exchange`. Written here, not with a WebSocket
    library, for the same reason as :func:`quick_request`: a lookup's whole client cost is a
    few microseconds of framing, and the calls are synchronous on the store's threads.

    Client frames are masked with a fresh random key each (RFC 6455 5.3); server frames must
    not be (a masked one is a protocol error), nor fragmented (aiohttp sends each message as
    one frame), nor carry RSV bits (no extension was agreed). Pings are answered."""

    def __init__(self, sock: socket.socket, conn: Any = None, buffered: bytes = b"") -> None:
        self.sock, self._conn = sock, conn
        self._buf = bytearray(buffered)

    @classmethod
    def handshake(cls, sock: socket.socket, host_header: str, path: str,
                  headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """Send the upgrade request and read the reply's head: ``(status, headers, bytes after
        them)``. Status 101 is checked (``Upgrade``, ``Sec-WebSocket-Accept`` for our key, the
        subprotocol): ``ValueError`` when it is not a WebSocket reply to this request. Raises
        :class:`_Stale`, ``OSError``, ``ValueError`` (not HTTP)."""
        key = base64.b64encode(os.urandom(16))
        lines = [f"GET {path} HTTP/1.1", f"Host: {host_header}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {key.decode()}", "Sec-WebSocket-Version: 13",
                 f"Sec-WebSocket-Protocol: {CHANNEL_PROTOCOL}", "Content-Length: 0"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        _send_request(sock, lines)
        status, reply, rest = _read_head(sock, upgrade=True)
        if status == 101:
            accept = base64.b64encode(hashlib.sha1(key + _WS_GUID).digest()).decode()
            if (reply.get("upgrade", "").lower() != "websocket" or reply.get("sec-websocket-accept") != accept
                    or reply.get("sec-websocket-protocol") != CHANNEL_PROTOCOL
                    or reply.get("sec-websocket-extensions")):
                raise ValueError("a 101 reply that is not the WebSocket this client asked for")
        return status, reply, rest

    def exchange(self, payload: bytes, cap: int) -> bytes:
        """Send ``payload`` as one binary message, return the reply message (at most ``cap``
        bytes). Raises :class:`_Stale` (closed before any byte of the reply),
        :class:`ChannelClosed`, ``OSError``, ``ValueError`` (a protocol error, a reply over
        ``cap``)."""
        try:
            self.sock.sendall(_client_frame(_BINARY, payload))
        except (BrokenPipeError, ConnectionResetError):
            raise _Stale from None
        first = True
        while True:
            opcode, data = self._read_frame(cap, first)
            first = False
            if opcode == _BINARY:
                return data
            if opcode == _PING:
                self.sock.sendall(_client_frame(_PONG, data))
            elif opcode == _CLOSE:
                code = int.from_bytes(data[:2], "big") if len(data) >= 2 else 1005
                raise ChannelClosed(code, data[2:].decode("utf-8", "replace"))
            elif opcode != _PONG:
                raise ValueError(f"unexpected WebSocket opcode {opcode}")

    def close(self) -> None:
        """A close frame (best effort), then the socket."""
        try:
            self.sock.sendall(_client_frame(_CLOSE, (1000).to_bytes(2, "big")))
        except OSError:
            pass
        if self._conn is not None:
            self._conn.close()
        else:
            self.sock.close()

    def _read_frame(self, cap: int, first: bool) -> tuple[int, bytes]:
        head = self._read(2, first)
        b0, b1 = head[0], head[1]
        if b0 & 0x70 or not b0 & 0x80 or b1 & 0x80:
            raise ValueError("a fragmented, masked or extended WebSocket frame from the daemon")
        opcode, n = b0 & 0x0F, b1 & 0x7F
        if n == 126:
            n = int.from_bytes(self._read(2), "big")
        elif n == 127:
            n = int.from_bytes(self._read(8), "big")
        if n > cap or (opcode >= 0x8 and n > 125):
            raise ValueError(f"a WebSocket frame of {n} bytes (at most {cap} expected)")
        return opcode, self._read(n)

    def _read(self, n: int, first: bool = False) -> bytes:
        buf = self._buf
        while len(buf) < n:
            try:
                data = self.sock.recv(max(65536, n - len(buf)))
            except (ConnectionResetError, BrokenPipeError):
                if first and not buf:
                    raise _Stale from None
                raise
            if not data:
                if first and not buf:
                    raise _Stale
                raise ConnectionResetError("the channel ended inside a frame")
            buf += data
        out = bytes(buf[:n])
        del buf[:n]
        return out


def _client_frame(opcode: int, payload: bytes) -> bytes:
    """One final client frame: masked with a fresh random key (RFC 6455 5.2, 5.3)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    key = os.urandom(4)
    if not n:
        return head + key
    # XOR as one big integer: the key repeated over the payload (a few us for a lookup)
    mask = int.from_bytes((key * (n // 4 + 1))[:n], "little")
    return head + key + (int.from_bytes(payload, "little") ^ mask).to_bytes(n, "little")
