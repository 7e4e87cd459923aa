"""kill -9 a writer at random points, many times; reopen each time (guarantee 2, case D2).

A writer process (forked from the test, so no import cost) stores, loads (promotions spill
older blocks down), flushes and sometimes closes and reopens a TieredStore whose DISK tier
lives in one directory for the whole test, under ``write_back`` and ``write_through``. It
reports over a pipe, one atomic line per event:

- ``A id...``: blocks *acknowledged* as on DISK. A block is acknowledged when a call
  (``store``, ``load``, ``flush``, ``wait_for_writes``, ``close``) has returned and the
  block is in the DISK tier's index, which DiskTier updates only after the LMDB write
  transaction holding the block committed. (A ``store`` into the GPU/CPU pools is not on
  DISK: it gets there when it is spilled, flushed, or written through.) With
  ``writemap=True, sync=False`` a committed transaction is in the page cache and survives
  kill -9 (not a power loss: that needs ``flush()``, an fsync).
- ``D id...``: blocks the next DISK write transaction is about to delete (eviction, or a
  record dropped as unreadable): from then on they may be gone, until acknowledged again.

The test kills the writer with SIGKILL after a random number of events plus a random few
milliseconds (so the kill lands inside stores, spills, LMDB transactions, flushes, closes
and opens), then checks the directory twice:

1. raw, before kvtier opens it: every record decodes and verifies (magic, namespace,
   shape, checksum) with exactly the content of its hash: no block is half-written;
2. through a reopened store: the DISK index equals the database and its usage is the sum of
   the records' footprints (``disk.check()``); every acknowledged block not deleted since is
   present and loads bit-exact through ``store.load``; every block present loads bit-exact
   (a corrupt block is never served).

The numbers (kills, blocks acknowledged and checked, lost, corrupt) are printed (``-s``).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import select
import signal
import threading
import time

import lmdb
import pytest
import torch

from kvtier.hashing import block_hashes_for
from kvtier.records import ReadStatus, decode_into
from kvtier.types import KVSpec
from tests.reliability.conftest import NS, content, contents, loaded_bytes, open_store

CRASH_SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=128, block_size=4, dtype=torch.float16)  # 8 KiB
_FORK = multiprocessing.get_context("fork")


def _universe() -> list[list[bytes]]:
    """60 requests of 1-8 blocks; every third extends the one before it (shared prefixes)."""
    rnd, b, requests = random.Random(7), CRASH_SPEC.block_size, []
    for r in range(60):
        if r % 3 and requests:
            head = requests[-1][: rnd.randint(1, len(requests[-1])) * b]
        else:
            head = []
        requests.append(head + [rnd.randrange(50_000) for _ in range(rnd.randint(1, 6) * b)])
    return [block_hashes_for(tokens, NS, b) for tokens in requests]


REQUESTS = _universe()
ALL = sorted({h for req in REQUESTS for h in req})
ID = {h: i for i, h in enumerate(ALL)}


def _emit(fd: int, tag: str, hashes) -> None:
    """One or more lines ``tag id id ...``, each a single write() below PIPE_BUF (atomic)."""
    ids = [str(ID[h]) for h in hashes]
    for start in range(0, max(1, len(ids)), 400):
        os.write(fd, (" ".join([tag, *ids[start : start + 400]]) + "\n").encode())


def _open(data_dir, disk_blocks: int, policy: str):
    return open_store(data_dir, gpu=4, cpu=6, disk=disk_blocks, spec=CRASH_SPEC, write_policy=policy)


def _writer(data_dir, disk_blocks: int, policy: str, seed: int, fd: int) -> None:
    """The child: random operations forever (until killed), reporting as the module doc says."""
    torch.set_num_threads(1)
    rnd = random.Random(seed)
    reported: set[bytes] = set()
    # Held across a whole DISK write (write-through jobs write on I/O threads) and across an
    # acknowledgement: a block about to be deleted is never acknowledged in between.
    lock = threading.Lock()

    def instrument(store) -> None:
        disk, real_write, real_remove = store.disk, store.disk.write_batch, store.disk.remove

        def write_batch(puts=(), deletes=(), evicted=True):
            with lock:
                if deletes:
                    _emit(fd, "D", deletes)
                    reported.difference_update(deletes)
                return real_write(puts, deletes, evicted)

        def remove(block_hashes):
            with lock:
                _emit(fd, "D", block_hashes)
                reported.difference_update(block_hashes)
                return real_remove(block_hashes)

        disk.write_batch, disk.remove = write_batch, remove

    def acknowledge(store) -> None:
        with lock:
            on_disk = set(store.disk.lru_order())
            _emit(fd, "A", sorted(on_disk - reported, key=ID.get))
            reported.clear()
            reported.update(on_disk)

    store = _open(data_dir, disk_blocks, policy)
    instrument(store)
    while True:
        op, request = rnd.random(), rnd.choice(REQUESTS)
        if op < 0.6:
            store.store(request, contents(request, CRASH_SPEC))
        elif op < 0.8:
            store.load(request).lease.release()
        elif op < 0.9:
            store.flush()
        elif op < 0.95:
            store.wait_for_writes()
        else:
            store.close()
            acknowledge(store)
            store = _open(data_dir, disk_blocks, policy)
            instrument(store)
        acknowledge(store)


def _run_and_kill(data_dir, disk_blocks, policy, seed, rnd) -> tuple[list[str], int]:
    """Start a writer, read its lines, SIGKILL it at a random point; the lines read."""
    read_fd, write_fd = os.pipe()
    proc = _FORK.Process(target=_writer, args=(data_dir, disk_blocks, policy, seed, write_fd), daemon=True)
    proc.start()
    os.close(write_fd)
    buffer, lines = b"", []
    target, deadline = rnd.randint(1, 80), time.monotonic() + 20
    while len(lines) < target and time.monotonic() < deadline:
        if select.select([read_fd], [], [], 0.5)[0]:
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            *done, buffer = buffer.split(b"\n")
            lines += [line.decode() for line in done]
    time.sleep(rnd.random() * 0.004)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    while select.select([read_fd], [], [], 0)[0]:  # what it wrote before dying
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            break
        buffer += chunk
    os.close(read_fd)
    lines += [line.decode() for line in buffer.split(b"\n")[:-1]]  # a cut last line is dropped
    return lines, proc.exitcode


def _apply(lines: list[str], expected: set[bytes]) -> int:
    """Update the acknowledged-and-not-deleted set; returns the blocks acknowledged."""
    acked = 0
    for line in lines:
        tag, *ids = line.split()
        hashes = [ALL[int(i)] for i in ids]
        if tag == "A":
            expected.update(hashes)
            acked += len(hashes)
        else:
            expected.difference_update(hashes)
    return acked


def _check_raw(disk_dir) -> set[bytes]:
    """Every record in the database verifies with its hash's content; returns the keys."""
    env = lmdb.open(str(disk_dir), readonly=True, lock=False, max_readers=8)
    out = torch.empty(CRASH_SPEC.block_shape, dtype=CRASH_SPEC.dtype)
    keys = set()
    try:
        with env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                key = bytes(key)
                status = decode_into(value, NS, out)
                assert status is ReadStatus.OK, f"a half-written or corrupt record survived the kill: {status}"
                assert key in ID and torch.equal(out, content(key, CRASH_SPEC)), "a record holds another block's bytes"
                keys.add(key)
    finally:
        env.close()
    return keys


