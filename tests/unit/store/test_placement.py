"""Placement and eviction corners: a pinned top pool, requests longer than a tier or than
every tier, one-block tiers under write-through, the hot prefix of E1, tail-first order."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.tiers.disk import DiskTier
from kvtier.types import Medium
from tests.conftest import NS, chain, random_blocks, read_back, stored_then_reopened, tiny_spec

SPEC = tiny_spec()


def test_everything_pinned_makes_store_and_prefetch_short_not_raise(tmp_path, opened):
    store, hashes, blocks = stored_then_reopened(opened, tmp_path, 2, gpu=2)
    held = chain(2, SPEC, NS, start=800)
    store.store(held, random_blocks(SPEC, 2, seed=8))
    lease = store.lookup(held, pin=True).lease  # the whole top pool is pinned
    assert store.load(hashes).block_ids == []
    assert store.store(chain(1, SPEC, NS, start=900), random_blocks(SPEC, 1)) == 0
    lease.release()
    n, out = read_back(store, hashes)
    assert n == 2 and torch.equal(out, blocks)
    store.check_invariants()


def test_request_longer_than_the_top_pool_goes_through_when_lower_tiers_have_room(make_store):
    store = make_store(gpu_blocks=4, cpu_blocks=4, disk_blocks=8)
    hashes, blocks = chain(10, SPEC, NS), random_blocks(SPEC, 10)
    assert store.store(hashes, blocks) == 10
    assert store.lookup(hashes).num_hit_blocks == 10
    n, out = read_back(store, hashes[:4])
    assert n == 4 and torch.equal(out, blocks[:4])
    store.check_invariants()


@pytest.mark.parametrize("tiers", [dict(gpu_blocks=4), dict(gpu_blocks=4, cpu_blocks=4)], ids=["gpu", "gpu+cpu"])
def test_store_of_a_request_larger_than_all_tiers_never_claims_evicted_blocks(make_store, tiers):
    store = make_store(**tiers)
    hashes, blocks = chain(10, SPEC, NS), random_blocks(SPEC, 10)
    claimed = store.store(hashes, blocks)
    assert claimed == store.lookup(hashes).num_hit_blocks  # honest (B2): holds today
    assert claimed >= 1  # keeps the head rather than the tail
    n, out = read_back(store, hashes[:claimed])
    assert torch.equal(out, blocks[:n])


def test_a_store_into_a_pool_with_nothing_below_passes_over_its_own_protected_chunk(make_store):
    """Blocks used again sit in the SLRU's protected segment, after a new request's first
    chunk in eviction order; that chunk is protected while the rest of its request goes in,
    and with nothing below the pool it cannot be freed: it was chosen as the victim anyway
    and the request's second half found no room (2 of 4 stored, daemon hostile run)."""
    store = make_store(gpu_blocks=4)
    old, new = chain(4, SPEC, NS), chain(4, SPEC, NS + b"x")
    blocks = random_blocks(SPEC, 8)
    assert store.store(old, blocks[:4]) == 4
    n, _ = read_back(store, old)  # a use: old moves to the protected segment
    assert n == 4
    assert store.store(new, blocks[4:]) == 4
    assert store.lookup(new).num_hit_blocks == 4
    n, out = read_back(store, new)
    assert n == 4 and torch.equal(out, blocks[4:])
    store.check_invariants()


def test_write_through_with_one_block_tiers_stays_consistent(make_store):
    store = make_store(gpu_blocks=1, cpu_blocks=1, disk_blocks=1, write_policy="write_through")
    for r in range(6):
        hashes, blocks = chain(3, SPEC, NS, start=100 * r), random_blocks(SPEC, 3, seed=r)
        claimed = store.store(hashes, blocks)
        store.wait_for_writes()
        assert claimed >= 1
        n, out = read_back(store, hashes[:1])
        assert n == 1 and torch.equal(out, blocks[:1])
    store.check_invariants()


def test_write_through_background_write_does_not_pin_the_gpu_copy(make_store, monkeypatch):
    real = DiskTier.write_batch
    monkeypatch.setattr(DiskTier, "write_batch", lambda self, *a, **k: (time.sleep(0.2), real(self, *a, **k))[1])
    store = make_store(gpu_blocks=2, cpu_blocks=8, disk_blocks=16, write_policy="write_through")
    hashes = chain(6, SPEC, NS)
    assert store.store(hashes, random_blocks(SPEC, 6)) == 6
    store.wait_for_writes()
    assert store.lookup(hashes).num_hit_blocks == 6


