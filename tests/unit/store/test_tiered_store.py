"""TieredStore: round trips, LRU and tail-first order, cascade, capacity, leases, persistence."""

from __future__ import annotations

import pytest
import torch

from kvtier.hashing import KeyContext, block_hashes_for
from kvtier.metrics import figures
from kvtier.store import TieredStore
from kvtier.types import Medium
from tests.conftest import chain, config_in_blocks, random_blocks, tiny_spec


def load_bytes(store, hashes):
    """Load ``hashes`` and copy the loaded blocks out: ``[n, *block_shape]``."""
    result = store.load(hashes)
    with result.lease:
        out = store.top.tensor[torch.tensor(result.block_ids, dtype=torch.int64)].clone()
    return result, out


def read_in_place(store, block_hash):
    """The block's bytes as its fastest tier holds them, without moving anything."""
    for pool in store.pools:
        if block_hash in pool:
            return pool.tensor[pool.block_id(block_hash)].clone()
    out = torch.empty(store.spec.block_shape, dtype=store.spec.dtype)
    assert store.disk.read_into(block_hash, store.namespace, out).value == "ok"
    return out


def test_round_trip_gpu_only(make_store, namespace):
    store = make_store(gpu_blocks=4)
    hashes = chain(3, store.spec, namespace)
    blocks = random_blocks(store.spec, 3)
    assert store.store(hashes, blocks) == 3
    result, out = load_bytes(store, hashes)
    assert result.sources == [Medium.GPU] * 3
    assert torch.equal(out, blocks)
    store.check_invariants()


def test_round_trip_through_every_tier_is_byte_exact(make_store, namespace):
    store = make_store(gpu_blocks=1, cpu_blocks=1, disk_blocks=8)
    spec = store.spec
    hashes = chain(3, spec, namespace)
    blocks = random_blocks(spec, 3, seed=1)
    for i in range(3):  # one request per block, so each store pushes the older down
        assert store.store(hashes[i : i + 1], blocks[i : i + 1]) == 1
    assert [store.medium_of(h) for h in hashes] == [Medium.DISK, Medium.CPU, Medium.GPU]
    for i in (0, 1, 2):
        result, out = load_bytes(store, hashes[i : i + 1])
        assert len(result.block_ids) == 1
        assert torch.equal(out[0], blocks[i])  # exact bytes, whatever tier it came from
    store.check_invariants()


def test_lru_order_is_exact(make_store, namespace):
    store = make_store(gpu_blocks=3)
    hashes = [chain(1, store.spec, namespace, start=100 * i)[0] for i in range(4)]
    blocks = random_blocks(store.spec, 4)
    for i in range(3):
        store.store(hashes[i : i + 1], blocks[i : i + 1])
    assert list(store.top.lru_order()) == hashes[:3]  # single-use blocks: exact LRU
    load_bytes(store, hashes[0:1])  # use block 0: block 1 is now least recent
    store.store(hashes[3:4], blocks[3:4])
    assert [store.medium_of(h) for h in hashes] == [Medium.GPU, None, Medium.GPU, Medium.GPU]
    # eviction order: single-use blocks (LRU first), then the reused block 0
    assert list(store.top.lru_order()) == [hashes[2], hashes[3], hashes[0]]
    assert store.stats.evicted_blocks[Medium.GPU] == 1


def test_tail_first_eviction_within_a_request(make_store, namespace):
    store = make_store(gpu_blocks=4)
    spec = store.spec
    request = chain(3, spec, namespace)
    store.store(request, random_blocks(spec, 3))
    assert list(store.top.lru_order()) == [request[2], request[1], request[0]]
    other = chain(2, spec, namespace, start=1000)
    store.store(other, random_blocks(spec, 2, seed=3))
    # Two slots were needed with one free: the tail of the first request went first.
    assert [store.medium_of(h) for h in request] == [Medium.GPU, Medium.GPU, None]
    store.store(chain(1, spec, namespace, start=2000), random_blocks(spec, 1, seed=4))
    assert [store.medium_of(h) for h in request] == [Medium.GPU, None, None]


