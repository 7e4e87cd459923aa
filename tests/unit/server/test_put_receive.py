"""A put body received straight from the socket into its destinations
(kvtier.server.streams.BodyReceiver, issue 17): bit-exact blocks on both event loops however
the body is cut into reads, the connection handed back to aiohttp for the client's next
request (a fresh parser: the old one still waits for the body it never saw; closed after the
reply where none can be made), nothing read past the body, an error answered before the
body's end reaching the client, and the receiver's own rules (fills, the stash, a cancelled
fill, EOF, loss) on a fake transport."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import msgpack
import pytest
import xxhash
from aiohttp import web_protocol

from kvtier.server import streams
from kvtier.server.app import REGISTRY
from kvtier.server.connections import BodyClock
from kvtier.server.streams import _PREFIX_NBYTES, CLOSE_AFTER, BodyReceiver
from kvtier.tiers.remote import RemoteTier
from kvtier.types import KVSpec
from kvtier.wire import frame_nbytes, pack, spec_to_wire
from tests.conftest import random_blocks, receive_puts
from tests.unit.server.conftest import NAMESPACE, SPEC, frames, hashes, ns_url, put_head
from tests.unit.server import test_api
from tests.unit.server.test_api import BAD_INPUTS

import torch

FRAME_NBYTES = frame_nbytes(bytes(32), SPEC.block_nbytes)
BIG = KVSpec(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float16)  # 1 MiB blocks
assert BIG.block_nbytes >= streams.RECEIVE_MIN_BLOCK_NBYTES
PUT_BLOCKS = max(streams.RECEIVE_MIN_NBYTES // BIG.block_nbytes + 1, 4)  # a put body the shipped thresholds receive
LOOPS = [pytest.param("asyncio", marks=pytest.mark.slow), "uvloop"]  # the fast lane: the loop kvtier serves on


@pytest.fixture
def receive_all(monkeypatch):
    receive_puts(monkeypatch, every=True)


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def _raw_put(port: int, body: bytes, parts: list[int], pause_s: float = 0.02, after: bytes = HEALTHZ) -> bytes:
    """POST ``body`` over one socket, cut after each offset of ``parts`` with a pause (so the
    daemon waits inside a fill), then ``after`` (by default a pipelined ``GET /healthz`` that
    closes the connection: the daemon must answer it on the same connection); every reply,
    read until the daemon closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(put_head(len(body)))
        start = 0
        for end in [*parts, len(body)]:
            time.sleep(pause_s)
            sock.sendall(body[start:end])
            start = end
        if after:
            sock.sendall(after)
        reply = b""
        while chunk := sock.recv(1 << 16):
            reply += chunk
    return reply


