"""A store into a full CPU slab writes each new block into a victim's slot as soon as LMDB has
copied the victim (StorePath._prepare's refill, Placement.make_room's ``refill``): exact bytes
on both sides, and no victim slot ever served with another block's bytes when the spill or the
caller's write fails, a victim is pinned or protected, or lookups run meanwhile."""

from __future__ import annotations

import threading

import lmdb
import pytest
import torch

from kvtier.records import ReadStatus
from kvtier.tiers import disk as disk_module
from kvtier.tiers.disk import DiskTier
from kvtier.types import Medium
from tests.conftest import NS, chain, map_full_at, random_blocks, read_back, tiny_spec

pytestmark = pytest.mark.usefixtures("write_overlap")
SPEC = tiny_spec()


def _full_slab(make_store, cpu=8, disk=32):
    store = make_store(gpu_blocks=0, cpu_blocks=cpu, disk_blocks=disk)
    old, old_blocks = chain(cpu, SPEC, NS, start=10_000), random_blocks(SPEC, cpu, seed=1)
    assert store.store(old, old_blocks) == cpu
    assert len(store.pools) == 1 and store.top.num_free == 0
    return store, old, old_blocks


def _recording(top, blocks):
    calls = []

    def write(indices, block_ids):
        calls.append(list(indices))
        for i, b in zip(indices, block_ids):
            top.tensor[b].copy_(blocks[i])

    return write, calls


def _disk_bytes(store, hashes):
    out = torch.empty((len(hashes), *SPEC.block_shape), dtype=SPEC.dtype)
    statuses = [store.disk.read_into(h, NS, out[i]) for i, h in enumerate(hashes)]
    return statuses, out


def test_new_blocks_go_into_victim_slots_as_they_spill_with_exact_bytes(make_store):
    store, old, old_blocks = _full_slab(make_store)
    new, new_blocks = chain(4, SPEC, NS), random_blocks(SPEC, 4, seed=2)
    write, calls = _recording(store.top, new_blocks)
    assert store.store_with(new, write) == 4
    assert calls and all(len(c) == 1 for c in calls) and sorted(i for c in calls for i in c) == [0, 1, 2, 3]
    n, out = read_back(store, new)
    assert n == 4 and torch.equal(out, new_blocks)
    gone = [i for i, h in enumerate(old) if h not in store.top]
    assert gone == [4, 5, 6, 7]  # the request's tail is evicted first
    statuses, on_disk = _disk_bytes(store, old[4:])  # spilled, bytes intact
    assert statuses == [ReadStatus.OK] * 4 and torch.equal(on_disk, old_blocks[4:])
    assert all(store.placement.medium_of(h) is Medium.DISK for h in old[4:])
    n, out = read_back(store, old[:4])  # the rest untouched in the slab
    assert n == 4 and torch.equal(out, old_blocks[:4])
    store.check_invariants()


def test_store_into_full_slab_via_store_matches_without_refill(make_store):
    store, old, old_blocks = _full_slab(make_store)
    new, new_blocks = chain(8, SPEC, NS), random_blocks(SPEC, 8, seed=3)
    assert store.store(new, new_blocks) == 8
    n, out = read_back(store, new)
    assert n == 8 and torch.equal(out, new_blocks)
    statuses, on_disk = _disk_bytes(store, old)
    assert statuses == [ReadStatus.OK] * 8 and torch.equal(on_disk, old_blocks)
    store.check_invariants()


def test_failing_lmdb_write_mid_spill_drops_victims_and_serves_nothing_wrong(make_store, monkeypatch):
    store, old, old_blocks = _full_slab(make_store)
    real = disk_module.put_record
    puts = map_full_at(monkeypatch, 3)
    new, new_blocks = chain(4, SPEC, NS), random_blocks(SPEC, 4, seed=4)
    assert store.store(new, new_blocks) == 4
    n, out = read_back(store, new)
    assert n == 4 and torch.equal(out, new_blocks)
    for h in old[4:]:  # the whole transaction failed: the victims are gone, never half-served
        assert h not in store.top and h not in store.disk
    assert store.stats.store_failures["full"] == 4 and len(puts) == 3
    monkeypatch.setattr(disk_module, "put_record", real)
    n, out = read_back(store, old[:4])
    assert n == 4 and torch.equal(out, old_blocks[:4])
    store.check_invariants()


