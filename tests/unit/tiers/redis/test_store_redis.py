"""The store with Redis as REMOTE (``remote_url=redis://...``): a second store hits what the
first one put, bit-exact, and a Redis that goes away is only misses."""

from __future__ import annotations

import torch

from kvtier.tiers.redis import RedisTier
from kvtier.types import Medium
from tests.conftest import chain, random_blocks, tiny_spec


def test_second_store_hits_blocks_the_first_put_through_redis(make_store, namespace, tmp_path, redis_server):
    spec = tiny_spec()
    a = make_store(gpu_blocks=8, remote_url=redis_server.url, data_dir=tmp_path / "a")
    b = make_store(gpu_blocks=8, remote_url=redis_server.url, data_dir=tmp_path / "b")
    assert isinstance(a.remote, RedisTier)
    hashes, blocks = chain(6, spec, namespace), random_blocks(spec, 6, seed=11)
    assert a.store(hashes, blocks) == 6
    a.wait_for_writes()
    assert a.stats.stored_blocks[Medium.REMOTE] == 6

    assert b.lookup(hashes).media == [Medium.REMOTE] * 6
    loaded = b.load(hashes)
    assert loaded.sources == [Medium.REMOTE] * 6
    assert torch.equal(b.top.tensor[loaded.block_ids].view(torch.uint8), blocks.view(torch.uint8))
    loaded.lease.release()
    assert b.lookup(hashes).media == [Medium.GPU] * 6
    b.check_invariants()


def test_redis_killed_under_a_store_is_misses_not_errors(make_store, namespace, tmp_path, redis_server):
    spec = tiny_spec()
    store = make_store(gpu_blocks=8, remote_url=redis_server.url + "?ttl_s=60", remote_timeout_s=0.5,
                       data_dir=tmp_path / "a")
    hashes, blocks = chain(4, spec, namespace), random_blocks(spec, 4, seed=12)
    redis_server.kill()
    assert store.store(hashes, blocks) == 4  # local tiers take it; the REMOTE put fails quietly
    store.wait_for_writes()
    other = chain(3, spec, namespace, start=1000)
    assert store.lookup(other).num_hit_blocks == 0
    assert store.remote.errors["unavailable"] >= 1
    store.check_invariants()
