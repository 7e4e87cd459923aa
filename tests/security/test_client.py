"""Attack kind 4 (issue 12), the client side: a daemon that trickled a small reply blocked
``lookup`` far past ``remote_timeout_s`` (only streamed gets had an overall deadline), and a
huge reply to a small call was read whole into memory. Now every RemoteTier call has one
deadline and every reply a size cap (kvtier.tiers.transport): a slow or hostile daemon
costs misses, never a hang."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from kvtier.records import ReadStatus
from kvtier.tiers.remote import RemoteTier
from kvtier.wire import pack
from tests.conftest import random_blocks
from tests.security.conftest import NS, FakeDaemon
from tests.unit.server.conftest import SPEC, hashes

TIMEOUT_S = 1.0


def _trickle(sock: socket.socket, data: bytes, every_s: float = 0.2) -> None:
    for i in range(len(data)):
        sock.sendall(data[i : i + 1])
        time.sleep(every_s)


def _headers_trickled(sock: socket.socket, head: bytes) -> None:
    _trickle(sock, b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: 40\r\n\r\n" + b"x" * 40)


def _body_trickled(sock: socket.socket, head: bytes) -> None:
    body = pack({"num_blocks": 0, "media": [], "stored": [], "max_batch_blocks": 16})
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: %d\r\n\r\n" % len(body))
    _trickle(sock, body)


@pytest.mark.slow  # 3 calls x 1 s of trickle each
@pytest.mark.parametrize("handler", [_headers_trickled, _body_trickled], ids=["headers", "body"])
def test_every_call_to_a_daemon_that_trickles_returns_within_its_timeout(handler):
    fake = FakeDaemon(handler)
    remote = RemoteTier(fake.url, timeout_s=TIMEOUT_S, retries=0)
    try:
        hs, blocks = hashes(2), list(random_blocks(SPEC, 2))
        for name, fn in (("register", lambda: remote.register(NS, SPEC)), ("lookup", lambda: remote.lookup(NS, hs)),
                         ("put", lambda: remote.put(NS, hs, blocks))):
            remote.backoff.succeeded()  # no pause between the calls: each one meets the daemon
            start = time.monotonic()
            result = fn()
            elapsed = time.monotonic() - start
            assert elapsed < TIMEOUT_S + 0.75, (name, elapsed)
            assert result in (None, 0, [False, False]), (name, result)
        assert remote.errors["timeout"] + remote.errors["protocol"] >= 3
    finally:
        remote.close()
        fake.close()


def _huge(sock: socket.socket, head: bytes, chunked: bool = False, status: int = 200) -> None:
    """A reply of ~1 GiB to any call, sent as fast as the client reads it."""
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % (1 << 30)
    sock.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/msgpack\r\n%s\r\n\r\n" % (status, framing))
    piece = b"\x00" * (1 << 20)
    sent = 0
    try:
        while sent < 1 << 30:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            sent += len(piece)
            _SENT[0] += len(piece)
    except OSError:
        return


_SENT = [0]


@pytest.mark.parametrize("chunked,status", [(False, 200), (True, 200), (True, 400)],
                         ids=["content-length", "chunked", "error-body"])
def test_a_huge_reply_to_a_small_call_is_refused_not_read_whole(chunked, status):
    _SENT[0] = 0
    fake = FakeDaemon(lambda sock, head: _huge(sock, head, chunked, status))
    remote = RemoteTier(fake.url, timeout_s=5.0, retries=0)
    try:
        start = time.monotonic()
        assert remote.lookup(NS, hashes(4)) == 0
        assert time.monotonic() - start < 2.0
        time.sleep(0.2)
        assert _SENT[0] < 64 << 20, _SENT[0]  # the client stopped reading (socket buffers aside)
        assert remote.errors["protocol"] + remote.errors["rejected"] == 1
    finally:
        remote.close()
        fake.close()


def test_a_get_from_a_daemon_that_trickles_frames_is_a_timeout_not_a_hang():
    def frames_trickled(sock: socket.socket, head: bytes) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-kvtier-frames\r\nContent-Length: 100000\r\n\r\n")
        _trickle(sock, b"\x20" + b"\x00" * 1000, every_s=0.1)

    fake = FakeDaemon(frames_trickled)
    remote = RemoteTier(fake.url, timeout_s=TIMEOUT_S, retries=0)
    try:
        outs = [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in range(2)]
        start = time.monotonic()
        statuses = remote.get_into(NS, hashes(2), outs)
        assert time.monotonic() - start < TIMEOUT_S + 0.75
        assert ReadStatus.OK not in statuses
    finally:
        remote.close()
        fake.close()