def test_cascade_gpu_to_cpu_to_disk_with_tiny_capacities(make_store, namespace):
    store = make_store(gpu_blocks=2, cpu_blocks=2, disk_blocks=3)
    spec = store.spec
    hashes = [chain(1, spec, namespace, start=100 * i)[0] for i in range(8)]
    blocks = random_blocks(spec, 8, seed=5)
    for i in range(8):
        store.store(hashes[i : i + 1], blocks[i : i + 1])
        usage = store.usage()
        for tier in usage.values():
            assert tier["used_bytes"] <= tier["capacity_bytes"]
        store.check_invariants()
    media = [store.medium_of(h) for h in hashes]
    assert media == [None] + [Medium.DISK] * 3 + [Medium.CPU] * 2 + [Medium.GPU] * 2
    assert store.stats.spilled_blocks[Medium.CPU] == 6
    assert store.stats.spilled_blocks[Medium.DISK] == 4
    assert store.stats.evicted_blocks[Medium.DISK] == 1
    for i in range(1, 8):  # each tier holds the exact bytes (read in place, no promotion)
        assert torch.equal(read_in_place(store, hashes[i]), blocks[i])


def test_write_through_puts_every_block_on_every_tier(make_store, namespace):
    store = make_store(gpu_blocks=2, cpu_blocks=4, disk_blocks=4, write_policy="write_through")
    hashes = chain(2, store.spec, namespace)
    store.store(hashes, random_blocks(store.spec, 2))
    for h in hashes:  # memory copies are made at once; the DISK write is a background job
        assert h in store.pools[0] and h in store.pools[1]
        assert all(store.ref_cnt(h) in (0, 1) for h in hashes)
    store.wait_for_writes()
    for h in hashes:
        assert h in store.disk and store.ref_cnt(h) == 0


def test_persistence_across_close_and_reopen(make_store, namespace, tmp_path):
    spec = tiny_spec()
    hashes = chain(5, spec, namespace)
    blocks = random_blocks(spec, 5, seed=7)
    store = make_store(gpu_blocks=2, cpu_blocks=2, disk_blocks=8)
    store.store(hashes, blocks)
    store.close()  # flushes GPU and CPU blocks to DISK
    reopened = make_store(gpu_blocks=2, cpu_blocks=2, disk_blocks=8)
    lookup = reopened.lookup(hashes)
    assert lookup.num_hit_blocks == 5 and lookup.media == [Medium.DISK] * 5
    result, out = load_bytes(reopened, hashes[:2])
    assert result.sources == [Medium.DISK, Medium.DISK]
    assert torch.equal(out, blocks[:2])
    reopened.check_invariants()


def test_keys_not_too_strict_reopen_with_other_sizes_hits_regression_k3(make_store, namespace):
    spec = tiny_spec()
    hashes = chain(4, spec, namespace)
    blocks = random_blocks(spec, 4, seed=8)
    first = make_store(gpu_blocks=4, cpu_blocks=4, disk_blocks=8)
    first.store(hashes, blocks)
    first.close()
    other = make_store(gpu_blocks=2, cpu_blocks=0, disk_blocks=16)  # other pool sizes, no CPU tier
    assert other.lookup(hashes).num_hit_blocks == 4
    _, out = load_bytes(other, hashes[:2])
    assert torch.equal(out, blocks[:2])


