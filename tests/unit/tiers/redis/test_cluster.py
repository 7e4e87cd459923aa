"""RedisTier on a local 3-primary Redis Cluster: round trips, keys spread over every node,
prefix lookup across nodes, verified reads, and a cluster that is not there."""

from __future__ import annotations

import time

import pytest
import torch
from redis.cluster import RedisCluster

from kvtier.records import ReadStatus
from kvtier.tiers.redis import RedisTier
from kvtier.types import KVSpec
from tests.conftest import chain, random_blocks, tiny_spec
from tests.unit.tiers.redis.conftest import free_port

pytestmark = pytest.mark.slow  # starts a redis-server cluster

NS = bytes(range(32))
SPEC = tiny_spec()
BIG_SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=64, dtype=torch.bfloat16)


@pytest.fixture
def cluster(redis_cluster):
    redis_cluster.flush()
    return redis_cluster


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("spec", [SPEC, BIG_SPEC], ids=["f32", "bf16-256KiB"])
def test_cluster_round_trip_is_bit_exact_and_spreads_over_every_node(cluster, spec):
    tier = RedisTier(cluster.url)
    tier.register(NS, spec)
    assert tier.cluster
    hashes = chain(24, spec, NS)
    blocks = list(random_blocks(spec, 24, seed=2))
    assert tier.put(NS, hashes, blocks) == [True] * 24
    outs = [torch.full(spec.block_shape, float("nan")).to(spec.dtype) for _ in range(24)]
    assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK] * 24
    assert all(_same_bytes(o, b) for o, b in zip(outs, blocks))
    assert tier.lookup(NS, hashes) == 24
    block_keys_per_node = []
    for server in cluster.servers:
        with server.client() as c:
            block_keys_per_node.append(sum(1 for k in c.scan_iter(match=b"kvtier:*") if not k.endswith(b":spec")))
    assert sum(block_keys_per_node) == 24
    assert all(n > 0 for n in block_keys_per_node), block_keys_per_node  # no hash tag: blocks spread
    assert sum(tier.errors.values()) == 0
    tier.close()


def test_cluster_lookup_prefix_and_corrupt_value(cluster):
    tier = RedisTier(cluster.url)
    tier.register(NS, SPEC)
    hashes = chain(8, SPEC, NS)
    blocks = list(random_blocks(SPEC, 8, seed=3))
    keep = [0, 1, 2, 3, 4, 6, 7]  # block 5 missing
    tier.put(NS, [hashes[i] for i in keep], [blocks[i] for i in keep])
    assert tier.lookup(NS, hashes) == 5
    key = b"kvtier:" + NS.hex().encode() + b":" + hashes[2].hex().encode()
    with RedisCluster(host="127.0.0.1", port=cluster.servers[0].port) as c:  # routed to the slot's owner
        assert c.exists(key) == 1
        c.set(key, b"garbage")
    outs = [torch.empty(SPEC.block_shape) for _ in range(8)]
    statuses = tier.get_into(NS, hashes, outs)
    assert statuses[:3] == [ReadStatus.OK, ReadStatus.OK, ReadStatus.CORRUPT]
    assert tier.errors["corrupt"] == 1
    assert tier.lookup(NS, hashes) == 2  # the corrupt value was deleted


def test_unreachable_cluster_is_a_miss_not_an_error(cluster):
    tier = RedisTier(f"redis+cluster://127.0.0.1:{free_port()}", timeout_s=0.3)
    tier.register(NS, SPEC)  # cannot be reached: deferred
    hashes = chain(2, SPEC, NS)
    assert tier.lookup(NS, hashes) == 0
    assert tier.put(NS, hashes, list(random_blocks(SPEC, 2))) == [False, False]
    assert tier.errors["unavailable"] >= 1


def test_cluster_node_killed_gives_misses_then_recovers_after_restart(own_redis_cluster):
    nodes = own_redis_cluster
    tier = RedisTier(nodes.url, timeout_s=0.5)
    tier.register(NS, SPEC)
    hashes = chain(24, SPEC, NS)  # spread over all three nodes
    blocks = list(random_blocks(SPEC, 24, seed=4))
    assert tier.put(NS, hashes, blocks) == [True] * 24
    nodes.servers[2].kill()
    start = time.monotonic()
    assert tier.lookup(NS, hashes) < 24
    statuses = tier.get_into(NS, hashes, [torch.empty(SPEC.block_shape) for _ in range(24)])
    assert ReadStatus.UNAVAILABLE in statuses or ReadStatus.TIMEOUT in statuses
    assert not all(tier.put(NS, hashes, blocks))
    assert time.monotonic() - start < 10  # refused connections: never a hang
    assert tier.errors["unavailable"] >= 1
    nodes.servers[2].start()  # rejoins from its nodes.conf, empty (no persistence)
    nodes.wait_ok()
    deadline = time.monotonic() + 20
    while tier.put(NS, hashes, blocks) != [True] * 24:
        assert time.monotonic() < deadline, f"no recovery: {dict(tier.errors)}"
        time.sleep(0.1)
    outs = [torch.full(SPEC.block_shape, float("nan")) for _ in range(24)]
    assert tier.get_into(NS, hashes, outs) == [ReadStatus.OK] * 24
    assert all(_same_bytes(o, b) for o, b in zip(outs, blocks))