def _replies(data: bytes) -> list[tuple[bytes, bytes]]:
    """``(head, body)`` of each HTTP response in ``data`` (bodies with a Content-Length)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep and head.startswith(b"HTTP/1."), data[:300]
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        out.append((head, rest[:length]))
        data = rest[length:]
    return out


def _stored(reply: bytes) -> list[bool]:
    """The put's ``stored`` list; the connection carried the pipelined ``GET /healthz`` after
    it (keep-alive: the put's reply does not close it)."""
    (head, body), (health_head, _) = _replies(reply)
    assert head.startswith(b"HTTP/1.1 200"), reply[:300]
    assert b"connection: close" not in head.lower(), head
    assert health_head.startswith(b"HTTP/1.1 200"), health_head
    return msgpack.unpackb(body)["stored"]


# -- through a daemon ------------------------------------------------------------------------------
@pytest.mark.parametrize("event_loop", LOOPS)
def test_a_body_cut_anywhere_lands_bit_exact_and_the_connection_carries_the_next_request(thread_daemon, event_loop, receive_all):
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    daemon = thread_daemon(disk_blocks=0, event_loop=event_loop)
    client = RemoteTier(daemon.url, timeout_s=10.0)
    client.register(NAMESPACE, SPEC)
    hs, blocks = hashes(4), random_blocks(SPEC, 4, seed=31)
    body = frames(NAMESPACE, hs, blocks)
    # cuts inside the first hash byte, a header, a payload, across two frames, before the end byte
    parts = [1, 20, 1 + 32 + 50, FRAME_NBYTES + 300, 3 * FRAME_NBYTES - 7, len(body) - 1]
    assert _stored(_raw_put(daemon.port, body, parts)) == [True] * 4
    outs = [torch.empty_like(b) for b in blocks]
    assert all(s.value == "ok" for s in client.get_into(NAMESPACE, hs, outs))
    assert all(torch.equal(o.view(torch.uint8), b.view(torch.uint8)) for o, b in zip(outs, blocks))
    client.close()


@pytest.mark.slow  # 4 MiB puts: the fast lane covers the receiver with small bodies (receive_all)
@pytest.mark.parametrize("event_loop", LOOPS)
@pytest.mark.parametrize("keep_alive", [True, False], ids=["fresh-parser", "no-fresh-parser"])
def test_real_sized_puts_take_the_receiver_on_one_connection(thread_daemon, event_loop, keep_alive, monkeypatch):
    """Bodies over the shipped thresholds (4 blocks of 1 MiB): every put is received from the
    socket and RemoteTier's puts and gets all go over its one pooled connection; where aiohttp
    gives no fresh parser, each put's reply closes the connection and the next call opens
    another (still correct)."""
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    taken = []
    take = BodyReceiver.take.__func__
    monkeypatch.setattr(BodyReceiver, "take", classmethod(lambda cls, *a: taken.append(take(cls, *a)) or taken[-1]))
    if not keep_alive:
        monkeypatch.setattr(streams, "fresh_parser", lambda protocol: None)
    accepted = []  # the daemon's connections (it runs in this process)
    made = web_protocol.RequestHandler.connection_made
    monkeypatch.setattr(web_protocol.RequestHandler, "connection_made",
                        lambda self, transport: accepted.append(transport) or made(self, transport))
    daemon = thread_daemon(disk_blocks=0, cpu_blocks=64, spec=BIG, event_loop=event_loop,
                           max_block_bytes=BIG.block_nbytes)
    client = RemoteTier(daemon.url, timeout_s=10.0)
    client.register(NAMESPACE, BIG)
    for round_ in range(3):
        hs, blocks = hashes(PUT_BLOCKS, salt=round_), random_blocks(BIG, PUT_BLOCKS, seed=round_)
        assert client.put(NAMESPACE, hs, blocks) == [True] * PUT_BLOCKS, dict(client.errors)
        outs = [torch.empty_like(b) for b in blocks]
        assert all(s.value == "ok" for s in client.get_into(NAMESPACE, hs, outs))
        assert all(torch.equal(o.view(torch.uint8), b.view(torch.uint8)) for o, b in zip(outs, blocks))
    assert len(taken) == 3 and all(r is not None for r in taken)
    assert not client.errors
    assert len(accepted) == (1 if keep_alive else 4), accepted  # (3 puts closed theirs)
    if keep_alive:  # uvloop's transport keeps the receiver's bound methods: it holds no request
        assert all(r.request is None and r.leftover is None for r in taken)
    client.close()


def test_a_small_put_keeps_aiohttps_reads_and_the_connection(thread_daemon):
    daemon = thread_daemon(disk_blocks=0)
    hs, blocks = hashes(2), random_blocks(SPEC, 2, seed=32)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        spec_body = pack(spec_to_wire(SPEC))
        sock.sendall((f"PUT {ns_url(NAMESPACE)} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/msgpack\r\n"
                      f"Content-Length: {len(spec_body)}\r\n\r\n").encode() + spec_body)
        body = frames(NAMESPACE, hs, blocks)
        sock.sendall(put_head(len(body)) + body)
        reply = b""
        while reply.count(b"HTTP/1.1 ") < 2 or not reply.endswith(b"\xc3\xc3"):  # {"stored": [True, True]}
            chunk = sock.recv(1 << 16)
            assert chunk, reply
            reply += chunk
    assert b"connection: close" not in reply.lower()


@pytest.mark.parametrize("event_loop", LOOPS)
def test_bytes_after_the_body_are_never_read_into_a_block(thread_daemon, event_loop, receive_all):
    """A request pipelined right after the body, then garbage: the put stores its 3 blocks,
    what follows is aiohttp's again (on the same connection: the garbage gets its 400 and
    the connection closes); nothing after the body reached a block."""
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    daemon = thread_daemon(disk_blocks=0, event_loop=event_loop)
    RemoteTier(daemon.url, timeout_s=10.0).register(NAMESPACE, SPEC)
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=33)
    body = frames(NAMESPACE, hs, blocks)
    # (a text line and a blank one: aiohttp's pure-Python parser answers nothing less, on any connection)
    pipelined = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + b"x" * FRAME_NBYTES + b"\r\n\r\n"
    try:
        reply = _raw_put(daemon.port, body, [FRAME_NBYTES + 10], after=pipelined)
    except ConnectionResetError:
        pass  # bytes still unread when aiohttp closed after its 400: the kernel's reset may beat the replies
    else:
        statuses = [head.split(b" ", 2)[1] for head, _ in _replies(reply)]
        # aiohttp answers the GET, or (both in one read) only its parser's 400 for the two
        assert statuses in ([b"200", b"200", b"400"], [b"200", b"400"]), reply[:600]
        assert msgpack.unpackb(_replies(reply)[0][1])["stored"] == [True] * 3
    store = daemon.app[REGISTRY].get("default", NAMESPACE).store
    assert daemon.call(lambda: sum(t["blocks"] for t in store.usage().values())) == 3
    client = RemoteTier(daemon.url, timeout_s=10.0)
    client.register(NAMESPACE, SPEC)
    outs = [torch.empty_like(b) for b in blocks]
    assert all(s.value == "ok" for s in client.get_into(NAMESPACE, hs, outs))
    assert all(torch.equal(o.view(torch.uint8), b.view(torch.uint8)) for o, b in zip(outs, blocks))
    client.close()