def _hot_prefix_hits(store, hot_blocks, unique_blocks, uniques_between, cycles):
    hot = chain(hot_blocks, SPEC, NS, start=10**7)
    data = random_blocks(SPEC, hot_blocks, seed=99)
    hits, r = [], 0
    for _ in range(cycles):
        n = store.lookup(hot).num_hit_blocks
        hits.append(n)
        if n:
            store.load(hot[:n]).lease.release()
        store.store(hot, data)
        for _ in range(uniques_between):
            r += 1
            store.store(chain(unique_blocks, SPEC, NS, start=1000 * r), random_blocks(SPEC, unique_blocks, seed=r))
    return hits


@pytest.mark.parametrize("tiers", [dict(gpu_blocks=128), dict(gpu_blocks=64, cpu_blocks=64)], ids=["gpu", "gpu+cpu"])
def test_hot_prefix_as_stated_in_e1_hits_90_percent_on_split_tiers(make_store, tiers):
    """E1 at its own numbers: a 64-block (1,024 tokens at B=16) hot prefix every 10th request,
    90 unique prompts totalling 3x the capacity of 128 blocks."""
    store = make_store(**tiers)
    hits = _hot_prefix_hits(store, hot_blocks=64, unique_blocks=4, uniques_between=9, cycles=10)
    assert sum(hits) / (64 * len(hits)) >= 0.9 - 1e-9  # every use but the first, cold one


def test_returning_hot_prefix_is_recognised_from_its_ghosts_before_making_room(make_store):
    store = make_store(gpu_blocks=8)
    hits = _hot_prefix_hits(store, hot_blocks=4, unique_blocks=4, uniques_between=3, cycles=6)
    assert hits == [0, 0, 4, 4, 4, 4]


def test_a_store_of_present_blocks_counts_as_a_use_regression_e1(make_store):
    store = make_store(gpu_blocks=8)
    a, b, c = (chain(4, SPEC, NS, start=s) for s in (0, 100, 200))
    store.store(a, random_blocks(SPEC, 4))
    store.store(b, random_blocks(SPEC, 4, seed=1))
    store.store(a, random_blocks(SPEC, 4))  # the request comes again and stores its prompt
    store.store(c, random_blocks(SPEC, 4, seed=2))
    assert all(h in store.top for h in a) and not any(h in store.top for h in b)


def test_tail_first_eviction_order_within_a_request(make_store):
    store = make_store(gpu_blocks=4)
    first = chain(4, SPEC, NS)
    store.store(first, random_blocks(SPEC, 4))
    store.store(chain(1, SPEC, NS, start=500), random_blocks(SPEC, 1))
    assert [h in store.top for h in first] == [True, True, True, False]
    store.store(chain(1, SPEC, NS, start=600), random_blocks(SPEC, 1))
    assert [h in store.top for h in first] == [True, True, False, False]



def _media_per_block(placement, hashes) -> list:
    """The leading media by :meth:`Placement.medium_of`, block by block (local_prefix's oracle)."""
    media = []
    for h in hashes:
        medium = placement.medium_of(h)
        if medium is None:
            break
        media.append(medium)
    return media


def test_local_prefix_in_one_pass_agrees_with_medium_of_per_block(make_store):
    """local_prefix tests every tier in one loop (issue 17): the same media as medium_of per
    block, through GPU, CPU and DISK, a pending slot (a store in flight) not counted where it
    is pending, and the prefix ending at the first block no tier holds."""
    store = make_store(gpu_blocks=4, cpu_blocks=4, disk_blocks=16)
    hashes = chain(12, SPEC, NS)
    assert store.store(hashes[:10], random_blocks(SPEC, 10)) == 10  # older blocks spill to CPU, DISK
    handle = store.prepare_store(hashes[10:11])  # pending in the top pool: invisible
    try:
        placement = store.placement
        expected = _media_per_block(placement, hashes)
        with store.residency.lock:
            got = placement.local_prefix(hashes)
        assert got == expected and len(got) == 10
        assert {Medium.GPU, Medium.CPU, Medium.DISK} <= set(got)
        assert store.lookup(hashes).media == expected
    finally:
        store.complete_store(handle, success=False)
    assert placement.local_prefix(hashes[10:]) == []


