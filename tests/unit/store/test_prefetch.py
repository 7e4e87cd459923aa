"""Prefetch through the store: DISK reads on I/O threads, failures as misses, pins, slots."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.tiers.disk import DiskTier, ReadStatus
from kvtier.types import Medium
from tests.conftest import chain, random_blocks


def to_disk_only(make_store, n, seed=0, **kwargs):
    """A store whose ``n`` blocks are only on DISK (stored, closed, reopened)."""
    first = make_store(gpu_blocks=max(4, n), disk_blocks=4 * n)
    hashes = chain(n, first.spec, first.namespace)
    blocks = random_blocks(first.spec, n, seed=seed)
    first.store(hashes, blocks)
    first.close()
    return make_store(gpu_blocks=max(4, n), disk_blocks=4 * n, **kwargs), hashes, blocks


def test_prefetch_returns_at_once_and_wait_gives_the_blocks(make_store):
    store, hashes, blocks = to_disk_only(make_store, 8, num_io_threads=3)
    handle = store.prefetch(hashes)
    assert handle.num_blocks == 8
    assert len(handle.read_jobs) == 3  # split over the I/O threads
    # while in flight: pinned, invisible in the top pool, still visible on DISK
    assert all(store.ref_cnt(h) == 1 for h in hashes)
    result = handle.wait()
    assert handle.wait() is result  # idempotent
    assert result.sources == [Medium.DISK] * 8
    with result.lease:
        out = store.top.tensor[torch.tensor(result.block_ids)]
        assert torch.equal(out, blocks)
    assert all(store.medium_of(h) is Medium.GPU for h in hashes)
    store.check_invariants()


def test_a_failed_read_is_a_miss_for_it_and_after(make_store, monkeypatch):
    store, hashes, blocks = to_disk_only(make_store, 6)
    real = DiskTier.read_into

    def flaky(self, h, ns, out, fingerprint=None):
        if h == hashes[3]:
            raise OSError("EIO")
        return real(self, h, ns, out, fingerprint)

    real_views = DiskTier.read_into_views

    def flaky_views(self, block_hashes, *args):  # a job's batch read fails whole: its blocks are read one by one
        if hashes[3] in block_hashes:
            raise OSError("EIO")
        return real_views(self, block_hashes, *args)

    monkeypatch.setattr(DiskTier, "read_into", flaky)
    monkeypatch.setattr(DiskTier, "read_into_views", flaky_views)
    result = store.load(hashes)
    result.lease.release()
    assert len(result.block_ids) == 3
    assert store.stats.load_failures["error"] == 1
    assert store.medium_of(hashes[3]) is Medium.DISK  # an I/O error does not drop the record
    assert [store.medium_of(h) for h in hashes[4:]] == [Medium.GPU, Medium.GPU]  # arrived: kept
    assert all(store.ref_cnt(h) == 0 for h in hashes)
    store.check_invariants()


def test_corrupt_read_drops_the_record_and_counts_once(make_store, monkeypatch):
    store, hashes, _ = to_disk_only(make_store, 4)
    monkeypatch.setattr(DiskTier, "read_into", lambda self, h, ns, out, fingerprint=None: ReadStatus.CORRUPT if h == hashes[1] else ReadStatus.OK)
    monkeypatch.setattr(DiskTier, "read_into_views", lambda self, block_hashes, *args: [
        ReadStatus.CORRUPT if h == hashes[1] else ReadStatus.OK for h in block_hashes])
    result = store.load(hashes)
    result.lease.release()
    assert len(result.block_ids) == 1
    assert store.stats.load_failures == {"corrupt": 1}
    assert store.medium_of(hashes[1]) is None
    store.check_invariants()


def test_unwaited_prefetch_releases_pins_when_dropped(make_store):
    store, hashes, _ = to_disk_only(make_store, 4)
    handle = store.prefetch(hashes)
    handle.wait().lease.release()
    del handle
    assert all(store.ref_cnt(h) == 0 for h in hashes)


def test_concurrent_prefetch_and_store_from_threads_stay_consistent(make_store):
    store = make_store(gpu_blocks=16, cpu_blocks=8, disk_blocks=64)
    spec = store.spec
    requests = [chain(4, spec, store.namespace, start=1000 * r) for r in range(12)]
    data = [random_blocks(spec, 4, seed=r) for r in range(12)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for r in range(k, 12, 3):
                store.store(requests[r], data[r])
                result = store.load(requests[r])
                with result.lease:
                    got = store.top.tensor[torch.tensor(result.block_ids, dtype=torch.long)]
                    assert torch.equal(got, data[r][: len(result.block_ids)])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store.check_invariants()


@pytest.mark.parametrize("fault", ["sinks too short", "a job not made", "a job not taken"])
def test_a_prefetch_that_fails_to_start_frees_its_slots_and_pins(make_store, monkeypatch, fault):
    # found in review (2026-12-03): an exception while _submit made or submitted its DISK
    # read jobs left every planned slot pending and every block pinned, so the blocks never
    # loaded again; now the submitted jobs are waited and everything is given back
    from kvtier.store import prefetch

    monkeypatch.setattr(prefetch, "_SINK_JOB_NBYTES", 1)  # one block a job: several jobs
    store, hashes, blocks = to_disk_only(make_store, 6, num_io_threads=3)
    buf = torch.empty((6, *store.spec.block_shape), dtype=store.spec.dtype)
    sinks = lambda n: [buf[i] for i in range(n)]  # noqa: E731
    calls = [0]

    def third(real):
        def fake(*args, **kwargs):
            calls[0] += 1
            if calls[0] == (3 if real is prefetch.TransferJob else 2):
                raise MemoryError("injected")
            return real(*args, **kwargs)
        return fake

    if fault == "sinks too short":
        sinks = lambda n: [buf[i] for i in range(n - 2)]  # noqa: E731
    elif fault == "a job not made":
        monkeypatch.setattr(prefetch, "TransferJob", third(prefetch.TransferJob))
    else:
        monkeypatch.setattr(store._prefetcher.engine, "submit", third(store._prefetcher.engine.submit))
    with pytest.raises((IndexError, MemoryError)):
        store.prefetch(hashes, sinks=sinks)
    monkeypatch.undo()
    assert not store.residency.pending_slots()
    assert [store.ref_cnt(h) for h in hashes] == [0] * 6
    assert not store._prefetcher.engine._pending
    store.check_invariants()
    result = store.load(hashes)  # the same blocks load again, whole
    with result.lease:
        assert result.sources == [Medium.DISK] * 6
        assert torch.equal(store.top.tensor[torch.tensor(result.block_ids)], blocks)
