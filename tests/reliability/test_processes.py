"""Processes and threads around one store (guarantee 5).

Fork: what a child forked after the store opened may do. Supported (the goal): the child
reads - ``lookup``/``load`` of blocks on DISK give the exact bytes - and never writes into the
parent's LMDB database (the parent owns the DISK index, the cap and the accounting; the
daemon is how processes share a cache); the parent keeps working, and a child killed in the
middle of a read leaves no reader slot behind (kvtier's fork handler: ``TieredStore`` and
``DiskTier`` ``after_fork_in_child``). Found failing before that handler existed: a ``load``
hung when the parent's I/O threads existed (the child's copy of the thread pool believed its
idle workers were there), a child's spills wrote into the parent's database behind its index,
and a child killed inside a read transaction left a reader slot registered under the parent's
pid (LMDB could not tell it was stale).

Threads: more reader threads than LMDB's default ``max_readers`` (126) read at once without
exhausting the reader table (kvtier opens the environment with ``max_readers=512`` and reads
on ``num_io_threads`` I/O threads).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from kvtier.records import ReadStatus
from kvtier.testing import Fault, FaultPlan, inject_disk_faults
from kvtier.types import Medium
from tests.reliability.conftest import NS, SPEC, content, contents, loaded_bytes, open_store
from tests.reliability.test_faults import _request

_FORK = multiprocessing.get_context("fork")


def _on_disk(stores, tmp_path, n=6):
    """A store (1 I/O thread, already started by a DISK read) whose DISK holds ``n`` blocks."""
    hashes = _request(n)
    first = open_store(tmp_path, gpu=n, cpu=0, disk=4 * n)
    first.store(hashes, contents(hashes))
    first.close()
    store = stores(open_store(tmp_path, gpu=2, cpu=0, disk=4 * n, num_io_threads=1))
    store.load(hashes[:1]).lease.release()  # the I/O thread now exists, as in any running engine
    assert store.lookup(hashes).media[1:] == [Medium.DISK] * (n - 1)
    return store, hashes


def _in_child(target, timeout_s: float = 5.0):
    """Run ``target(conn)`` in a forked child; its message, or ``"no answer"`` (then killed)."""
    ours, theirs = _FORK.Pipe(duplex=False)
    proc = _FORK.Process(target=_child_main, args=(target, theirs), daemon=True)
    proc.start()
    theirs.close()
    answer = ours.recv() if ours.poll(timeout_s) else "no answer"
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    return answer


def _child_main(target, conn) -> None:
    torch.set_num_threads(1)
    try:
        conn.send(target())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(f"raised {type(exc).__name__}: {exc}")


def _parent_keeps_working(store, hashes) -> None:
    other = _request(3, start=900)
    assert store.store(other, contents(other)) == 3
    store.flush()
    result = store.load(hashes[:2])
    assert torch.equal(loaded_bytes(store, result), contents(hashes[:2]))
    result.lease.release()
    store.check_invariants()


def test_forked_child_reads_through_the_disk_tier_and_the_parent_keeps_working(stores, tmp_path):
    store, hashes = _on_disk(stores, tmp_path)

    def child():
        out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
        ok = [store.disk.read_into(h, NS, out) is ReadStatus.OK and torch.equal(out, content(h)) for h in hashes[1:]]
        return sum(ok)

    assert _in_child(child) == len(hashes) - 1
    _parent_keeps_working(store, hashes)


def test_forked_child_loads_disk_blocks_bit_exact(stores, tmp_path):
    store, hashes = _on_disk(stores, tmp_path)

    def child():
        result = store.load(hashes[1:2])
        return len(result.block_ids) == 1 and torch.equal(loaded_bytes(store, result)[0], content(hashes[1]))

    assert _in_child(child, timeout_s=3.0) is True
    _parent_keeps_working(store, hashes)


def test_forked_child_never_writes_into_the_parents_database(stores, tmp_path):
    store, hashes = _on_disk(stores, tmp_path)

    def child():  # stores and spills are synchronous: no I/O thread needed (no hang, see above)
        request = _request(4, start=500)
        store.store(request, contents(request))
        store.flush()
        return "done"

    assert _in_child(child) == "done"
    with store.disk.env.begin() as txn:
        assert txn.stat()["entries"] == len(store.disk), "the child wrote records the parent's index does not know"
    _parent_keeps_working(store, hashes)


def test_forked_child_killed_inside_a_read_leaves_no_reader_slot(stores, tmp_path):
    store, hashes = _on_disk(stores, tmp_path)
    ours, theirs = _FORK.Pipe(duplex=False)

    def reader() -> None:
        plan = FaultPlan([Fault("read", "delay", delay_s=60)])
        with inject_disk_faults(store, plan):  # the read stalls inside its LMDB read transaction
            theirs.send("reading")
            store.disk.read_into(hashes[1], NS, torch.empty(SPEC.block_shape))

    proc = _FORK.Process(target=reader, daemon=True)
    proc.start()
    assert ours.poll(5) and ours.recv() == "reading"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    env = store.disk.env
    env.reader_check()  # clears the slots of dead processes
    active = [line.split() for line in env.readers().splitlines()[1:] if line.strip()]
    assert not [entry for entry in active if entry[-1] != "-"], f"stale reader slots: {active}"


def test_more_reader_threads_than_lmdb_default_max_readers_read_at_once(stores, tmp_path):
    store, hashes = _on_disk(stores, tmp_path)
    num_threads = 200  # > 126, LMDB's default max_readers
    barrier = threading.Barrier(num_threads)
    results: list[bool] = []

    def read(i: int) -> None:
        out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
        h = hashes[1 + i % (len(hashes) - 1)]
        barrier.wait()
        status = store.disk.read_into(h, NS, out)  # each holds its read transaction ~0.2 s (the delay)
        results.append(status is ReadStatus.OK and torch.equal(out, content(h)))

    with inject_disk_faults(store, FaultPlan([Fault("read", "delay", delay_s=0.2)])) as plan:
        threads = [threading.Thread(target=read, args=(i,)) for i in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert plan.count(kind="delay") == num_threads
    assert results.count(True) == num_threads
    active = [line for line in store.disk.env.readers().splitlines()[1:] if line.strip() and not line.endswith("-")]
    assert active == [], "reader slots still taken after the reads"
    store.check_invariants()


def test_many_threads_loading_at_once_all_get_exact_bytes(stores, tmp_path):
    hashes = _request(6)
    first = open_store(tmp_path, gpu=6, cpu=0, disk=24)
    first.store(hashes, contents(hashes))
    first.close()
    store = stores(open_store(tmp_path, gpu=64, cpu=0, disk=24, num_io_threads=4))
    barrier = threading.Barrier(150)
    wrong, errors = [], []

    def load(i: int) -> None:
        request = hashes[: 1 + i % len(hashes)]
        try:
            barrier.wait()
            result = store.load(request)
            with result.lease:
                if not torch.equal(loaded_bytes(store, result), contents(request[: len(result.block_ids)])):
                    wrong.append(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong and store.stats.load_failures == {}
    assert sum(store.stats.loaded_blocks.values()) >= len(hashes)
    store.check_invariants()


@pytest.mark.slow  # forks a child while DISK reads are held for a second
def test_child_forked_with_a_prefetch_and_a_store_in_flight_inherits_no_pin_or_slot(stores, tmp_path):
    """Another thread waits for a prefetch whose DISK reads are slowed, a third holds an open
    ``prepare_store``: the child forked then has neither thread, so every pin and pending
    slot they held must be gone in the child, and their handles must be inert there (``wait``
    returns nothing at once, though the parent's thread holds the handle's lock; completing the
    store publishes nothing)."""
    hashes = _request(4)
    first = open_store(tmp_path, gpu=4, cpu=0, disk=16)
    first.store(hashes, contents(hashes))
    first.close()
    store = stores(open_store(tmp_path, gpu=6, cpu=0, disk=16, num_io_threads=1))
    new = _request(2, start=700)
    inherited: dict = {}
    loaded: list[bool] = []
    prepared, go_on = threading.Event(), threading.Event()

    def prefetching() -> None:
        handle = inherited["prefetch"] = store.prefetch(hashes[:3])
        result = handle.wait()
        loaded.append(len(result.block_ids) == 3 and torch.equal(loaded_bytes(store, result), contents(hashes[:3])))
        result.lease.release()

    def storing() -> None:
        handle = inherited["store"] = store.prepare_store(new)
        prepared.set()
        go_on.wait(20)
        store.top.tensor[handle.block_ids] = contents(new)
        store.complete_store(handle)

    def child():
        residency = store.residency
        at_start = (residency.pending(), residency.pinned(), store.top.num_free)
        empty = inherited["prefetch"].wait()
        store.complete_store(inherited["store"])
        result = store.load(hashes)
        exact = len(result.block_ids) == 4 and torch.equal(loaded_bytes(store, result), contents(hashes))
        result.lease.release()
        return at_start, empty.block_ids, store.lookup(new).num_hit_blocks, exact, residency.pending(), residency.pinned()

    plan = FaultPlan([Fault("read", "delay", delay_s=0.5)])
    with inject_disk_faults(store, plan):
        threads = [threading.Thread(target=prefetching), threading.Thread(target=storing)]
        for t in threads:
            t.start()
        assert prepared.wait(5)
        deadline = time.monotonic() + 5
        while plan.count(kind="delay") == 0 and time.monotonic() < deadline:
            time.sleep(0.005)  # until a DISK read of the prefetch is under way
        assert len(store.residency.pending(Medium.GPU)) == 5 and not inherited["prefetch"].done()
        answer = _in_child(child, timeout_s=10)
        go_on.set()
        for t in threads:
            t.join(20)
    assert answer == ((set(), {}, 6), [], 0, True, set(), {})
    assert loaded == [True]  # the parent's own threads finished as if nothing happened
    assert store.lookup(new).num_hit_blocks == 2
    store.check_invariants()
