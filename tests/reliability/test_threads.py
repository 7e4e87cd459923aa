"""Threads: stores, loads, prefetches, lookups and flushes at once serve only the right bytes."""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch

from kvtier.tiers.disk import DiskTier
from tests.conftest import NS, chain, random_blocks, read_back, stored_then_reopened, tiny_spec

SPEC = tiny_spec()


@pytest.mark.slow  # 2.5 s of five kinds of threads racing
def test_threads_storing_loading_prefetching_looking_up_and_flushing_serve_only_right_bytes(make_store):
    store = make_store(gpu_blocks=8, cpu_blocks=8, disk_blocks=64, num_io_threads=3)
    requests = [chain(random.Random(r).randint(1, 6), SPEC, NS, start=10_000 * r) for r in range(30)]
    data = [random_blocks(SPEC, len(requests[r]), seed=r) for r in range(30)]
    errors: list[BaseException] = []
    wrong: list[int] = []
    stop = time.monotonic() + 2.5

    def check(r, result):
        with result.lease:
            if result.block_ids:
                got = store.top.tensor[torch.tensor(result.block_ids, dtype=torch.long)]
                if not torch.equal(got, data[r][: len(result.block_ids)]):
                    wrong.append(r)

    def worker(k: int) -> None:
        rnd = random.Random(k)
        try:
            while time.monotonic() < stop:
                r, op = rnd.randrange(30), rnd.random()
                if op < 0.3:
                    store.store(requests[r], data[r])
                elif op < 0.55:
                    check(r, store.load(requests[r]))
                elif op < 0.8:
                    handle = store.prefetch(requests[r])
                    time.sleep(0.0005)
                    check(r, handle.wait())
                elif op < 0.97:
                    lookup = store.lookup(requests[r], pin=rnd.random() < 0.5)
                    if lookup.lease is not None and rnd.random() < 0.5:
                        lookup.lease.release()
                else:
                    store.flush()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors and not wrong
    assert sum(store.ref_cnt(h) for req in requests for h in req) == 0
    store.check_invariants()


def test_prefetch_in_flight_while_another_thread_stores_the_same_blocks(tmp_path, opened, monkeypatch):
    """The blocks a prefetch is bringing up are pending in the top pool: a store of the same
    blocks from another thread meanwhile stops at the first of them and writes nothing (no
    second slot, no second write), and the prefetch then serves the exact bytes."""
    store, hashes, blocks = stored_then_reopened(opened, tmp_path, 4, gpu=8)
    real, real_views = DiskTier.read_into, DiskTier.read_into_views
    stored = threading.Event()
    monkeypatch.setattr(DiskTier, "read_into", lambda self, *a: (stored.wait(10), real(self, *a))[1])
    monkeypatch.setattr(DiskTier, "read_into_views", lambda self, *a: (stored.wait(10), real_views(self, *a))[1])
    handle = store.prefetch(hashes)  # its DISK reads wait until the store below is done
    stored_before = sum(store.stats.stored_blocks.values())
    results = []
    writer = threading.Thread(target=lambda: results.append(store.store(hashes, blocks)))
    writer.start()
    writer.join(10)
    stored.set()
    assert results == [0] and sum(store.stats.stored_blocks.values()) == stored_before
    result = handle.wait()
    assert len(result.block_ids) == 4
    result.lease.release()
    n, out = read_back(store, hashes)
    assert n == 4 and torch.equal(out, blocks)
    store.check_invariants()