@pytest.mark.parametrize("exc", [RuntimeError("copy failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_write_that_raises_during_the_spill_leaves_no_victim_with_other_bytes(make_store, exc):
    store, old, old_blocks = _full_slab(make_store)
    top = store.top
    new, new_blocks = chain(4, SPEC, NS), random_blocks(SPEC, 4, seed=5)
    n_calls = []

    def write(indices, block_ids):
        n_calls.append(indices)
        for i, b in zip(indices, block_ids):
            top.tensor[b].copy_(new_blocks[i])  # the slot is overwritten, then the write fails
        if len(n_calls) >= 2:
            raise exc

    with pytest.raises(type(exc)):
        store.store_with(new, write)
    for h, block in zip(old, old_blocks):  # every victim still served is its own bytes
        if h in top:
            n, out = read_back(store, [h])
            assert n == 1 and torch.equal(out[0], block)
        elif h in store.disk:
            statuses, on_disk = _disk_bytes(store, [h])
            assert statuses == [ReadStatus.OK] and torch.equal(on_disk[0], block)
    assert store.lookup(new).num_hit_blocks < 4
    store.check_invariants()


def test_a_pinned_victim_is_skipped_and_keeps_its_bytes(make_store):
    store, old, old_blocks = _full_slab(make_store)
    lease = store.lookup(old[6:], pin=True).lease  # the request's tail: the first victims otherwise
    new, new_blocks = chain(4, SPEC, NS), random_blocks(SPEC, 4, seed=6)
    assert store.store(new, new_blocks) == 4
    assert all(h in store.top for h in old[6:])
    lease.release()
    n, out = read_back(store, old[6:])
    assert n == 2 and torch.equal(out, old_blocks[6:])
    n, out = read_back(store, new)
    assert n == 4 and torch.equal(out, new_blocks)
    victims = [i for i, h in enumerate(old) if h not in store.top]
    assert len(victims) == 4 and 6 not in victims and 7 not in victims
    statuses, on_disk = _disk_bytes(store, [old[i] for i in victims])
    assert statuses == [ReadStatus.OK] * 4 and torch.equal(on_disk, old_blocks[victims])
    store.check_invariants()


def test_request_larger_than_the_slab_with_protected_victims(make_store):
    store, old, old_blocks = _full_slab(make_store, cpu=4, disk=64)
    new, new_blocks = chain(20, SPEC, NS), random_blocks(SPEC, 20, seed=7)
    assert store.store(new, new_blocks) == 20
    for i, h in enumerate(new):
        if h in store.top:
            n, out = read_back(store, [h])
            assert n == 1 and torch.equal(out[0], new_blocks[i])
        else:
            statuses, on_disk = _disk_bytes(store, [h])
            assert statuses == [ReadStatus.OK] and torch.equal(on_disk[0], new_blocks[i])
    statuses, on_disk = _disk_bytes(store, old)
    assert statuses == [ReadStatus.OK] * 4 and torch.equal(on_disk, old_blocks)
    store.check_invariants()


def test_concurrent_lookups_and_loads_during_stores_never_see_other_bytes(make_store):
    store = make_store(gpu_blocks=0, cpu_blocks=8, disk_blocks=400)
    rounds = 12
    chains = [chain(4, SPEC, NS, start=1000 * r) for r in range(rounds)]
    datas = [random_blocks(SPEC, 4, seed=100 + r) for r in range(rounds)]
    stop, errors = threading.Event(), []

    def reader():
        while not stop.is_set():
            for r in range(rounds):
                try:
                    result = store.load(chains[r])
                    with result.lease:
                        for k, b in enumerate(result.block_ids):
                            if not torch.equal(store.top.tensor[b], datas[r][k]):
                                errors.append((r, k))
                except RuntimeError:  # the store closing under the reader
                    return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for r in range(rounds):
            store.store(chains[r], datas[r])
    finally:
        stop.set()
        thread.join()
    assert errors == []
    for r in range(rounds):
        n, out = read_back(store, chains[r])
        assert n == 4 and torch.equal(out, datas[r])
    store.check_invariants()


def test_write_through_stores_take_no_refill(make_store):
    store = make_store(gpu_blocks=0, cpu_blocks=4, disk_blocks=32, write_policy="write_through")
    top = store.top
    for r in range(3):
        hashes, blocks = chain(4, SPEC, NS, start=100 * r), random_blocks(SPEC, 4, seed=r)
        calls = []

        def write(indices, block_ids, blocks=blocks, calls=calls):
            calls.append(list(indices))
            for i, b in zip(indices, block_ids):
                top.tensor[b].copy_(blocks[i])

        assert store.store_with(hashes, write) == 4
        store.wait_for_writes()
        assert calls == [[0, 1], [2, 3]]  # victims already on DISK: one write per chunk (half the slab)
        n, out = read_back(store, hashes)
        assert n == 4 and torch.equal(out, blocks)
    store.check_invariants()


def test_disk_write_batch_after_put_is_called_once_per_record_put(tmp_path):
    disk = DiskTier(tmp_path / "d", 64 * disk_module.record_footprint(SPEC.block_nbytes))
    hashes, blocks = chain(3, SPEC, NS), random_blocks(SPEC, 3)
    seen = []
    assert disk.write_batch([(h, NS, blocks[i]) for i, h in enumerate(hashes)], after_put=seen.append) == [True] * 3
    assert seen == [0, 1, 2]
    seen.clear()  # already present: skipped, not called
    assert disk.write_batch([(hashes[0], NS, blocks[0])], after_put=seen.append) == [True] and seen == []
    disk.close()


def test_no_refill_while_cuda_is_in_use(make_store, monkeypatch):
    store, old, old_blocks = _full_slab(make_store)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    new, new_blocks = chain(4, SPEC, NS), random_blocks(SPEC, 4, seed=9)
    write, calls = _recording(store.top, new_blocks)
    assert store.store_with(new, write) == 4
    assert calls == [[0, 1, 2, 3]]  # one write after the spill, as before
    n, out = read_back(store, new)
    assert n == 4 and torch.equal(out, new_blocks)
    statuses, on_disk = _disk_bytes(store, old[4:])
    assert statuses == [ReadStatus.OK] * 4 and torch.equal(on_disk, old_blocks[4:])
    store.check_invariants()


def test_a_write_through_job_is_written_in_transactions_of_disk_txn_bytes(make_store, monkeypatch):
    """A DISK write job of more than DISK_TXN_BYTES (a write-through store's chunk can be half
    the host pool) goes in transactions of at most that much, the most the map's slack is
    sized for (kvtier.tiers.disk.DISK_TXN_BYTES); every block lands and reads back."""
    monkeypatch.setattr(disk_module, "DISK_TXN_BYTES", 3 * SPEC.block_nbytes)
    batches: list[int] = []
    real = DiskTier.write_batch

    def spy(self, puts=(), deletes=(), *args, **kwargs):
        if puts:
            batches.append(len(puts))
        return real(self, puts, deletes, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "write_batch", spy)
    store = make_store(gpu_blocks=0, cpu_blocks=16, disk_blocks=32, write_policy="write_through")
    hashes, blocks = chain(8, SPEC, NS), random_blocks(SPEC, 8, seed=21)
    assert store.store(hashes, blocks) == 8
    store.wait_for_writes()
    assert batches == [3, 3, 2]
    assert all(h in store.disk for h in hashes)
    store.top.clear()
    n, out = read_back(store, hashes)
    assert n == 8 and torch.equal(out, blocks)
    store.check_invariants()
