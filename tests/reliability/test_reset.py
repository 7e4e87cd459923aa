"""``TieredStore.reset()``: every tier empty for the store, nothing in flight brings a block
back, and nothing a caller holds across the reset breaks or is overwritten (issue 12, item 6).

What a reset promises (docs/architecture.md, "Reset"):
- GPU/CPU pools, DISK records and the REMOTE namespace are empty; usage is 0; counters stay;
- a prefetch in flight publishes nothing (its ``wait()`` is an empty LoadResult) and frees its
  slots once its reads are done; a block stored again after the reset is served with the new
  bytes, never the old ones;
- a LoadResult taken before the reset keeps its bytes until its lease is released (the slots
  are not handed to new blocks while pinned), and the release raises nothing;
- a store prepared before the reset and completed after it publishes nothing;
- background writes (write-through to DISK, puts to REMOTE) in flight land before the reset,
  so none brings a block back after it; a reopened DISK is empty.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.store import clear_data_dir
from kvtier.testing import Fault, FaultPlan, MemoryRemote, inject_disk_faults, inject_remote_faults
from kvtier.types import Medium
from tests.reliability.conftest import NS, contents, loaded_bytes, open_store
from tests.reliability.test_faults import _request


def _everywhere(stores, tmp_path, remote=None, n=4):
    """A store (GPU 2, CPU 2, DISK, REMOTE) holding ``n`` blocks in every tier it has."""
    store = stores(open_store(tmp_path, gpu=2, cpu=2, disk=16, remote=remote, write_policy="write_through"))
    hashes = _request(n)
    assert store.store(hashes, contents(hashes)) == n
    store.flush()
    return store, hashes


def _usage_blocks(store) -> dict[str, int]:
    return {tier: u["blocks"] for tier, u in store.usage().items()}


def test_reset_publishes_all_blocks_cleared_to_kv_event_subscribers(stores, tmp_path):
    """A router following KV events (examples/router.py) must forget every block of a reset
    store: the reset publishes ``AllBlocksCleared`` after the tiers are empty."""
    from kvtier.store.events import AllBlocksCleared, BlockStored

    store, hashes = _everywhere(stores, tmp_path)
    events = store.events.queue()
    store.reset()
    batches = events.drain()
    assert [type(e) for b in batches for e in b.events] == [AllBlocksCleared]
    assert store.store(hashes[:1], contents(hashes[:1])) == 1
    stored = [e for b in events.drain() for e in b.events]
    assert stored and all(isinstance(e, BlockStored) for e in stored)


def test_reset_empties_every_tier_and_keeps_the_counters(stores, tmp_path):
    remote = MemoryRemote()
    store, hashes = _everywhere(stores, tmp_path, remote)
    assert _usage_blocks(store) == {"GPU": 2, "CPU": 2, "DISK": 4} and len(remote.records) == 4
    stored_before = dict(store.stats.stored_blocks)

    result = store.reset()

    assert result.remote_cleared is True
    assert result.dropped_blocks == {"GPU": 2, "CPU": 2, "DISK": 4, "REMOTE": 4}
    assert _usage_blocks(store) == {"GPU": 0, "CPU": 0, "DISK": 0}
    assert all(u["used_bytes"] == 0 for u in store.usage().values())
    assert remote.records == {} and NS in remote.specs  # the namespace stays registered
    assert store.lookup(hashes).num_hit_blocks == 0
    assert dict(store.stats.stored_blocks) == stored_before  # counters are history: kept
    store.check_invariants()
    # the store keeps working: the pools are whole again
    assert store.store(hashes, contents(hashes)) == 4
    result = store.load(hashes)
    assert torch.equal(loaded_bytes(store, result), contents(hashes[: len(result.block_ids)]))
    result.lease.release()


def test_reopened_disk_is_empty_after_a_reset(stores, tmp_path):
    store, hashes = _everywhere(stores, tmp_path)
    store.reset()
    store.close()
    again = stores(open_store(tmp_path, gpu=2, cpu=2, disk=16))
    assert again.usage()["DISK"]["blocks"] == 0
    assert again.lookup(hashes).num_hit_blocks == 0
    with again.disk.env.begin() as txn:
        assert txn.stat()["entries"] == 0


def test_prefetch_in_flight_across_a_reset_publishes_nothing_and_frees_its_slots(stores, tmp_path):
    hashes = _request(4)
    first = open_store(tmp_path, gpu=4, cpu=0, disk=16)
    first.store(hashes, contents(hashes))
    first.close()
    store = stores(open_store(tmp_path, gpu=6, cpu=0, disk=16, num_io_threads=1))
    with inject_disk_faults(store, FaultPlan([Fault("read", "delay", delay_s=0.15)])):
        handle = store.prefetch(hashes)  # four DISK reads, 0.15 s each, on the I/O thread
        assert handle.num_blocks == 4 and not handle.done()
        store.reset()
        # stored again after the reset with other bytes: the old reads must never be served
        new = contents(_request(4, start=100))
        assert store.store(hashes[:2], new[:2]) == 2  # in the 2 slots the prefetch does not hold
        result = handle.wait()
    assert result.block_ids == [] and result.sources == []
    result.lease.release()
    again = store.load(hashes[:2])
    assert torch.equal(loaded_bytes(store, again), new[:2])
    again.lease.release()
    assert store.residency.pending() == set()
    assert store.top.num_free == store.top.num_blocks - 2  # only the two new blocks hold slots
    store.check_invariants()


def test_abandoned_prefetch_across_a_reset_frees_its_slots(stores, tmp_path):
    hashes = _request(3)
    first = open_store(tmp_path, gpu=3, cpu=0, disk=16)
    first.store(hashes, contents(hashes))
    first.close()
    store = stores(open_store(tmp_path, gpu=3, cpu=0, disk=16, num_io_threads=1))
    with inject_disk_faults(store, FaultPlan([Fault("read", "delay", delay_s=0.1)])):
        handle = store.prefetch(hashes)
        store.reset()
        del handle  # dropped without wait(): its finalizer cleans up
    store.wait_for_writes()  # any store call runs deferred cleanups
    store.check_invariants()
    assert store.top.num_free == store.top.num_blocks


def test_lease_held_across_a_reset_keeps_its_bytes_and_releases_cleanly(stores, tmp_path):
    store = stores(open_store(tmp_path, gpu=4, cpu=0, disk=0))
    hashes = _request(2)
    store.store(hashes, contents(hashes))
    result = store.load(hashes)
    held_ids = list(result.block_ids)
    store.reset()
    assert store.top.num_free == 2  # the pinned slots are not free yet
    other = _request(4, start=200)
    assert store.store(other, contents(other)) == 2  # fills the free slots only
    assert torch.equal(loaded_bytes(store, result), contents(hashes))  # untouched
    assert store.lookup(hashes).num_hit_blocks == 0
    result.lease.release()
    result.lease.release()  # idempotent, no error
    store.check_invariants()
    assert store.top.num_free == 2 and set(held_ids) <= set(range(store.top.num_blocks))
    assert store.store(other[2:], contents(other[2:])) == 2  # the slots came back


def test_store_prepared_before_a_reset_publishes_nothing(stores, tmp_path):
    store = stores(open_store(tmp_path, gpu=4, cpu=0, disk=16, write_policy="write_through"))
    hashes = _request(3)
    handle = store.prepare_store(hashes)
    assert handle.block_ids
    store.reset()
    store.top.tensor[handle.block_ids] = contents(hashes)
    store.complete_store(handle)
    store.wait_for_writes()
    assert store.lookup(hashes).num_hit_blocks == 0
    assert store.usage()["DISK"]["blocks"] == 0
    assert store.top.num_free == store.top.num_blocks
    store.check_invariants()


def test_background_writes_in_flight_do_not_bring_blocks_back(stores, tmp_path):
    remote = MemoryRemote()
    store = stores(open_store(tmp_path, gpu=4, cpu=0, disk=16, remote=remote, write_policy="write_through"))
    hashes = _request(3)
    slow_disk = FaultPlan([Fault("write", "delay", delay_s=0.15)])
    slow_remote = FaultPlan([Fault("put", "delay", delay_s=0.15)])
    with inject_disk_faults(store, slow_disk), inject_remote_faults(remote, slow_remote):
        assert store.store(hashes, contents(hashes)) == 3  # DISK write and REMOTE put in flight
        store.reset()
    time.sleep(0.2)
    store.wait_for_writes()
    assert slow_disk.count(kind="delay") >= 1 and slow_remote.count(kind="delay") >= 1
    assert store.usage()["DISK"]["blocks"] == 0 and remote.records == {}
    assert store.lookup(hashes).num_hit_blocks == 0
    store.close()
    assert open_store(tmp_path, gpu=4, cpu=0, disk=16).lookup(hashes).num_hit_blocks == 0


def test_a_remote_without_clear_is_reported_not_cleared(stores, tmp_path):
    class NoClear(MemoryRemote):
        clear_namespace = None  # a backend that cannot empty a namespace

    remote = NoClear()
    store, hashes = _everywhere(stores, tmp_path, remote)
    result = store.reset()
    assert result.remote_cleared is False and "REMOTE" not in result.dropped_blocks
    assert _usage_blocks(store) == {"GPU": 0, "CPU": 0, "DISK": 0}
    assert store.reset(remote=False).remote_cleared is None


def test_lookups_racing_a_reset_never_see_stale_blocks(stores, tmp_path):
    remote = MemoryRemote()
    store, hashes = _everywhere(stores, tmp_path, remote)
    stop = threading.Event()
    seen_after: list[int] = []
    errors: list[BaseException] = []

    def lookups() -> None:
        try:
            while not stop.is_set():
                after = reset_done.is_set()  # before the load: one begun earlier may see the blocks
                result = store.load(hashes)
                with result.lease:
                    n = len(result.block_ids)
                    if n and not torch.equal(loaded_bytes(store, result), contents(hashes[:n])):
                        errors.append(AssertionError("wrong bytes"))
                if after:
                    seen_after.append(n)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    reset_done = threading.Event()
    thread = threading.Thread(target=lookups)
    thread.start()
    time.sleep(0.05)
    store.reset()
    reset_done.set()
    time.sleep(0.05)
    stop.set()
    thread.join()
    assert not errors
    assert seen_after and all(n == 0 for n in seen_after)
    store.check_invariants()


def test_clear_data_dir_empties_a_closed_stores_disk_and_refuses_a_live_one(tmp_path):
    store = open_store(tmp_path, gpu=2, cpu=0, disk=16)
    hashes = _request(3)
    store.store(hashes, contents(hashes))
    store.flush()
    with pytest.raises(RuntimeError, match="in use"):
        clear_data_dir(tmp_path)
    store.close()
    assert clear_data_dir(tmp_path) == 3
    assert clear_data_dir(tmp_path) == 0
    again = open_store(tmp_path, gpu=2, cpu=0, disk=16)
    assert again.lookup(hashes).num_hit_blocks == 0
    again.close()
    with pytest.raises(FileNotFoundError):
        clear_data_dir(tmp_path / "nothing-here")
    assert not (tmp_path / "nothing-here").exists()


def test_reset_of_a_closed_store_raises(tmp_path):
    store = open_store(tmp_path, gpu=2, cpu=0, disk=0)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.reset()


def test_content_stored_after_a_reset_is_what_loads(stores, tmp_path):
    """The reason to reset: the same hashes now stand for other K/V (weights changed in
    place). Every tier must answer with the new bytes."""
    remote = MemoryRemote()
    store, hashes = _everywhere(stores, tmp_path, remote)
    store.reset()
    new = contents(_request(4, start=300))
    assert store.store(hashes, new) == 4
    store.flush()
    for n in (1, 4):
        result = store.load(hashes[:n])
        assert torch.equal(loaded_bytes(store, result), new[: len(result.block_ids)])
        result.lease.release()
    store.close()
    second = stores(open_store(tmp_path / "other", gpu=2, cpu=0, disk=0, remote=remote))
    result = second.load(hashes)
    assert len(result.block_ids) == 2  # the top pool's size; from REMOTE
    assert result.sources == [Medium.REMOTE] * 2
    assert torch.equal(loaded_bytes(second, result), new[:2])
    result.lease.release()