def test_leases_block_eviction_and_are_all_released(make_store, namespace):
    store = make_store(gpu_blocks=2)
    spec = store.spec
    hashes = chain(2, spec, namespace)
    store.store(hashes, random_blocks(spec, 2))
    lookup = store.lookup(hashes, pin=True)
    assert [store.ref_cnt(h) for h in hashes] == [1, 1]
    newer = chain(1, spec, namespace, start=500)
    assert store.store(newer, random_blocks(spec, 1)) == 0  # every victim pinned: refused
    assert all(store.medium_of(h) is Medium.GPU for h in hashes)
    lookup.lease.release()
    lookup.lease.release()  # idempotent
    assert [store.ref_cnt(h) for h in hashes] == [0, 0]
    assert store.store(newer, random_blocks(spec, 1)) == 1
    store.check_invariants()


def test_unreleased_lookup_pins_are_released_when_dropped_regression_o1(make_store, namespace):
    store = make_store(gpu_blocks=4)
    spec = store.spec
    hashes = chain(4, spec, namespace)
    store.store(hashes, random_blocks(spec, 4))
    for _ in range(1000):
        store.lookup(hashes, pin=True)  # never loaded, never released
    assert all(store.ref_cnt(h) == 0 for h in hashes)
    # every block can be evicted
    assert store.store(chain(4, spec, namespace, start=900), random_blocks(spec, 4, seed=2)) == 4
    assert all(store.medium_of(h) is None for h in hashes)
    store.check_invariants()


def test_evicted_slot_reuse_never_serves_old_hash_regression_o2(make_store, namespace):
    store = make_store(gpu_blocks=1)
    spec = store.spec
    (h1,), (h2,) = chain(1, spec, namespace), chain(1, spec, namespace, start=50)
    b1, b2 = random_blocks(spec, 1, seed=1), random_blocks(spec, 1, seed=2)
    store.store([h1], b1)
    slot = store.top.block_id(h1)
    store.store([h2], b2)
    assert store.top.block_id(h2) == slot
    assert store.lookup([h1]).num_hit_blocks == 0
    result = store.load([h1])
    assert result.block_ids == []
    _, out = load_bytes(store, [h2])
    assert torch.equal(out, b2)
    store.check_invariants()


def test_never_claim_more_than_stored_regression_b2(make_store, namespace):
    store = make_store(gpu_blocks=8)
    spec = store.spec
    hashes = chain(4, spec, namespace)
    store.store(hashes[:2], random_blocks(spec, 2))
    assert store.lookup(hashes).num_hit_blocks * spec.block_size == 2 * spec.block_size
    result = store.load(hashes[2:])
    assert result.block_ids == [] and result.sources == []


def test_adapters_do_not_share_blocks_regression_k1(make_store):
    spec = tiny_spec()
    ctx = dict(model_id="m", block_size=spec.block_size)
    ns_a = KeyContext(lora_name="a", **ctx).namespace()
    ns_b = KeyContext(lora_name="b", **ctx).namespace()
    ns_none = KeyContext(**ctx).namespace()
    tokens = list(range(64))
    store = make_store(gpu_blocks=32)
    store.store(block_hashes_for(tokens, ns_a, spec.block_size), random_blocks(spec, 16))
    hit = lambda ns: store.lookup(block_hashes_for(tokens, ns, spec.block_size)).num_hit_blocks * spec.block_size
    assert (hit(ns_a), hit(ns_b), hit(ns_none)) == (64, 0, 0)


def test_hot_prefix_survives_a_scan_regression_e1(make_store, namespace):
    """E1 scaled down and made harder: a hot 8-block prefix every 10th request; 4-block
    unique prompts in between (36 blocks between two hot uses, more than the 32-block cache;
    >= 3x capacity in all). Plain LRU would lose the prefix before every use."""
    spec = tiny_spec()
    store = make_store(gpu_blocks=32, cpu_blocks=0)
    hot = chain(8, spec, namespace, start=10**6)
    hot_blocks = random_blocks(spec, 8, seed=9)
    hot_hits = hot_requests = unique_blocks = 0
    for r in range(100):
        if r % 10 == 0:
            hot_requests += 1
            hit = store.lookup(hot).num_hit_blocks == len(hot)
            hot_hits += hit
            if hit:
                store.load(hot).lease.release()
            store.store(hot, hot_blocks)  # the request stores its prompt: a store is a use
        else:
            store.store(chain(4, spec, namespace, start=100 * r), random_blocks(spec, 4, seed=r))
            unique_blocks += 4
    assert unique_blocks >= 3 * 32 - 10
    # The first use is cold; the second finds it evicted (reuse distance > capacity) but
    # remembered, so it is kept from then on.
    assert hot_requests == 10 and hot_hits >= 8