@pytest.mark.parametrize("event_loop", LOOPS)
def test_an_error_before_the_body_ends_reaches_the_client_and_frees_every_slot(thread_daemon, event_loop):
    """A real-sized body (shipped threshold) whose second frame names another namespace: the
    daemon reads the rest of the body, then the client gets the 400 and its message; the
    first frame is stored, nothing stays reserved, the daemon keeps serving."""
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    daemon = thread_daemon(disk_blocks=0, cpu_blocks=64, spec=BIG, event_loop=event_loop,
                           max_block_bytes=BIG.block_nbytes)
    client = RemoteTier(daemon.url, timeout_s=10.0)
    client.register(NAMESPACE, BIG)
    hs, blocks = hashes(PUT_BLOCKS, salt=5), random_blocks(BIG, PUT_BLOCKS, seed=34)
    body = frames(NAMESPACE, hs[:1], blocks[:1], end=False) + frames(b"\x02" * 32, hs[1:], blocks[1:])
    reply = _raw_put(daemon.port, body, [len(body) // 3, 2 * len(body) // 3])
    (head, message), (health_head, _) = _replies(reply)  # the body was read to its end: the
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]  # connection carries the next request
    assert health_head.startswith(b"HTTP/1.1 200"), health_head
    assert b"namespace" in message
    store = daemon.app[REGISTRY].get("default", NAMESPACE).store
    assert daemon.call(lambda: len(store.residency.pending())) == 0
    assert client.lookup(NAMESPACE, hs) == 1
    assert client.put(NAMESPACE, hs[1:], blocks[1:]) == [True] * (PUT_BLOCKS - 1)  # the daemon keeps serving
    daemon.call(store.check_invariants)
    client.close()


@pytest.mark.parametrize("event_loop", LOOPS)
def test_a_client_that_stops_sending_is_cut_after_grace_not_after_its_block(thread_daemon, event_loop):
    """A fill of a whole 1 MiB payload counts its bytes as they land: a client that sends a
    frame's header and goes silent is reset ``grace_s`` after (0.5 s), as on aiohttp's path,
    not ``grace_s + block / min_rate`` (4.5 s here: the hostile-client review's finding)."""
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    daemon = thread_daemon(disk_blocks=0, cpu_blocks=2 * PUT_BLOCKS, spec=BIG, event_loop=event_loop,
                           max_block_bytes=BIG.block_nbytes, grace_s=0.5, min_rate_bytes_per_s=256 << 10)
    client = RemoteTier(daemon.url, timeout_s=10.0)
    client.register(NAMESPACE, BIG)
    hs, blocks = hashes(PUT_BLOCKS, salt=7), random_blocks(BIG, PUT_BLOCKS, seed=7)
    body = frames(NAMESPACE, hs, blocks)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(put_head(len(body)) + body[: _PREFIX_NBYTES + 10])
        start = time.monotonic()
        with pytest.raises(ConnectionResetError):
            while sock.recv(1 << 16):
                pass
        took = time.monotonic() - start
    assert took < 2.5, took
    store = daemon.app[REGISTRY].get("default", NAMESPACE).store
    assert daemon.call(lambda: len(store.residency.pending())) == 0
    assert client.put(NAMESPACE, hs, blocks) == [True] * PUT_BLOCKS
    client.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_RCVLOWAT's wake-up rule is Linux's (socket(7))")
def test_a_fill_sleeps_until_its_share_is_queued_and_the_body_end_never_waits(thread_daemon, monkeypatch):
    """On a real socket (uvloop): 100 KB of a 1 MiB payload stay in the kernel while the fill
    waits for more (``SO_RCVLOWAT``); the last payload's final 300 KB, sent alone after a
    pause, are read as they come, with 60 s of grace: a wake-up waiting for more bytes than
    the fill lacks would show as a put that never ends."""
    pytest.importorskip("uvloop")
    taken = []
    take = BodyReceiver.take.__func__
    monkeypatch.setattr(BodyReceiver, "take", classmethod(lambda cls, *a: taken.append(take(cls, *a)) or taken[-1]))
    daemon = thread_daemon(disk_blocks=0, cpu_blocks=2 * PUT_BLOCKS, spec=BIG, event_loop="uvloop",
                           max_block_bytes=BIG.block_nbytes, grace_s=60.0)
    RemoteTier(daemon.url, timeout_s=10.0).register(NAMESPACE, BIG)
    hs, blocks = hashes(PUT_BLOCKS, salt=9), random_blocks(BIG, PUT_BLOCKS, seed=9)
    body = frames(NAMESPACE, hs, blocks)
    assert streams.RECEIVE_LOWAT_NBYTES > 100_000
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(put_head(len(body)) + body[:_PREFIX_NBYTES])
        time.sleep(0.3)  # the handler took the body: a fill of the first payload waits
        sock.sendall(body[_PREFIX_NBYTES : _PREFIX_NBYTES + 100_000])
        time.sleep(0.3)
        assert len(taken) == 1 and taken[0] is not None
        assert daemon.call(taken[0].landed) == 0  # all 100 KB still in the socket
        start = time.monotonic()
        tail = len(body) - 300_000  # the last payload's end comes alone, under the cap
        sock.sendall(body[_PREFIX_NBYTES + 100_000 : tail])
        time.sleep(0.3)
        sock.sendall(body[tail:] + HEALTHZ)
        reply = b""
        while chunk := sock.recv(1 << 16):
            reply += chunk
        took = time.monotonic() - start
    assert _stored(reply) == [True] * PUT_BLOCKS
    assert took < 5.0, took  # 0.3 s of it the client's pause


@pytest.mark.slow  # waits out shutdown_timeout_s (2 s)
@pytest.mark.parametrize("event_loop", LOOPS)
def test_shutdown_does_not_wait_twice_for_a_stalled_receiver(thread_daemon, event_loop, receive_all):
    """aiohttp's shutdown gives handlers ``shutdown_timeout_s`` (2 s), then cancels their body
    reads: a put stalled inside a fill ends then, not a second timeout later."""
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    daemon = thread_daemon(disk_blocks=0, event_loop=event_loop, grace_s=60.0)
    RemoteTier(daemon.url, timeout_s=10.0).register(NAMESPACE, SPEC)
    body = frames(NAMESPACE, hashes(3), random_blocks(SPEC, 3, seed=35))
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(put_head(len(body)) + body[: FRAME_NBYTES + 300])
        time.sleep(0.3)
        start = time.monotonic()
        daemon.stop()
        took = time.monotonic() - start
    assert took < 3.5, took  # 2 s of grace, then the cancel; 4 s before the fix


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c[2].endswith("/put")], ids=lambda c: c[0])
async def test_bad_put_bodies_from_the_socket_are_4xx_with_a_message(make_api, case, receive_all):
    """test_api's bad-input test, each put case read by the receiver (thresholds at 0)."""
    await test_api.test_bad_input_is_4xx_with_a_message_and_the_daemon_keeps_serving(make_api, case)