@pytest.mark.parametrize("seed", range(6))
def test_local_prefix_of_one_pool_agrees_with_medium_of_per_block(make_store, seed):
    """The one-pool pass (the daemon's store: a CPU pool over DISK) gives what medium_of
    gives block by block, for prefixes that run from the pool into DISK and back, with and
    without a store in flight."""
    import random

    rng = random.Random(seed)
    store = make_store(gpu_blocks=0, cpu_blocks=4, disk_blocks=16)
    assert len(store.placement.pools) == 1
    hashes = chain(12, SPEC, NS)
    assert store.store(hashes[:10], random_blocks(SPEC, 10)) == 10  # 6 spill to DISK, 4 stay in the pool
    placement = store.placement
    for pending in (False, True):
        handle = store.prepare_store(hashes[10:11]) if pending else None
        try:
            for _ in range(20):
                asked = rng.sample(hashes, rng.randint(0, len(hashes)))
                expected = _media_per_block(placement, asked)
                with store.residency.lock:
                    assert placement.local_prefix(asked) == expected
        finally:
            if handle is not None:
                store.complete_store(handle, success=False)
    in_pool = [h for h in hashes[:10] if placement.medium_of(h) is Medium.CPU]
    on_disk = [h for h in hashes[:10] if placement.medium_of(h) is Medium.DISK]
    assert len(in_pool) >= 3 and len(on_disk) >= 6  # (the pending store above took a slot and gave it back)
    with store.residency.lock:  # from the pool into DISK, back into the pool, then a miss
        got = placement.local_prefix(in_pool[:2] + on_disk + in_pool[2:] + hashes[11:])
    assert got == [Medium.CPU] * 2 + [Medium.DISK] * len(on_disk) + [Medium.CPU] * (len(in_pool) - 2)


def test_checked_hashes_skip_the_second_check_and_bad_hashes_still_raise(make_store):
    """The daemon checks a request's hashes once (CheckedHashes); the store trusts those and
    still refuses anything else."""
    from kvtier.checks import CheckedHashes, checked_block_hashes

    store = make_store(gpu_blocks=4)
    hashes = chain(2, SPEC, NS)
    store.store(hashes, random_blocks(SPEC, 2))
    checked = checked_block_hashes(list(hashes))
    assert type(checked) is CheckedHashes and list(checked) == hashes
    assert store.lookup(checked).num_hit_blocks == 2
    for bad in ([b"short"], [hashes[0], "x" * 32], (bytearray(32),)):
        with pytest.raises(ValueError):
            store.lookup(bad)
        with pytest.raises(ValueError):
            checked_block_hashes(bad)


def test_count_media_is_counter_update():
    from collections import Counter

    from kvtier.store.lookup import count_media

    for media in ([], [Medium.CPU] * 32, [Medium.GPU, Medium.GPU, Medium.CPU], [Medium.DISK, Medium.CPU, Medium.DISK],
                  [Medium.REMOTE]):
        got, expected = Counter({Medium.CPU: 5}), Counter({Medium.CPU: 5})
        count_media(got, media)
        expected.update(media)
        assert got == expected and +got == +expected


def test_a_whole_hit_counts_no_miss_and_a_partial_one_counts_its_tail(make_store):
    # the lookup skips the miss count of a whole hit without a prompt (nothing to count)
    store = make_store(gpu_blocks=0, cpu_blocks=4, disk_blocks=0)
    hashes = chain(6, SPEC, NS)
    assert store.store(hashes[:3], random_blocks(SPEC, 3)) == 3
    assert store.lookup(hashes[:3]).num_hit_blocks == 3
    assert sum(store.stats.miss_tokens.values()) == 0 and store.stats.hit_blocks[Medium.CPU] == 3
    assert store.lookup(hashes).num_hit_blocks == 3
    assert sum(store.stats.miss_tokens.values()) == 3 * SPEC.block_size  # the three blocks after the hit
    assert store.stats.hit_blocks[Medium.CPU] == 6 and store.stats.lookup_blocks == 9
