"""Daemons for the server tests: in-process apps (aiohttp's test client), a daemon on a
background thread (for RemoteTier: stop and start it on the same port), a real
``kvtier serve`` subprocess (restarts, kill -9), and a TCP proxy that corrupts bytes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvtier.config import StoreConfig
from kvtier.records import HEADER_NBYTES, encode_header, parse_header
from kvtier.server.app import make_app
from kvtier.server.loop import loop_factory
from kvtier.server.serve import start
from kvtier.server.settings import ServeConfig
from kvtier.wire import END, FRAMES, MSGPACK, block_bytes, frame_prefix, pack, spec_to_wire
from kvtier.tiers.disk import record_footprint
from tests.conftest import tiny_spec

REPO = Path(__file__).resolve().parents[3]
NAMESPACE = bytes(range(32))
SPEC = tiny_spec()  # [2, 2, 4, 1, 8] float32: 512 bytes a block


def serve_settings(data_dir: Path, cpu_blocks: int = 64, disk_blocks: int = 256, spec=SPEC, **kwargs) -> ServeConfig:
    store = StoreConfig(gpu_bytes=0, cpu_bytes=cpu_blocks * spec.block_nbytes,
                        disk_bytes=disk_blocks * record_footprint(spec.block_nbytes), data_dir=data_dir,
                        num_io_threads=1)
    kwargs.setdefault("num_threads", 2)
    kwargs.setdefault("port", 0)
    return ServeConfig(store=store, **kwargs)


def ns_dir(data_dir: Path, namespace: bytes = NAMESPACE, tenant: str = "default") -> Path:
    """Where the daemon keeps a namespace of a tenant (kvtier.server.layout)."""
    return data_dir / "tenants" / tenant / namespace.hex()


def ns_url(namespace: bytes = NAMESPACE, op: str = "") -> str:
    return f"/v1/namespaces/{namespace.hex()}" + (f"/{op}" if op else "")


def put_head(body_nbytes: int, namespace: bytes = NAMESPACE) -> bytes:
    """The request line and headers of a put of ``body_nbytes`` body bytes, for a client
    writing to a raw socket."""
    return (f"POST {ns_url(namespace, 'put')} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {FRAMES}\r\n"
            f"Content-Length: {body_nbytes}\r\n\r\n").encode()


def hashes(n: int, salt: int = 0, size: int = 32) -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest()[:size] for i in range(n)]


def frames(namespace: bytes, block_hashes, blocks, end: bool = True) -> bytes:
    body = b"".join(frame_prefix(h) + encode_header(namespace, b) + bytes(block_bytes(b))
                    for h, b in zip(block_hashes, blocks))
    return body + (END if end else b"")


def parse_frames(body: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """``(hash, header, payload)`` per frame; asserts the end byte closes the body."""
    out, offset = [], 0
    while body[offset] != 0:
        n = body[offset]
        h = body[offset + 1 : offset + 1 + n]
        offset += 1 + n
        header = body[offset : offset + HEADER_NBYTES]
        record = parse_header(header)
        assert record is not None
        offset += HEADER_NBYTES
        out.append((h, header, body[offset : offset + record.payload_nbytes]))
        offset += record.payload_nbytes
    assert offset == len(body) - 1, "bytes after the end byte"
    return out


class ApiClient(TestClient):
    """A test client that sends a body with the media type its route takes (``/put``:
    frames, anything else: msgpack), as kvtier's own client does; an explicit
    ``Content-Type`` header wins."""

    async def _request(self, method: str, path, **kwargs):
        if kwargs.get("data") is not None:
            headers = dict(kwargs.get("headers") or {})
            if not any(k.lower() == "content-type" for k in headers):
                headers["Content-Type"] = FRAMES if str(path).rstrip("/").endswith("/put") else MSGPACK
            kwargs["headers"] = headers
        return await super()._request(method, path, **kwargs)


@pytest.fixture
async def make_api(tmp_path):
    """``await make_api(settings=None, **settings_kwargs)`` -> aiohttp TestClient of a fresh
    app (closed at teardown, or earlier with ``await client.close()``)."""
    clients: list[TestClient] = []

    async def factory(settings: ServeConfig | None = None, **kwargs) -> TestClient:
        settings = settings or serve_settings(tmp_path / "data", **kwargs)
        client = ApiClient(TestServer(make_app(settings)))
        await client.start_server()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()


async def register(client: TestClient, namespace: bytes = NAMESPACE, spec=SPEC) -> None:
    response = await client.put(ns_url(namespace), data=pack(spec_to_wire(spec)))
    assert response.status in (200, 201), await response.text()


class ThreadDaemon:
    """The daemon's app on a background event loop, on a fixed port once started: stop()
    and start() it again to play a daemon restart to a client in this process."""

    def __init__(self, settings: ServeConfig) -> None:
        self.settings = settings
        self.port = 0
        self.app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.running = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.settings.unix_socket}"

    def start(self) -> "ThreadDaemon":
        self._loop = loop_factory(self.settings.event_loop)[0]()  # uvloop when installed, as kvtier serve
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    async def _start(self) -> None:
        port = self.port if self.settings.port is not None else None
        self.running = await start(replace(self.settings, port=port))
        self.app = self.running.app
        self.port = int(self.running.urls[0].rsplit(":", 1)[1]) if self.settings.port is not None else 0

    def call(self, fn):
        """``fn()`` on the daemon's loop thread (to look at its stores)."""
        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.running.stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None