# -- the receiver on a fake transport -------------------------------------------------------------
class _Socket:
    """What the receiver asks of the transport's socket: ``SO_RCVLOWAT`` (each value set)."""

    def __init__(self, family: int = socket.AF_INET) -> None:
        self.family = family
        self.lowats: list[int] = []

    def setsockopt(self, level: int, option: int, value) -> None:
        if (level, option) == (socket.SOL_SOCKET, socket.SO_LINGER):
            return  # kvtier.server.connections.reset
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        self.lowats.append(value)


class _Transport(asyncio.Transport):
    def __init__(self, protocol) -> None:
        super().__init__()
        self.protocol, self.reading, self.aborted = protocol, True, False
        self.calls: list[str] = []
        self.sock = _Socket()

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol

    def get_protocol(self):
        return self.protocol

    def pause_reading(self) -> None:
        self.reading = False
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.reading = True
        self.calls.append("resume")

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, name, default=None):
        return self.sock if name == "socket" else default

    def abort(self) -> None:
        self.aborted = True

    def deliver(self, data: bytes) -> int:
        """What the event loop does for one read: ``get_buffer``, the kernel's copy,
        ``buffer_updated``. Returns the bytes delivered (at most the buffer's size)."""
        buf = self.protocol.get_buffer(-1)
        n = min(len(buf), len(data))
        assert n > 0
        buf[:n] = data[:n]
        self.protocol.buffer_updated(n)
        return n