def test_bad_blocks_raise_value_error(make_store, namespace):
    import pytest

    store = make_store(gpu_blocks=2)
    hashes = chain(1, store.spec, namespace)
    with pytest.raises(ValueError, match="shape"):
        store.store(hashes, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="dtype"):
        store.store(hashes, random_blocks(store.spec, 1).half())
    assert store.lookup(hashes).num_hit_blocks == 0


def test_store_does_not_evict_its_own_present_blocks_to_make_room(make_store, namespace):
    """Re-storing a request whose head is cached: making room for its new tail must not evict
    the head (it would then need a slot itself and the request would be cut short)."""
    store = make_store(gpu_blocks=4)
    spec = store.spec
    hashes = chain(4, spec, namespace)
    blocks = random_blocks(spec, 4)
    store.store(hashes[:2], blocks[:2])
    store.store(chain(2, spec, namespace, start=700), random_blocks(spec, 2, seed=1))
    # the pool is full; the request's two cached blocks are the least recently used
    assert store.store(hashes, blocks) == 4
    assert all(store.medium_of(h) is Medium.GPU for h in hashes)
    store.check_invariants()


def test_record_computed_tokens_counts_under_the_lock_and_refuses_bad_counts(make_store):
    store = make_store()
    assert store.stats.computed_tokens == 0 and store.stats.ttft_saved_s is None
    store.record_computed_tokens(5)
    store.record_computed_tokens(3, ttft_saved_s=0.25)
    store.record_computed_tokens(0, ttft_saved_s=0.5)
    assert store.stats.computed_tokens == 8 and store.stats.ttft_saved_s == 0.75
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="token count"):
            store.record_computed_tokens(bad)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttft_saved_s"):
            store.record_computed_tokens(1, ttft_saved_s=bad)
    assert store.stats.computed_tokens == 8 and store.stats.ttft_saved_s == 0.75


def test_tiers_are_named_by_where_they_live(tmp_path, namespace):
    """Without a CUDA device no tier is called GPU: the GPU budget joins the CPU pool (the
    top pool then); ``emulate_gpu`` builds the two-pool hierarchy in host memory for tests."""
    spec = tiny_spec()
    config = config_in_blocks(tmp_path / "a", gpu=4, cpu=8, disk=16, spec=spec)
    with TieredStore(spec, config, namespace, device="cpu") as store:
        assert [(p.medium, p.device.type, p.num_blocks) for p in store.pools] == [(Medium.CPU, "cpu", 12)]
        hashes = chain(3, spec, namespace)
        assert store.store(hashes, random_blocks(spec, 3)) == 3
        assert store.lookup(hashes).media == [Medium.CPU] * 3
        assert figures(store).tiers == ["CPU", "DISK"] and list(store.usage()) == ["CPU", "DISK"]
    gpu_only = config_in_blocks(tmp_path / "b", gpu=4, spec=spec)
    with TieredStore(spec, gpu_only, namespace, device="cpu") as store:
        assert [(p.medium, p.num_blocks) for p in store.pools] == [(Medium.CPU, 4)]
    with TieredStore(spec, config, namespace, device="cpu", emulate_gpu=True) as store:
        assert [(p.medium, p.device.type, p.num_blocks) for p in store.pools] == [
            (Medium.GPU, "cpu", 4), (Medium.CPU, "cpu", 8)]
