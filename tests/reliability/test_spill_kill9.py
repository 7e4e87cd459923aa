"""kill -9 in the middle of a burst of spills to DISK (D2): every block on DISK before the
kill reads back exact after it, and nothing on DISK is garbage."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from tests.conftest import NS, chain, open_store, random_blocks, read_back, tiny_spec

pytestmark = pytest.mark.slow  # kills child processes

SPEC = tiny_spec()
_FORK = multiprocessing.get_context("fork")


def _spill_burst_child(data_dir, base, conn) -> None:
    """Child: store 2-block requests through a 2-block pool, so every store spills to DISK;
    after each, report which of the last requests are wholly on DISK (committed)."""
    torch.set_num_threads(1)
    store = open_store(data_dir, gpu=2, disk=100_000)
    for i in itertools.count():
        store.store(chain(2, SPEC, NS, start=base + 10 * i), random_blocks(SPEC, 2, seed=base + i))
        conn.send([j for j in range(max(0, i - 3), i + 1)
                   if all(h in store.disk for h in chain(2, SPEC, NS, start=base + 10 * j))])


def test_kill_9_mid_spill_burst_keeps_every_completed_block_regression_d2(tmp_path):
    data_dir = tmp_path / "kv"
    completed: dict[int, set[int]] = {}
    rnd = random.Random(2)
    for base in (0, 1_000_000):
        parent, child = _FORK.Pipe(duplex=False)
        proc = _FORK.Process(target=_spill_burst_child, args=(data_dir, base, child), daemon=True)
        proc.start()
        child.close()
        seen, reports, deadline = set(), 0, time.monotonic() + 20
        target = rnd.randint(100, 400)
        while reports < target and time.monotonic() < deadline and parent.poll(1):
            seen.update(parent.recv())
            reports += 1
        os.kill(proc.pid, signal.SIGKILL)  # mid-burst: almost surely inside a store or a spill
        proc.join(5)
        try:
            while parent.poll(0):
                seen.update(parent.recv())
        except (EOFError, OSError):
            pass  # a message cut by the kill
        assert reports >= 10, "the child made too little progress to test anything"
        completed[base] = seen

        store = open_store(data_dir, gpu=2, disk=100_000)
        try:
            store.disk.check()  # index rebuilt from the records == database, usage exact
            for b, indices in completed.items():
                for j in sorted(indices):
                    n, out = read_back(store, chain(2, SPEC, NS, start=b + 10 * j))
                    assert n == 2 and torch.equal(out, random_blocks(SPEC, 2, seed=b + j)), (b, j)
            # nothing on DISK is garbage: every record present reads back verified
            for h in list(store.disk.lru_order()):
                from kvtier.tiers.disk import ReadStatus

                assert store.disk.read_into(h, NS, torch.empty(SPEC.block_shape)) is ReadStatus.OK
            assert store.stats.load_failures == {}
            store.check_invariants()
        finally:
            store.close()