class _Inner:
    def __init__(self) -> None:
        self.events: list[str] = []

    def connection_lost(self, exc) -> None:
        self.events.append("lost")

    def close(self) -> None:
        self.events.append("close")

    def eof_received(self):
        self.events.append("eof")

    def pause_writing(self) -> None:
        self.events.append("pause_writing")

    def resume_writing(self) -> None:
        self.events.append("resume_writing")


class _Content:
    def __init__(self, buffered: bytes) -> None:
        self.buffered, self.total_bytes, self.eof = buffered, len(buffered), False
        self.watchers: list[asyncio.Future] = []

    async def wait_eof(self) -> None:
        if not self.eof:
            self.watchers.append(asyncio.get_running_loop().create_future())
            await self.watchers[-1]

    def set_exception(self, exc: BaseException) -> None:  # what aiohttp's request._cancel does
        for watcher in self.watchers:
            if not watcher.done():
                watcher.set_exception(exc)

    def read_nowait(self, n: int = -1) -> bytes:
        data, self.buffered = self.buffered, b""
        return data

    def at_eof(self) -> bool:
        return self.eof

    def exception(self):
        return None

    def feed_eof(self) -> None:
        self.eof = True
        for watcher in self.watchers:
            if not watcher.done():
                watcher.set_result(None)


class _Request(dict):
    def __init__(self, body: bytes, buffered: int) -> None:
        super().__init__()
        self.protocol = _Inner()
        self.transport = _Transport(self.protocol)
        self.content = _Content(body[:buffered])
        self.content_length = len(body)
        self.headers: dict[str, str] = {}


def _receiver(body: bytes, buffered: int = 0, clock: BodyClock | None = None,
              sock: _Socket | None = None) -> tuple[BodyReceiver, _Request]:
    request = _Request(body, buffered)
    if sock is not None:
        request.transport.sock = sock
    receiver = BodyReceiver.take(request, 1 << 20, clock)
    assert receiver is not None
    return receiver, request