def _check_store(data_dir, disk_blocks, expected: set[bytes], on_disk: set[bytes]) -> tuple[int, int]:
    """Reopen; (acknowledged blocks lost, corrupt blocks served)."""
    store = open_store(data_dir, gpu=4, cpu=0, disk=disk_blocks, spec=CRASH_SPEC, flush_on_close=False)
    try:
        store.disk.check()  # index == database, usage == sum of footprints, cap holds
        assert set(store.disk.lru_order()) == on_disk
        lost = len(expected - on_disk)
        corrupt = 0
        for h in sorted(on_disk, key=ID.get):
            result = store.load([h])
            with result.lease:
                got = loaded_bytes(store, result)
                if len(result.block_ids) != 1 or not torch.equal(got[0], content(h, CRASH_SPEC)):
                    corrupt += 1
        assert store.stats.load_failures == {}, f"reads failed after the kill: {dict(store.stats.load_failures)}"
        store.check_invariants()
        return lost, corrupt
    finally:
        store.close()


@pytest.mark.slow  # child processes killed at random points
def test_kill_9_at_random_points_never_loses_an_acknowledged_block_nor_serves_a_corrupt_one(tmp_path):
    rnd = random.Random(2024)
    totals = dict(kills=0, acknowledged=0, checked=0, lost=0, corrupt=0, killed_mid_run=0)
    runs = [("big", 100_000, policy) for policy in ("write_back", "write_through")] * 10
    runs += [("small", 24, policy) for policy in ("write_back", "write_through")] * 4
    expected_by_dir: dict[str, set[bytes]] = {}
    for run, (name, disk_blocks, policy) in enumerate(runs):
        data_dir = tmp_path / name  # one directory per capacity, reused across kills
        expected = expected_by_dir.setdefault(name, set())
        lines, exitcode = _run_and_kill(data_dir, disk_blocks, policy, seed=run, rnd=rnd)
        assert exitcode == -signal.SIGKILL, f"the writer died on its own (exit code {exitcode}) before the kill"
        totals["kills"] += 1
        totals["killed_mid_run"] += bool(lines)
        totals["acknowledged"] += _apply(lines, expected)
        on_disk = _check_raw(data_dir / "disk")
        lost, corrupt = _check_store(data_dir, disk_blocks, expected, on_disk)
        totals["checked"] += len(expected)
        totals["lost"] += lost
        totals["corrupt"] += corrupt
        assert (lost, corrupt) == (0, 0), f"run {run} ({name}, {policy}): {lost} acknowledged lost, {corrupt} corrupt"
    print(f"\nkill -9 runs: {totals}")
    assert totals["killed_mid_run"] >= len(runs) - 2, "the writer rarely got going: nothing was tested"
    assert totals["acknowledged"] > 100