@pytest.fixture
def thread_daemon(tmp_path):
    daemons: list[ThreadDaemon] = []

    def factory(**kwargs) -> ThreadDaemon:
        daemon = ThreadDaemon(serve_settings(tmp_path / "data", **kwargs)).start()
        daemons.append(daemon)
        return daemon

    yield factory
    for daemon in daemons:
        daemon.stop()


class Subprocess:
    """``python -m kvtier serve`` on a free port; ``url`` once it listens."""

    def __init__(self, data_dir: Path, *args: str, env: dict | None = None) -> None:
        self.data_dir, self.args = data_dir, args
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.announce = ""
        """The start-up line (kvtier.server.serve)."""
        self.log = data_dir.parent / "daemon.log"

    def start(self, timeout_s: float = 60.0) -> "Subprocess":
        command = [sys.executable, "-m", "kvtier", "serve", "--port", "0", "--data-dir", str(self.data_dir), *self.args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, env=self.env, cwd=REPO)
        deadline = time.monotonic() + timeout_s
        line = b""
        while time.monotonic() < deadline and b"\n" not in line:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
        text = line.decode()
        if "listening on " not in text:
            self.kill()
            raise RuntimeError(f"daemon did not start: {text!r}; log: {self.log.read_text()[-2000:]}")
        self.url = text.split("listening on ", 1)[1].split()[0]
        self.announce = text
        return self

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(30)
        finally:
            self.proc.stdout.close()
            self.proc = None


@pytest.fixture
def spawn(tmp_path):
    """``spawn(*args, data_dir=None)`` -> a started :class:`Subprocess` (SIGKILLed at teardown)."""
    daemons: list[Subprocess] = []

    def factory(*args: str, data_dir: Path | None = None, env: dict | None = None) -> Subprocess:
        daemon = Subprocess(data_dir or tmp_path / "data", *args, env=env).start()
        daemons.append(daemon)
        return daemon

    yield factory
    for daemon in daemons:
        daemon.kill()


class LoopbackServer:
    """A TCP server on ``host`` (port 0) whose accept loop runs ``on_connection(sock)`` on a
    thread per connection until :meth:`close` (the test doubles below build on it)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((host, 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def on_connection(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self.on_connection, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._server.close()


class CorruptingProxy(LoopbackServer):
    """A TCP proxy to ``port`` that flips one bit in the middle of every occurrence of
    ``pattern`` in the direction(s) asked (``to_client``: responses, ``to_server``: requests)."""

    def __init__(self, port: int, pattern: bytes, to_client: bool = True, to_server: bool = False) -> None:
        self.target, self.pattern = port, pattern
        self.directions = (to_client, to_server)
        self.flips = 0
        super().__init__()

    def on_connection(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(upstream, client, self.directions[0]), daemon=True).start()
        self._pump(client, upstream, self.directions[1])

    def _pump(self, src: socket.socket, dst: socket.socket, corrupt: bool) -> None:
        tail = b""  # the last len(pattern) - 1 bytes forwarded: a pattern may straddle reads
        size = len(self.pattern)
        try:
            while data := src.recv(1 << 16):
                if corrupt:
                    combined = bytearray(tail + data)
                    start = 0
                    while (i := combined.find(self.pattern, start)) >= 0:
                        if i + size > len(tail):  # its last byte is in this read: flip that one
                            combined[i + size - 1] ^= 0x01
                            self.flips += 1
                        start = i + 1
                    data = bytes(combined[len(tail) :])
                    tail = bytes(combined[-(size - 1) :])
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