async def test_fills_take_exactly_their_bytes_and_hash_them_as_they_land(receive_all):
    body = bytes(range(256)) * 40
    receiver, request = _receiver(body, buffered=100)
    assert receiver.leftover == body[:100] and receiver.remaining == len(body) - 100
    assert request.transport.protocol is receiver and not request.transport.reading  # paused: nothing asked
    first, digest = bytearray(3000), xxhash.xxh3_64()
    fill = receiver.fill(memoryview(first), digest)
    assert request.transport.reading
    offset = 100
    for n in (1, 999, 5000):  # the last read offers more than the fill takes
        offset += request.transport.deliver(body[offset : offset + n])
    assert offset == 3100 and fill.done()
    assert request.transport.reading  # on, for the next frame's prefix
    assert bytes(first) == body[100:3100] and digest.intdigest() == xxhash.xxh3_64_intdigest(body[100:3100])
    rest = bytearray(len(body) - 3100)
    with pytest.raises(ValueError, match="past the body"):
        receiver.fill(memoryview(bytearray(len(rest) + 1)))
    fill = receiver.fill(memoryview(rest))
    request.transport.deliver(body[3100:])
    await fill
    assert bytes(rest) == body[3100:] and receiver.available == 0 and not request.transport.reading
    receiver.close(consumed=True)
    assert request[CLOSE_AFTER] and request.content.eof and not request.transport.aborted
    assert request.transport.reading  # what comes after the body is read and dropped
    request.transport.deliver(b"GET / HTTP/1.1\r\n\r\n")
    assert bytes(rest) == body[3100:] and receiver.available == 0
    receiver.connection_lost(None)  # aiohttp closed the transport after its reply
    assert request.protocol.events == ["close", "lost"]  # close: aiohttp's, once it replied


async def test_bytes_that_come_with_no_fill_waiting_are_kept_for_the_next_one(receive_all):
    body = bytes(range(200)) * 10
    receiver, request = _receiver(body)
    first = bytearray(100)
    fill = receiver.fill(memoryview(first))
    request.transport.deliver(body[:100])
    await fill
    assert request.transport.reading  # on after a fill: the next frame's prefix comes with it
    assert request.transport.deliver(body[100:600]) == _PREFIX_NBYTES  # one frame prefix ahead, no more
    assert not request.transport.reading and receiver.available == len(body) - 100
    head = bytearray(50)
    done = receiver.fill(memoryview(head))  # served from the stash: no wait, no read
    assert done.done() and bytes(head) == body[100:150] and not request.transport.reading
    out, digest = bytearray(700), xxhash.xxh3_64()
    fill = receiver.fill(memoryview(out), digest)
    assert request.transport.reading
    request.transport.deliver(body[100 + _PREFIX_NBYTES : 850])
    await fill
    assert bytes(out) == body[150:850] and digest.intdigest() == xxhash.xxh3_64_intdigest(body[150:850])


