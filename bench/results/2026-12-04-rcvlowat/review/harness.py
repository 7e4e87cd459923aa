"""Shared pieces for the review51 reproducers: an in-process daemon (tests' ThreadDaemon) with
shipped receive thresholds, 1 MiB blocks, and instrumentation of BodyReceiver:
  - every receiver created (to read its daemon socket's SO_RCVLOWAT afterwards),
  - every SO_RCVLOWAT syscall checked against the connection the receiver was made for
    (fd reuse: the fd's peer must still be the receiver's peer).
Run from /work/main with /work/main/.venv/bin/python."""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "/work/main")
import msgpack  # noqa: E402
import torch  # noqa: E402

from kvtier.server import streams  # noqa: E402
from kvtier.server.streams import BodyReceiver  # noqa: E402
from kvtier.tiers.remote import RemoteTier  # noqa: E402
from kvtier.types import KVSpec  # noqa: E402
from tests.conftest import random_blocks  # noqa: E402
from tests.unit.server.conftest import NAMESPACE, ThreadDaemon, frames, hashes, put_head, serve_settings  # noqa: E402

BIG = KVSpec(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float16)  # 1 MiB blocks
RECEIVERS: list = []
LOWAT_CALLS: list = []  # (value, fd)
FD_MISMATCH: list = []

_init = BodyReceiver.__init__


def _init_spy(self, request, transport, remaining, clock=None):
    _init(self, request, transport, remaining, clock)
    try:
        self._peer = transport.get_extra_info("peername")
        self._ino = os.fstat(self._sock.fileno()).st_ino if self._sock is not None else None
    except Exception:
        self._peer = None
    RECEIVERS.append(self)


BodyReceiver.__init__ = _init_spy
_set = BodyReceiver._set_lowat


def _set_spy(self, nbytes):
    before = self._lowat
    sock = self._sock
    would = (sock is not None and not self._lost and not self.transport.is_closing()
             and max(1, min(nbytes, self._max_lowat)) != before)
    if would:
        fd = sock.fileno()
        try:  # the same socket (inode) as at the receiver's creation?
            ino = os.fstat(fd).st_ino
        except OSError as exc:
            ino = f"error {exc}"
        if ino != self._ino:
            FD_MISMATCH.append((fd, ino, self._ino, self._peer, nbytes))
        LOWAT_CALLS.append((max(1, min(nbytes, self._max_lowat)), fd))
    return _set(self, nbytes)


BodyReceiver._set_lowat = _set_spy
if os.environ.get("NOLOWAT"):  # A/B: the pre-14510a5 behaviour (no SO_RCVLOWAT)
    BodyReceiver._set_lowat = lambda self, nbytes: None
if os.environ.get("NOREADCAP"):  # A/B: the pre-67dcde5 read size
    streams.RECEIVE_READ_NBYTES = 1 << 40


def start_daemon(loop: str = "uvloop", **kw) -> ThreadDaemon:
    data = Path(tempfile.mkdtemp(prefix="r51-"))
    kw.setdefault("cpu_blocks", 64)
    kw.setdefault("disk_blocks", 0)
    kw.setdefault("max_block_bytes", BIG.block_nbytes)
    d = ThreadDaemon(serve_settings(data / "data", spec=BIG, event_loop=loop, **kw)).start()
    RemoteTier(d.url, timeout_s=10.0).register(NAMESPACE, BIG)
    return d


def body_of(n: int, salt: int, namespace: bytes = NAMESPACE):
    hs, blocks = hashes(n, salt=salt), random_blocks(BIG, n, seed=salt)
    return hs, blocks, frames(namespace, hs, blocks)


def healthz(close: bool = False) -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + (b"Connection: close\r\n" if close else b"") + b"\r\n"


def read_reply(sock: socket.socket, buf: bytearray) -> tuple[bytes, bytes]:
    """One response (Content-Length or chunked-free) from ``sock``; leftover stays in ``buf``."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"closed; got {bytes(buf[:200])!r}")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = next(int(l.split(b":", 1)[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed mid-body")
        rest += chunk
    buf[:] = rest[length:]
    return head, rest[:length]


def daemon_lowats(d: ThreadDaemon) -> list:
    """SO_RCVLOWAT of each receiver's socket whose transport is still open (read on the loop)."""
    def probe():
        out = []
        for r in RECEIVERS:
            if r.transport.is_closing() or r._sock is None:
                continue
            try:
                out.append(r._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
            except OSError:
                pass
        return out
    return d.call(probe)


def verify(d: ThreadDaemon, hs, blocks) -> bool:
    c = RemoteTier(d.url, timeout_s=10.0)
    c.register(NAMESPACE, BIG)
    outs = [torch.empty_like(b) for b in blocks]
    ok = all(s.value == "ok" for s in c.get_into(NAMESPACE, hs, outs)) and all(
        torch.equal(o.view(torch.uint8), b.view(torch.uint8)) for o, b in zip(outs, blocks))
    c.close()
    return ok


def stored(body: bytes):
    return msgpack.unpackb(body)["stored"]
