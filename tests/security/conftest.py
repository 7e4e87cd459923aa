"""Shared pieces of the attack tests (issue 12): a daemon with tenants and short deadlines on a
background thread, raw HTTP over a socket (so a test sends exactly the bytes an attacker
would), and a socket server that plays a hostile daemon to the client."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.unit.server.conftest import (  # noqa: F401 (spawn: a fixture)
    SPEC, LoopbackServer, ThreadDaemon, ns_url, serve_settings, spawn,
)
from kvtier.wire import FRAMES, MSGPACK, pack, spec_to_wire

ADMIN = "admin-token-0123456789abcdef"
TOKEN_A = "tenant-a-token-0123456789abc"
TOKEN_B = "tenant-b-token-0123456789abc"
NS = bytes(range(32))
OTHER_NS = bytes(range(1, 33))


def token_file(path: Path, doc: dict | None = None) -> Path:
    """A JSON token file (mode 0600): tenant ``ops`` (admin), ``a`` and ``b``."""
    doc = doc or {"tenants": {
        "ops": {"admin": True, "tokens": [ADMIN]},
        "a": {"tokens": [TOKEN_A]},
        "b": {"tokens": [TOKEN_B], "names": {OTHER_NS.hex(): "b-model"}},
    }}
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    return path


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


# Deadlines short enough for tests: a trickle is cut within a second or two.
FAST = dict(idle_timeout_s=1.0, request_timeout_s=5.0, grace_s=0.5, min_rate_bytes_per_s=64 << 10)


@pytest.fixture
def secure_daemon(tmp_path):
    """``secure_daemon(store_data_dir=None, **settings)`` -> a started :class:`ThreadDaemon`
    with the token file of :func:`token_file` (unless ``token``/``token_file`` is given) and
    the FAST deadlines, its data in ``store_data_dir`` (default ``tmp_path / "data"``)."""
    daemons: list[ThreadDaemon] = []

    def factory(store_data_dir: Path | None = None, **kwargs) -> ThreadDaemon:
        if "token" not in kwargs and "token_file" not in kwargs:
            kwargs["token_file"] = token_file(tmp_path / "tokens.json")
        for k, v in FAST.items():
            kwargs.setdefault(k, v)
        daemon = ThreadDaemon(serve_settings(store_data_dir or tmp_path / "data", **kwargs)).start()
        daemons.append(daemon)
        return daemon

    yield factory
    for daemon in daemons:
        daemon.stop()


# -- raw HTTP --------------------------------------------------------------------------------------
def request_bytes(method: str, path: str, body: bytes = b"", headers: dict | None = None,
                  host: str = "127.0.0.1") -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def read_response(sock: socket.socket, timeout_s: float = 10.0, no_body: bool = False) -> tuple[int, dict, bytes]:
    """One response (Content-Length or chunked; ``no_body``: the reply to a HEAD);
    ``(0, {}, b"")`` when the peer closed first."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    status = int(lines[0].split()[1])
    if no_body:
        return status, headers, b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return status, headers, _dechunk(sock, body)
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


def _dechunk(sock: socket.socket, data: bytes) -> bytes:
    out = b""
    while True:
        while b"\r\n" not in data:
            data += sock.recv(65536)
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        while len(data) < size + 2:
            chunk = sock.recv(65536)
            if not chunk:
                return out + data
            data += chunk
        out, data = out + data[:size], data[size + 2 :]
        if size == 0:
            return out


def raw(port: int, data: bytes, timeout_s: float = 10.0) -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        return read_response(sock, timeout_s, no_body=data.startswith(b"HEAD "))


def call(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None,
         host: str = "127.0.0.1") -> tuple[int, dict, bytes]:
    """A well-formed request; the body's media type by route unless ``headers`` names one."""
    headers = dict(headers or {})
    if body and "Content-Type" not in headers:
        headers["Content-Type"] = FRAMES if path.endswith("/put") else MSGPACK
    return raw(port, request_bytes(method, path, body, headers, host))


def register(port: int, token: str, namespace: bytes = NS, spec=SPEC) -> int:
    return call(port, "PUT", ns_url(namespace), pack(spec_to_wire(spec)), bearer(token))[0]


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closed ``sock`` (reading and dropping what it sends), or
    ``None`` if it was still open after ``seconds``."""
    start = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - start < seconds:
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - start
    return None


# -- a hostile daemon ------------------------------------------------------------------------------
class FakeDaemon(LoopbackServer):
    """A TCP server on ``host`` whose every connection runs ``handler(sock, request_bytes)``
    after reading the request head (and its Content-Length body). Records every byte received."""

    def __init__(self, handler: Callable[[socket.socket, bytes], None], host: str = "127.0.0.1") -> None:
        self.handler = handler
        self.received = bytearray()
        self.sent = 0
        super().__init__(host)

    def on_connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    while len(body) < length:
                        body += conn.recv(65536)
                    self.received += head + b"\r\n\r\n" + body
                    self.handler(conn, head)
            except OSError:
                return