async def test_the_socket_wakes_for_a_cap_of_bytes_and_never_waits_past_the_body(receive_all):
    """``SO_RCVLOWAT`` once a fill waits on the socket: the cap, kept across fills and frames
    (one system call per body, not per frame), lowered as the body's last bytes come (a socket
    waiting for more bytes than the body has left would hang the put), 1 once the body is done
    with, or its fill cancelled (aiohttp reads the connection's next request). Each read lands
    at most ``RECEIVE_READ_NBYTES`` (hashed while in cache)."""
    cap, most = streams.RECEIVE_LOWAT_NBYTES, streams.RECEIVE_READ_NBYTES
    assert cap > most  # a wake-up for a cap of bytes takes several reads
    body = bytes(range(256)) * ((3 * cap) // 256)
    receiver, request = _receiver(body)
    lowats, transport = request.transport.sock.lowats, request.transport
    out, digest = bytearray(cap + cap // 2), xxhash.xxh3_64()
    fill = receiver.fill(memoryview(out), digest)
    assert lowats == [cap]
    offset = 0
    while offset < len(out):
        n = transport.deliver(body[offset : len(out)])
        assert n == min(most, len(out) - offset)  # the kernel is offered no more than that
        offset += n
    await fill
    assert bytes(out) == body[: len(out)] and digest.intdigest() == xxhash.xxh3_64_intdigest(body[: len(out)])
    assert lowats == [cap]
    assert transport.deliver(body[len(out) : len(out) + 100]) == 100  # into the stash
    small = bytearray(1000)  # 100 bytes from the stash, 900 from the socket: no new call
    fill = receiver.fill(memoryview(small))
    transport.deliver(body[len(out) + 100 : len(out) + 1000])
    await fill
    assert bytes(small) == body[len(out) : len(out) + 1000] and lowats == [cap]
    offset = len(out) + 1000
    rest = bytearray(len(body) - offset)  # 1.5 caps less 1000 bytes
    fill = receiver.fill(memoryview(rest))
    for n in (most, 1000, cap // 4, *[most] * 8):  # then under a cap is left, down to none
        offset += transport.deliver(body[offset : offset + n])
        assert receiver.remaining == len(body) - offset
        if receiver.remaining < cap:
            assert lowats[-1] == max(1, receiver.remaining)
        if not receiver.remaining:
            break
    assert receiver.remaining == 0 and lowats[0] == cap and lowats[-1] == 1
    await fill
    assert bytes(rest) == body[len(body) - len(rest) :]
    receiver.close(consumed=True)
    assert lowats[-1] == 1
    assert all(a > b for a, b in zip(lowats, lowats[1:]))  # a system call only for a change

    receiver, request = _receiver(body)
    fill = receiver.fill(memoryview(bytearray(2000)))
    request.transport.deliver(body[:500])
    fill.cancel()
    await asyncio.sleep(0)
    assert request.transport.sock.lowats == [cap, 1]
    receiver.close(consumed=False)  # an error answered before the body's end
    assert request.transport.sock.lowats == [cap, 1] and request.transport.aborted


async def test_a_unix_socket_is_left_alone(receive_all):
    """Linux's poll ignores ``SO_RCVLOWAT`` on Unix stream sockets (readable at one byte; the
    hostile review's probe): no system calls spent there."""
    receiver, request = _receiver(bytes(4 << 20), sock=_Socket(socket.AF_UNIX))
    fill = receiver.fill(memoryview(bytearray(3 << 20)))
    request.transport.deliver(bytes(1000))
    fill.cancel()
    receiver.close(consumed=False)
    assert request.transport.sock.lowats == []


async def test_the_lowat_cap_keeps_within_a_quarter_of_the_body_clocks_grace(receive_all):
    """Bytes held in the socket count as late for the body clock: at most ``rate x grace / 4``
    of them (a client at the minimum rate keeps three quarters of its grace)."""
    receiver, request = _receiver(bytes(4 << 20), clock=BodyClock(grace_s=0.5, min_rate_bytes_per_s=256 << 10))
    fill = receiver.fill(memoryview(bytearray(3 << 20)))
    assert request.transport.sock.lowats == [32 << 10]
    fill.cancel()
    receiver, request = _receiver(bytes(4 << 20), clock=BodyClock(grace_s=0.001, min_rate_bytes_per_s=1))
    receiver.fill(memoryview(bytearray(3 << 20)))
    assert request.transport.sock.lowats == []  # a cap of one byte: the default, never set


async def test_a_cancelled_fill_gets_no_byte_after_it(receive_all):
    body = bytes(5000)
    receiver, request = _receiver(body)
    out = bytearray(b"\xff" * 4000)
    fill = receiver.fill(memoryview(out))
    request.transport.deliver(b"\x01" * 1000)
    fill.cancel()
    request.transport.deliver(b"\x02" * 1000)  # a read already under way lands in the stash
    await asyncio.sleep(0)
    assert not request.transport.reading
    assert bytes(out) == b"\x01" * 1000 + b"\xff" * 3000
    assert receiver.available == 4000  # the 1000 stashed bytes are still the body's
    receiver.close(consumed=False)
    assert request.transport.aborted and CLOSE_AFTER in request


async def test_a_cancelled_request_fails_the_waiting_fill(receive_all):
    """aiohttp's shutdown (and a lost connection) cancel a handler's body reads with an
    exception on ``request.content``: a fill waiting on the socket fails at once."""
    receiver, request = _receiver(bytes(4000))
    fill = receiver.fill(memoryview(bytearray(3000)))
    await asyncio.sleep(0)
    request.content.set_exception(asyncio.CancelledError())
    with pytest.raises(ConnectionResetError, match="cancelled"):
        await asyncio.wait_for(fill, 1.0)
    receiver.close(consumed=False)
    assert request.transport.aborted


async def test_eof_and_loss_fail_the_fill_and_reach_aiohttps_protocol(receive_all):
    for event in ("eof", "lost"):
        receiver, request = _receiver(bytes(4000))
        fill = receiver.fill(memoryview(bytearray(3000)))
        request.transport.deliver(bytes(100))
        if event == "eof":
            receiver.eof_received()
        else:
            receiver.connection_lost(None)
        with pytest.raises(ConnectionResetError):
            await fill
        assert request.protocol.events == [event]
        with pytest.raises(ConnectionResetError):  # and every fill after it
            await receiver.fill(memoryview(bytearray(10)))
    receiver.pause_writing()
    receiver.resume_writing()
    assert request.protocol.events == ["lost", "pause_writing", "resume_writing"]
    receiver.close(consumed=False)  # a lost connection is not touched again
    assert not request.transport.aborted and CLOSE_AFTER not in request


async def test_no_receiver_where_aiohttps_reads_stay():
    body = bytes(streams.RECEIVE_MIN_NBYTES + (1 << 20))
    block = streams.RECEIVE_MIN_BLOCK_NBYTES
    chunked = _Request(body, 0)
    chunked.headers["Transfer-Encoding"] = "chunked"
    unknown = _Request(body, 0)
    unknown.content_length = None
    small = _Request(bytes(streams.RECEIVE_MIN_NBYTES - 1), 0)
    handed = _Request(body, 0)
    handed.transport.protocol = object()
    for request, block_nbytes in ((chunked, block), (unknown, block), (small, block),
                                  (handed, block), (_Request(body, 0), block - 1)):
        assert BodyReceiver.take(request, block_nbytes) is None
        assert request.transport.protocol is not None and not request.transport.calls
    assert BodyReceiver.take(_Request(body, 0), block) is not None
    # decided on the whole body: the same with all but 1000 bytes already buffered by aiohttp
    assert BodyReceiver.take(_Request(body, len(body) - 1000), block).remaining == 1000


async def test_a_fresh_parser_only_for_what_looks_like_aiohttps_handler():
    """fresh_parser gives a new parser of the handler's own class, in the attribute it holds
    it in, built with its server's settings; anything else gets None (the close fallback)."""
    from aiohttp.http_parser import HttpRequestParserPy

    class _Handler:  # aiohttp's names: a parser, and a manager with the handlers' settings
        def __init__(self, attribute: str, settings) -> None:
            setattr(self, attribute, HttpRequestParserPy(self, asyncio.get_running_loop(), 2 ** 16))
            self._manager = type("Server", (), {"_kwargs": settings})()

    for attribute in ("_parser", "_request_parser"):
        handler = _Handler(attribute, {"max_line_size": 100, "auto_decompress": False})  # (the daemon's)
        name, parser = streams.fresh_parser(handler)
        assert name == attribute and type(parser) is HttpRequestParserPy and parser is not getattr(handler, attribute)
        assert parser.max_line_size == 100 and parser._auto_decompress is False and parser.protocol is handler
        assert parser.max_field_size == 8190  # RequestHandler's default where the server sets none
    assert streams.fresh_parser(object()) is None
    assert streams.fresh_parser(_Handler("_parser", None)) is None  # no server settings
    not_a_parser = _Handler("_parser", {})
    not_a_parser._parser = object()
    assert streams.fresh_parser(not_a_parser) is None
