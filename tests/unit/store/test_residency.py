"""Residency: the pins and pending slots of dropped handles come back (O1), close with a
prefetch in flight, a lease collected on an I/O thread."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import signal
import threading
import time

import torch

from kvtier.tiers.disk import DiskTier
from tests.conftest import NS, chain, open_store, patch_record, random_blocks, read_back, stored_then_reopened, tiny_spec

SPEC = tiny_spec()
_FORK = multiprocessing.get_context("fork")


def test_dropped_prefetch_handle_gives_back_its_slots_regression_o1(tmp_path, opened):
    store, hashes, blocks = stored_then_reopened(opened, tmp_path, 4)
    handle = store.prefetch(hashes)
    assert handle.num_blocks == 4
    del handle
    gc.collect()
    assert all(store.ref_cnt(h) == 0 for h in hashes)  # the pins do come back
    n, out = read_back(store, hashes)
    assert n == 4 and torch.equal(out, blocks)
    store.check_invariants()


def test_dropped_store_handle_gives_back_its_slots_regression_o1(make_store):
    store = make_store(gpu_blocks=4)
    handle = store.prepare_store(chain(4, SPEC, NS))
    assert len(handle.block_ids) == 4
    del handle
    gc.collect()
    assert store.store(chain(4, SPEC, NS, start=100), random_blocks(SPEC, 4)) == 4
    store.check_invariants()


def test_thousand_pinned_lookups_and_prefetches_dropped_after_wait_leave_no_pin(make_store):
    store = make_store(gpu_blocks=4, cpu_blocks=4, disk_blocks=16)
    hashes = chain(4, SPEC, NS)
    store.store(hashes, random_blocks(SPEC, 4))
    for _ in range(1000):
        store.lookup(hashes, pin=True)
    for _ in range(50):
        store.prefetch(hashes).wait()  # result and its lease dropped unreleased
    gc.collect()
    assert all(store.ref_cnt(h) == 0 for h in hashes)
    assert store.store(chain(8, SPEC, NS, start=500), random_blocks(SPEC, 8)) == 8
    store.check_invariants()


def test_close_with_a_pending_prefetch_never_serves_a_corrupt_record(tmp_path, opened):
    def flip_payload(txn, hashes):
        patch_record(txn, hashes[0], lambda v: v[:-3] + bytes([v[-3] ^ 0x5A]) + v[-2:])

    store, hashes, blocks = stored_then_reopened(opened, tmp_path, 2, edit=flip_payload)
    handle = store.prefetch(hashes)
    store.close()
    try:
        result = handle.wait()
    except RuntimeError:
        return  # refusing after close is fine
    got = store.top.tensor[torch.tensor(result.block_ids, dtype=torch.long)]
    assert torch.equal(got, blocks[: len(result.block_ids)]), "a corrupt DISK record was served"


def _gc_on_io_thread_child(data_dir, conn) -> None:
    """Child: a lease in cyclic garbage is collected by a GC pass that runs on a DISK I/O
    thread while the main thread holds the store lock in wait_for_writes()."""
    torch.set_num_threads(1)
    gc.disable()  # only the explicit pass below collects
    store = open_store(data_dir, gpu=4, cpu=8, disk=32, write_policy="write_through")
    real = DiskTier.write_batch
    armed = threading.Event()
    calls = itertools.count()

    def lock_held_by_another_thread() -> bool:
        if store.residency.lock.acquire(blocking=False):
            store.residency.lock.release()
            return False
        return True

    def write_batch_after_a_gc_pass(self, *args, **kwargs):
        if next(calls) == 1:  # the write of the second request: wait for the main thread
            armed.wait(5)
            deadline = time.monotonic() + 5
            while not lock_held_by_another_thread() and time.monotonic() < deadline:
                time.sleep(0.01)  # until the main thread is inside wait_for_writes()
            gc.collect()  # what CPython does on whichever thread allocates past the threshold
        return real(self, *args, **kwargs)

    DiskTier.write_batch = write_batch_after_a_gc_pass
    hot = chain(1, SPEC, NS, start=999)
    store.store(hot, random_blocks(SPEC, 1))
    store.wait_for_writes()
    request = []
    request.append(request)  # a request object in a reference cycle, holding a pin
    request.append(store.lookup(hot, pin=True).lease)
    del request
    store.store(chain(2, SPEC, NS), random_blocks(SPEC, 2))
    armed.set()
    store.wait_for_writes()
    conn.send("done")


def test_lease_collected_on_an_io_thread_does_not_deadlock(tmp_path):
    parent, child = _FORK.Pipe(duplex=False)
    proc = _FORK.Process(target=_gc_on_io_thread_child, args=(tmp_path / "kv", child), daemon=True)
    proc.start()
    child.close()
    finished = parent.poll(5)
    if proc.is_alive() and not finished:
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    assert finished and parent.recv() == "done", "deadlock: store lock vs Lease finalizer on the I/O thread"

