"""RedisTier's limits (issue 12, item 5): every call has an overall deadline, even against a
server that trickles its reply one byte at a time (each read within the socket timeout); a
reply larger than the call can need is never read whole into memory; a TTL is refreshed on a
hit; and a namespace can be emptied (``clear_namespace``, what ``TieredStore.reset`` uses).

The slow and hostile servers are a small RESP server in this file (:class:`FakeRedis`): a real
redis-server cannot be made to trickle or lie. Everything else runs against redis-server."""

from __future__ import annotations

import socketserver
import threading
import time
import tracemalloc

import pytest
import torch

from kvtier.records import ReadStatus, record_nbytes
from kvtier.store import TieredStore
from kvtier.tiers.redis import RedisTier
from tests.conftest import chain, config_in_blocks, random_blocks, tiny_spec
from tests.unit.tiers.redis.test_redis_tier import NS, NS_B, SPEC, make_tier

FAST_FAIL = dict(backoff_s=0.001, max_backoff_s=0.001)  # no pause after a failure: each call is tried


# -- a RESP server that trickles or lies -------------------------------------------------------
class FakeRedis(socketserver.ThreadingTCPServer):
    """A RESP2 (or, after ``HELLO 3``, RESP3) server on loopback with a dict of strings
    (``SET [NX] [PX]``, ``GET``, ``GETRANGE``, ``GETEX``, ``EXISTS``, ``PEXPIRE``,
    ``DEL``/``UNLINK``; ``+OK`` for anything else). ``slow``: commands whose reply trickles out one byte every ``byte_interval_s`` (for
    at most ``max_trickle_s``); ``huge``: commands answered with a bulk string of ``huge_nbytes``
    bytes, sent as fast as the client takes it."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _FakeRedisHandler)
        self.data: dict[bytes, bytes] = {}
        self.slow: set[str] = set()
        self.huge: set[str] = set()
        self.byte_interval_s = 0.1
        self.max_trickle_s = 8.0
        self.huge_nbytes = 64 << 20
        self.sent_huge_bytes = 0
        self.lock = threading.Lock()
        # shutdown() waits up to one poll interval (0.5 s by default) for the loop to notice
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server_address[1]}/0"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def answer(self, args: list[bytes], resp3: bool = False) -> bytes:
        name = args[0].decode().upper()
        null = b"_\r\n" if resp3 else b"$-1\r\n"
        with self.lock:
            if name == "HELLO":
                return b"%1\r\n+proto\r\n:" + args[1] + b"\r\n"
            if name == "SET":
                key, value, options = args[1], args[2], [a.upper() for a in args[3:]]
                if b"NX" in options and key in self.data:
                    return null
                self.data[key] = value
                return b"+OK\r\n"
            if name in ("GET", "GETEX"):
                value = self.data.get(args[1])
                return null if value is None else _bulk(value)
            if name == "GETRANGE":
                value = self.data.get(args[1], b"")
                return _bulk(value[int(args[2]) : int(args[3]) + 1])
            if name in ("EXISTS", "PEXPIRE"):
                return b":%d\r\n" % (args[1] in self.data)
            if name in ("DEL", "UNLINK"):
                return b":%d\r\n" % sum(self.data.pop(k, None) is not None for k in args[1:])
            if name == "PING":
                return b"+PONG\r\n"
        return b"+OK\r\n"


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class _FakeRedisHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: FakeRedis = self.server  # type: ignore[assignment]
        resp3 = False
        try:
            while True:
                args = self._read_command()
                if args is None:
                    return
                name = args[0].decode().upper()
                resp3 = resp3 or (name == "HELLO" and args[1:2] == [b"3"])
                if name in server.huge:
                    self._send_huge(server)
                elif name in server.slow:
                    self._trickle(server, server.answer(args, resp3))
                else:
                    self.wfile.write(server.answer(args, resp3))
                    self.wfile.flush()
        except (OSError, ValueError):
            return

    def _read_command(self) -> list[bytes] | None:
        line = self.rfile.readline()
        if not line:
            return None
        assert line[:1] == b"*", line
        args = []
        for _ in range(int(line[1:])):
            size = int(self.rfile.readline()[1:])
            args.append(self.rfile.read(size + 2)[:-2])
        return args

    def _trickle(self, server: FakeRedis, reply: bytes) -> None:
        end = time.monotonic() + server.max_trickle_s
        for i in range(len(reply)):
            if time.monotonic() > end:
                raise OSError("trickled long enough")
            self.wfile.write(reply[i : i + 1])
            self.wfile.flush()
            time.sleep(server.byte_interval_s)

    def _send_huge(self, server: FakeRedis) -> None:
        self.wfile.write(b"$%d\r\n" % server.huge_nbytes)
        chunk = bytes(1 << 20)
        left = server.huge_nbytes
        while left > 0:
            n = min(left, len(chunk))
            self.wfile.write(chunk[:n])
            left -= n
            server.sent_huge_bytes += n
        self.wfile.write(b"\r\n")
        self.wfile.flush()


@pytest.fixture
def fake_redis():
    server = FakeRedis()
    yield server
    server.stop()


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


# -- deadlines ---------------------------------------------------------------------------------
CALLS = {
    "register": ({"SET", "GET"}, lambda tier, hashes: tier.register(NS_B, SPEC)),
    "lookup": ({"EXISTS", "PEXPIRE"}, lambda tier, hashes: tier.lookup(NS, hashes)),
    "get": ({"GET", "GETRANGE", "GETEX"},
            lambda tier, hashes: tier.get_into(NS, hashes, [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in hashes])),
    "put": ({"SET"}, lambda tier, hashes: tier.put(NS, hashes, list(random_blocks(SPEC, len(hashes))))),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_server_that_trickles_its_reply_costs_one_deadline_not_a_hang(fake_redis, call):
    """Each byte comes within the 0.3 s socket timeout, so only an overall deadline ends the
    call; the reply would take ~3 s or more to trickle out."""
    tier = make_tier(fake_redis.url, timeout_s=0.3, **FAST_FAIL)
    hashes = chain(8, SPEC, NS)
    assert tier.put(NS, hashes, list(random_blocks(SPEC, 8))) == [True] * 8
    slow, run = CALLS[call]
    fake_redis.slow = slow
    out, elapsed = _timed(lambda: run(tier, hashes))
    assert elapsed < 1.5, f"{call} took {elapsed:.2f} s against a trickling server"
    assert tier.errors["timeout"] == 1
    if call == "lookup":
        assert out == 0
    elif call == "get":
        assert out[0] is ReadStatus.TIMEOUT
    elif call == "put":
        assert out == [False] * 8
    # the server answers at speed again: the next call reconnects and succeeds
    fake_redis.slow = set()
    time.sleep(0.01)
    assert tier.lookup(NS, hashes) == 8
    tier.close()


def test_the_deadline_covers_connecting_and_registering_inside_a_lookup(fake_redis):
    tier = RedisTier(fake_redis.url, timeout_s=0.3, **FAST_FAIL)
    fake_redis.slow = {"SET", "GET"}
    _, elapsed = _timed(lambda: tier.register(NS, SPEC))  # not registered on the server yet
    assert elapsed < 1.5
    time.sleep(0.01)  # past the (1 ms) pause after the failure
    out, elapsed = _timed(lambda: tier.lookup(NS, chain(4, SPEC, NS)))  # registers first: slow too
    assert out == 0 and elapsed < 1.5
    assert tier.errors["timeout"] == 2


# -- reply size caps ---------------------------------------------------------------------------
def _peak_bytes(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("call", ["lookup", "get"])
def test_a_huge_reply_to_a_small_call_is_never_read_whole(fake_redis, call):
    tier = make_tier(fake_redis.url, timeout_s=2.0, **FAST_FAIL)
    hashes = chain(2, SPEC, NS)
    assert tier.put(NS, hashes, list(random_blocks(SPEC, 2))) == [True] * 2
    fake_redis.huge = CALLS[call][0]  # a 64 MiB bulk string answers an EXISTS / a GET of 2 records
    out, peak = _peak_bytes(lambda: CALLS[call][1](tier, hashes))
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB held for a {call} of 2 small blocks"
    assert tier.errors["oversize"] == 1
    assert out == 0 if call == "lookup" else out[0] is not ReadStatus.OK
    tier.close()


def test_a_stored_value_larger_than_a_record_is_not_read_whole_and_is_dropped(redis_server):
    tier = make_tier(redis_server.url)
    hashes = chain(3, SPEC, NS)
    blocks = list(random_blocks(SPEC, 3))
    assert tier.put(NS, hashes, blocks) == [True] * 3
    key = RedisTier._key(NS, hashes[1])
    with redis_server.client() as c:
        c.set(key, bytes(8 << 20))  # 8 MiB under a block key (records here are ~1 KiB)
    assert record_nbytes(SPEC.block_nbytes) < 4096
    outs = [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in hashes]
    statuses, peak = _peak_bytes(lambda: tier.get_into(NS, hashes, outs))
    assert statuses[:2] == [ReadStatus.OK, ReadStatus.CORRUPT]
    assert torch.equal(outs[0], blocks[0])
    assert peak < 2 << 20, f"{peak / 2**20:.1f} MiB held to read 3 blocks of ~1 KiB"
    with redis_server.client() as c:
        assert not c.exists(key)  # dropped: the next put writes the block again
    assert tier.put(NS, hashes[1:2], blocks[1:2]) == [True]
    outs = [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in hashes]
    assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK] * 3
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))


# -- TTL ---------------------------------------------------------------------------------------
def test_a_hit_refreshes_the_ttl(redis_server):
    tier = make_tier(redis_server.url, ttl_s=100)
    hashes = chain(3, SPEC, NS)
    assert tier.put(NS, hashes, list(random_blocks(SPEC, 3))) == [True] * 3
    keys = [RedisTier._key(NS, h) for h in hashes]
    with redis_server.client() as c:
        for key in keys:
            c.pexpire(key, 1000)  # about to expire
        outs = [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in hashes[:2]]
        assert tier.get_into(NS, hashes[:2], outs) == [ReadStatus.OK] * 2
        assert [c.pttl(k) > 50_000 for k in keys] == [True, True, False]  # the blocks read
        for key in keys:
            c.pexpire(key, 1000)
        assert tier.lookup(NS, hashes) == 3
        assert all(c.pttl(k) > 50_000 for k in keys)  # every block the lookup found


def test_without_a_ttl_a_hit_sets_none(redis_server):
    tier = make_tier(redis_server.url)
    hashes = chain(2, SPEC, NS)
    tier.put(NS, hashes, list(random_blocks(SPEC, 2)))
    assert tier.lookup(NS, hashes) == 2
    tier.get_into(NS, hashes, [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in hashes])
    with redis_server.client() as c:
        assert [c.pttl(RedisTier._key(NS, h)) for h in hashes] == [-1, -1]


# -- emptying a namespace ----------------------------------------------------------------------
def _keys_of(clients, namespace: bytes) -> set[bytes]:
    pattern = b"kvtier:" + namespace.hex().encode() + b":*"
    return {k for c in clients for k in c.scan_iter(match=pattern, count=1000)}


def test_clear_namespace_deletes_its_blocks_only(redis_server):
    tier = make_tier(redis_server.url, namespaces=(NS, NS_B))
    ours, theirs = chain(300, SPEC, NS), chain(5, SPEC, NS_B)
    tier.put(NS, ours, list(random_blocks(SPEC, 300)))
    tier.put(NS_B, theirs, list(random_blocks(SPEC, 5)))
    assert tier.clear_namespace(NS) == 300
    with redis_server.client() as c:
        assert _keys_of([c], NS) == {RedisTier._spec_key(NS)}  # the registration stays
        assert len(_keys_of([c], NS_B)) == 6
    assert tier.lookup(NS, ours) == 0 and tier.lookup(NS_B, theirs) == 5
    assert tier.put(NS, ours[:2], list(random_blocks(SPEC, 2))) == [True, True]


@pytest.mark.slow  # starts a redis-server cluster
def test_clear_namespace_on_a_cluster_empties_every_node(redis_cluster):
    redis_cluster.flush()
    tier = make_tier(redis_cluster.url, namespaces=(NS, NS_B))
    ours, theirs = chain(200, SPEC, NS), chain(4, SPEC, NS_B)
    tier.put(NS, ours, list(random_blocks(SPEC, 200)))
    tier.put(NS_B, theirs, list(random_blocks(SPEC, 4)))
    clients = [s.client() for s in redis_cluster.servers]
    try:
        assert sum(len(_keys_of([c], NS)) > 1 for c in clients) == 3  # spread over the nodes
        assert tier.clear_namespace(NS) == 200
        assert _keys_of(clients, NS) == {RedisTier._spec_key(NS)}
        assert len(_keys_of(clients, NS_B)) == 5
    finally:
        for c in clients:
            c.close()
    tier.close()


def test_clear_namespace_against_a_dead_server_is_none(redis_server):
    tier = make_tier(redis_server.url, timeout_s=0.3, **FAST_FAIL)
    redis_server.kill()
    assert tier.clear_namespace(NS) is None
    assert tier.errors["unavailable"] >= 1


def test_store_reset_empties_the_redis_namespace(redis_server, tmp_path):
    spec = tiny_spec()
    store = TieredStore(spec, config_in_blocks(tmp_path, gpu=4, remote_url=redis_server.url), NS, device="cpu")
    hashes = chain(4, spec, NS)
    assert store.store(hashes, torch.stack(list(random_blocks(spec, 4)))) == 4
    store.wait_for_writes()
    with redis_server.client() as c:
        assert len(_keys_of([c], NS)) == 5
        result = store.reset()
        assert result.remote_cleared is True and result.dropped_blocks["REMOTE"] == 4
        assert _keys_of([c], NS) == {RedisTier._spec_key(NS)}
    assert store.lookup(hashes).num_hit_blocks == 0
    store.close()

