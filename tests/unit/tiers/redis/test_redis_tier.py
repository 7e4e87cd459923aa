"""RedisTier on one redis-server: bit-exact round trips, prefix lookup, verified reads,
TTL, namespace isolation, spec conflicts, and a server that dies, hangs or fills up."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.records import ReadStatus, encode_record
from kvtier.tiers.backend import RemoteBackend, make_remote
from kvtier.tiers.redis import RedisTier
from kvtier.types import KVSpec
from tests.conftest import chain, random_blocks, tiny_spec

NS = bytes(range(32))
NS_B = bytes(range(1, 33))
SPEC = tiny_spec()
# 256 KiB blocks: records above redis-py's 6,000-byte packing cutoff, sent as separate buffers.
BIG_SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=64, dtype=torch.bfloat16)


def make_tier(url: str, spec: KVSpec = SPEC, namespaces=(NS,), **kwargs) -> RedisTier:
    tier = RedisTier(url, **kwargs)
    for ns in namespaces:
        tier.register(ns, spec)
    return tier


def poisoned(spec: KVSpec, n: int) -> list[torch.Tensor]:
    return [torch.full(spec.block_shape, float("nan")).to(spec.dtype) for _ in range(n)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("spec", [SPEC, BIG_SPEC, tiny_spec(dtype=torch.float16)], ids=["f32", "bf16-256KiB", "f16"])
def test_round_trip_is_bit_exact(redis_server, spec):
    tier = make_tier(redis_server.url, spec)
    hashes = chain(5, spec, NS)
    blocks = list(random_blocks(spec, 5, seed=1))
    assert tier.put(NS, hashes, blocks) == [True] * 5
    outs = poisoned(spec, 5)
    assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK] * 5
    assert all(same_bytes(o, b) for o, b in zip(outs, blocks))
    assert tier.lookup(NS, hashes) == 5
    assert sum(tier.errors.values()) == 0
    tier.close()


def test_values_are_block_records_under_namespaced_keys(redis_server):
    tier = make_tier(redis_server.url)
    hashes = chain(2, SPEC, NS)
    blocks = list(random_blocks(SPEC, 2))
    tier.put(NS, hashes, blocks)
    with redis_server.client() as c:
        value = c.get(b"kvtier:" + NS.hex().encode() + b":" + hashes[0].hex().encode())
        assert value == encode_record(NS, blocks[0], 0).tobytes()
        assert sorted(c.keys()) == sorted(
            [b"kvtier:" + NS.hex().encode() + b":" + h.hex().encode() for h in hashes]
            + [b"kvtier:" + NS.hex().encode() + b":spec"]
        )
        assert c.ttl(b"kvtier:" + NS.hex().encode() + b":" + hashes[0].hex().encode()) == -1  # no TTL by default


def test_lookup_counts_the_leading_present_blocks(redis_server):
    tier = make_tier(redis_server.url)
    hashes = chain(6, SPEC, NS)
    blocks = list(random_blocks(SPEC, 6))
    present = [0, 1, 2, 4]
    tier.put(NS, [hashes[i] for i in present], [blocks[i] for i in present])
    assert tier.lookup(NS, hashes) == 3
    assert tier.lookup(NS, hashes[:2]) == 2
    assert tier.lookup(NS, hashes[3:]) == 0
    assert tier.lookup(NS, hashes[4:5]) == 1
    assert tier.lookup(NS, []) == 0
    # get_into stops at the first missing block: later ones are MISSING even if present.
    outs = poisoned(SPEC, 6)
    statuses = tier.get_into(NS, hashes, outs)
    assert statuses == [ReadStatus.OK] * 3 + [ReadStatus.MISSING] * 3
    assert all(same_bytes(outs[i], blocks[i]) for i in range(3))


def test_put_is_idempotent_and_keeps_the_first_value(redis_server):
    tier = make_tier(redis_server.url)
    h = chain(1, SPEC, NS)
    first, second = random_blocks(SPEC, 2, seed=3)
    assert tier.put(NS, h, [first]) == [True]
    assert tier.put(NS, h, [second]) == [True]  # present: acknowledged, not overwritten
    out = poisoned(SPEC, 1)
    assert tier.get_into(NS, h, out) == [ReadStatus.OK]
    assert same_bytes(out[0], first)


def test_batches_larger_than_max_batch_bytes_go_in_several_pipelines(redis_server):
    tier = make_tier(redis_server.url, BIG_SPEC, max_batch_bytes=3 * BIG_SPEC.block_nbytes)  # 2 blocks a pipeline
    hashes = chain(7, BIG_SPEC, NS)
    blocks = list(random_blocks(BIG_SPEC, 7, seed=4))
    assert tier.put(NS, hashes, blocks) == [True] * 7
    outs = poisoned(BIG_SPEC, 7)
    assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK] * 7
    assert all(same_bytes(o, b) for o, b in zip(outs, blocks))


@pytest.mark.parametrize("damage", ["garbage", "flipped-payload-byte", "truncated", "other-namespace"])
def test_corrupt_value_is_corrupt_deleted_and_repaired_by_the_next_put(redis_server, damage):
    tier = make_tier(redis_server.url, namespaces=(NS, NS_B))
    hashes = chain(3, SPEC, NS)
    blocks = list(random_blocks(SPEC, 3, seed=5))
    tier.put(NS, hashes, blocks)
    key = b"kvtier:" + NS.hex().encode() + b":" + hashes[1].hex().encode()
    with redis_server.client() as c:
        good = c.get(key)
        bad = {
            "garbage": b"not a kvtier record",
            "flipped-payload-byte": good[:-1] + bytes([good[-1] ^ 1]),
            "truncated": good[:-8],
            "other-namespace": encode_record(NS_B, blocks[1], 0).tobytes(),
        }[damage]
        c.set(key, bad)
        outs = poisoned(SPEC, 3)
        assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK, ReadStatus.CORRUPT, ReadStatus.MISSING]
        assert tier.errors["corrupt"] == 1
        assert same_bytes(outs[0], blocks[0])
        assert c.get(key) is None  # dropped, never served again
    assert tier.lookup(NS, hashes) == 1
    assert tier.put(NS, hashes, blocks) == [True] * 3
    outs = poisoned(SPEC, 3)
    assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK] * 3
    assert same_bytes(outs[1], blocks[1])


def test_ttl_expires_blocks(redis_server):
    tier = make_tier(redis_server.url + "?ttl_s=0.3")
    assert tier.ttl_ms == 300
    hashes = chain(2, SPEC, NS)
    tier.put(NS, hashes, list(random_blocks(SPEC, 2)))
    assert tier.lookup(NS, hashes) == 2
    keys = [b"kvtier:" + NS.hex().encode() + b":" + h.hex().encode() for h in hashes]
    with redis_server.client() as c:
        assert 0 < c.pttl(keys[0]) <= 300
        deadline = time.monotonic() + 10
        while c.exists(*keys) and time.monotonic() < deadline:  # (a lookup would refresh the TTL)
            time.sleep(0.05)
    assert tier.lookup(NS, hashes) == 0
    assert tier.get_into(NS, hashes, poisoned(SPEC, 2)) == [ReadStatus.MISSING] * 2
    assert RedisTier(redis_server.url, ttl_s=5).ttl_ms == 5000


def test_namespaces_are_isolated(redis_server):
    tier = make_tier(redis_server.url, namespaces=(NS, NS_B))
    hashes = chain(3, SPEC, NS)  # the same hashes under both namespaces
    a = list(random_blocks(SPEC, 3, seed=6))
    b = list(random_blocks(SPEC, 3, seed=7))
    tier.put(NS, hashes, a)
    assert tier.lookup(NS_B, hashes) == 0
    assert tier.get_into(NS_B, hashes, poisoned(SPEC, 3))[0] is ReadStatus.MISSING
    tier.put(NS_B, hashes, b)
    outs_a, outs_b = poisoned(SPEC, 3), poisoned(SPEC, 3)
    assert tier.get_into(NS, hashes, outs_a) == [ReadStatus.OK] * 3
    assert tier.get_into(NS_B, hashes, outs_b) == [ReadStatus.OK] * 3
    assert all(same_bytes(o, x) for o, x in zip(outs_a, a))
    assert all(same_bytes(o, x) for o, x in zip(outs_b, b))


def test_register_conflict_is_a_value_error(redis_server):
    first = make_tier(redis_server.url)
    first.register(NS, SPEC)  # idempotent
    other_spec = tiny_spec(dtype=torch.float16)
    with pytest.raises(ValueError, match="registered"):
        first.register(NS, other_spec)
    second = RedisTier(redis_server.url)  # another process, through the server
    with pytest.raises(ValueError, match="registered on"):
        second.register(NS, other_spec)
    second.register(NS, SPEC)
    second.register(NS_B, other_spec)
    with pytest.raises(ValueError, match="not registered"):
        RedisTier(redis_server.url).lookup(NS, chain(1, SPEC, NS))


def test_registration_while_down_is_deferred_and_a_later_conflict_is_a_miss(make_redis_server):
    server = make_redis_server()
    url = server.url
    server.kill()
    tier = RedisTier(url, timeout_s=0.5)
    tier.register(NS, SPEC)  # server down: no error, retried on the next call
    tier.register(NS_B, SPEC)
    server.start()
    RedisTier(url).register(NS_B, tiny_spec(dtype=torch.float16))  # meanwhile, another process
    hashes = chain(2, SPEC, NS)
    blocks = list(random_blocks(SPEC, 2))
    _wait_until(lambda: tier.put(NS, hashes, blocks) == [True, True])
    with server.client() as c:
        assert c.exists(b"kvtier:" + NS.hex().encode() + b":spec") == 1
    assert tier.put(NS_B, hashes, blocks) == [False, False]  # conflict: never written
    assert tier.lookup(NS_B, hashes) == 0
    assert tier.errors["conflict"] >= 2


def test_bad_arguments_raise(redis_server):
    tier = make_tier(redis_server.url)
    hashes = chain(2, SPEC, NS)
    with pytest.raises(ValueError, match="block hashes"):
        tier.lookup(NS, ["not bytes"])
    with pytest.raises(ValueError, match="block hashes"):
        tier.put(NS, [b""], list(random_blocks(SPEC, 1)))
    with pytest.raises(ValueError, match="one per block hash"):
        tier.put(NS, hashes, list(random_blocks(SPEC, 1)))
    with pytest.raises(ValueError, match="shape"):
        tier.get_into(NS, hashes[:1], [torch.empty(3)])
    with pytest.raises(ValueError, match="contiguous"):
        tier.put(NS, hashes[:1], [random_blocks(SPEC, 1)[0].transpose(0, 1).contiguous().transpose(0, 1)])
    with pytest.raises(ValueError, match="namespace of 32 bytes"):
        tier.register(b"short", SPEC)
    with pytest.raises(TypeError):
        tier.register(NS, "spec")
    for url in ("http://127.0.0.1:1", "redis://", "redis://127.0.0.1:1?ttl_s=abc", "redis://127.0.0.1:1?ttl_s=-1",
                "redis://127.0.0.1:1?protocol=3"):  # RESP2 only: its replies can be bounded
        with pytest.raises(ValueError):
            RedisTier(url)
    assert tier.lookup(NS, hashes) == 0  # nothing was stored by the bad calls
    assert sum(tier.errors.values()) == 0


def test_make_remote_maps_redis_urls(redis_server):
    tier = make_remote(redis_server.url + "?ttl_s=60", timeout_s=0.7)
    assert isinstance(tier, RedisTier) and isinstance(tier, RemoteBackend)
    assert tier.timeout_s == 0.7 and tier.ttl_ms == 60000 and not tier.cluster
    assert make_remote("redis+cluster://127.0.0.1:7000").cluster
    assert "secret" not in repr(RedisTier("redis://:secret@127.0.0.1:1/0"))


def test_password_from_the_url(make_redis_server):
    server = make_redis_server("--requirepass", "s3cret")
    tier = make_tier(f"redis://:s3cret@127.0.0.1:{server.port}/0")
    hashes = chain(1, SPEC, NS)
    assert tier.put(NS, hashes, list(random_blocks(SPEC, 1))) == [True]
    assert tier.lookup(NS, hashes) == 1
    wrong = RedisTier(f"redis://:wrong@127.0.0.1:{server.port}/0")
    wrong.register(NS, SPEC)  # cannot authenticate: deferred, not an error
    assert wrong.lookup(NS, hashes) == 0
    assert wrong.errors["unavailable"] >= 1


def test_killed_server_gives_misses_then_recovers_after_restart(redis_server):
    tier = make_tier(redis_server.url, timeout_s=0.5)
    hashes = chain(3, SPEC, NS)
    blocks = list(random_blocks(SPEC, 3))
    assert tier.put(NS, hashes, blocks) == [True] * 3
    redis_server.kill()
    start = time.monotonic()
    assert tier.lookup(NS, hashes) == 0
    assert tier.get_into(NS, hashes, poisoned(SPEC, 3)) == [ReadStatus.UNAVAILABLE] * 3
    assert tier.put(NS, hashes, blocks) == [False] * 3
    assert time.monotonic() - start < 5  # refused connections: never a hang
    assert tier.errors["unavailable"] >= 1
    redis_server.start()  # same port, empty (no persistence)
    _wait_until(lambda: tier.put(NS, hashes, blocks) == [True] * 3)  # reconnects
    with redis_server.client() as c:  # and registers the namespace again on the empty server
        assert c.exists(b"kvtier:" + NS.hex().encode() + b":spec") == 1
    outs = poisoned(SPEC, 3)
    assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK] * 3
    assert all(same_bytes(o, b) for o, b in zip(outs, blocks))


def test_hung_server_times_out_into_misses(redis_server):
    tier = make_tier(redis_server.url, timeout_s=0.3)
    hashes = chain(2, SPEC, NS)
    blocks = list(random_blocks(SPEC, 2))
    tier.put(NS, hashes, blocks)
    redis_server.pause()
    try:
        start = time.monotonic()
        assert tier.get_into(NS, hashes, poisoned(SPEC, 2)) == [ReadStatus.TIMEOUT] * 2
        assert tier.lookup(NS, hashes) == 0  # in backoff: answered without the network
        assert time.monotonic() - start < 3  # bounded by the timeout, not a hang
        assert tier.errors["timeout"] == 1 and tier.errors["skipped"] >= 1
    finally:
        redis_server.resume()
    _wait_until(lambda: tier.lookup(NS, hashes) == 2)
    outs = poisoned(SPEC, 2)
    assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK] * 2
    assert all(same_bytes(o, b) for o, b in zip(outs, blocks))


def test_full_server_without_eviction_refuses_puts_and_keeps_serving(make_redis_server):
    server = make_redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    tier = make_tier(server.url, BIG_SPEC)
    hashes = chain(24, BIG_SPEC, NS)  # 24 x 256 KiB = 6 MiB > 2 MiB
    blocks = list(random_blocks(BIG_SPEC, 24, seed=8))
    results = tier.put(NS, hashes, blocks)
    stored = results.index(False)
    assert 0 < stored < 24 and not any(results[stored:])
    assert tier.errors["oom"] == 24 - stored
    outs = poisoned(BIG_SPEC, stored)
    assert tier.get_into(NS, hashes[:stored], outs) == [ReadStatus.OK] * stored
    assert all(same_bytes(o, b) for o, b in zip(outs, blocks))


def test_threads_share_one_tier(redis_server):
    tier = make_tier(redis_server.url)
    failures: list[str] = []

    def worker(seed: int) -> None:
        hashes = chain(4, SPEC, NS, start=1000 * seed)
        blocks = list(random_blocks(SPEC, 4, seed=seed))
        for _ in range(5):
            if tier.put(NS, hashes, blocks) != [True] * 4:
                failures.append(f"put {seed}")
            outs = poisoned(SPEC, 4)
            if tier.get_into(NS, hashes, outs) != [ReadStatus.OK] * 4 or not all(map(same_bytes, outs, blocks)):
                failures.append(f"get {seed}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_close_is_idempotent_and_later_calls_miss(redis_server):
    tier = make_tier(redis_server.url)
    hashes = chain(1, SPEC, NS)
    tier.put(NS, hashes, list(random_blocks(SPEC, 1)))
    tier.close()
    tier.close()
    assert tier.lookup(NS, hashes) == 0
    assert tier.put(NS, hashes, list(random_blocks(SPEC, 1))) == [False]


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
