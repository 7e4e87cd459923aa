"""Regression tests from trying to break kvtier: bad input at every boundary, kill -9 mid-spill,
corrupt and vanishing DISK records, a full filesystem, threads, GC of unreleased handles,
eviction corners, and the HF connector on a tiny random Llama.

Each test is named after the fault it pins down. Tests marked ``xfail(strict=True)`` reproduce
a kvtier bug that is still open (the reason says which); they turn into failures (XPASS)
once the bug is fixed, so the mark must then be removed. Everything runs on CPU; child
processes are forked (tiny tensors only, so no OpenMP pool is needed after the fork).
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import random
import signal
import struct
import subprocess
import threading
import time

import lmdb
import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.hashing import KeyContext
from kvtier.store import TieredStore
from kvtier.tiers.disk import DiskTier
from kvtier.types import KVSpec, Medium
from tests.conftest import BLOCK_SIZE, chain, config_in_blocks, random_blocks, tiny_spec

SPEC = tiny_spec()
NS = KeyContext(model_id="test-model", block_size=BLOCK_SIZE).namespace()
_FORK = multiprocessing.get_context("fork")
# DISK record header (kvtier/tiers/disk.py): magic 4s, version H, dtype B, ndim B, shape 8I,
# namespace 32s, payload_nbytes Q, seq Q, checksum Q.
_SIZE_OFFSET = struct.calcsize("<4sHBB8I32s")  # 72
_SEQ_OFFSET = _SIZE_OFFSET + 8  # 80
_CHECKSUM_OFFSET = _SEQ_OFFSET + 8  # 88


# -- helpers -----------------------------------------------------------------------------------
def _config(data_dir, gpu=4, cpu=0, disk=0, spec: KVSpec = SPEC, **kwargs) -> StoreConfig:
    return config_in_blocks(data_dir, gpu, cpu, disk, spec, **kwargs)


def _open(data_dir, gpu=4, cpu=0, disk=0, spec: KVSpec = SPEC, **kwargs) -> TieredStore:
    return TieredStore(spec, _config(data_dir, gpu, cpu, disk, spec, **kwargs), NS, device="cpu", emulate_gpu=True)


@pytest.fixture
def opened():
    """``opened(store)`` registers a store to close at teardown; a close that raises (some of
    the bugs below make it raise) is ignored there, the test itself says what it expects."""
    stores: list[TieredStore] = []
    yield lambda store: stores.append(store) or store
    for store in stores:
        try:
            store.close()
        except Exception:  # noqa: BLE001 - teardown of a store a bug left broken
            pass


def _read_back(store: TieredStore, hashes) -> tuple[int, torch.Tensor]:
    """Load ``hashes``; the number of blocks loaded and a copy of their bytes."""
    result = store.load(hashes)
    with result.lease:
        ids = torch.tensor(result.block_ids, dtype=torch.long)
        return len(result.block_ids), store.top.tensor[ids].clone()


def _stored_then_reopened(opened, data_dir, n, seed=0, edit=None, **reopen):
    """Store ``n`` blocks, close (they go to DISK), optionally ``edit(txn)`` the LMDB
    environment behind kvtier's back, reopen. Returns (store, hashes, blocks)."""
    first = _open(data_dir, gpu=max(4, n), disk=4 * n)
    hashes = chain(n, SPEC, NS, start=1000 * seed)
    blocks = random_blocks(SPEC, n, seed=seed)
    assert first.store(hashes, blocks) == n
    first.close()
    if edit is not None:
        env = lmdb.open(str(data_dir / "disk"), map_size=1 << 30)
        with env.begin(write=True) as txn:
            edit(txn, hashes)
        env.close()
    store = opened(_open(data_dir, **{"gpu": max(4, n), "disk": 4 * n, **reopen}))
    return store, hashes, blocks


def _patch_record(txn, key: bytes, fn) -> None:
    value = bytearray(txn.get(key))
    txn.put(key, bytes(fn(value)))


def _records_by_seq(txn) -> list[bytes]:
    """Record keys, oldest store first."""
    seqs = {bytes(k): struct.unpack_from("<Q", v, _SEQ_OFFSET)[0] for k, v in txn.cursor()}
    return sorted(seqs, key=seqs.get)


# == Boundaries: bad input must raise a typed error at the call and leave the store intact ======
def test_bad_blocks_at_store_boundary_raise_value_error_and_keep_stored_blocks(make_store):
    store = make_store(gpu_blocks=4)
    kept, kept_block = chain(1, SPEC, NS, start=900), random_blocks(SPEC, 1, seed=9)
    assert store.store(kept, kept_block) == 1
    hashes = chain(2, SPEC, NS)
    good = random_blocks(SPEC, 2)
    bad_inputs = [
        good[:1],  # one block for two hashes
        good.unsqueeze(0),  # extra dimension
        good.half(),  # wrong dtype
        good.to(torch.float64),
        good.numpy(),  # not a tensor
        [good[0], good[1]],
    ]
    for bad in bad_inputs:
        with pytest.raises(ValueError, match="expected"):
            store.store(hashes, bad)
    assert store.lookup(hashes).num_hit_blocks == 0
    n, out = _read_back(store, kept)
    assert n == 1 and torch.equal(out, kept_block)
    store.check_invariants()


def test_empty_requests_are_no_ops(make_store):
    store = make_store(gpu_blocks=2, cpu_blocks=2, disk_blocks=4)
    empty = torch.empty((0, *SPEC.block_shape))
    assert store.store([], empty) == 0
    assert store.lookup([]).num_hit_blocks == 0 and store.lookup([], pin=True).lease is None
    assert store.load([]).block_ids == []
    assert store.prefetch([]).wait().block_ids == []
    handle = store.prepare_store([])
    store.complete_store(handle)
    store.check_invariants()


@pytest.mark.parametrize("bad_hash", [12345, "a-str-hash", b"", b"x" * 600], ids=["int", "str", "empty", "600B"])
def test_bad_block_hash_is_refused_at_store_not_raised_by_a_later_spill(tmp_path, opened, bad_hash):
    store = opened(_open(tmp_path, gpu=2, disk=16))
    refused = False
    try:
        store.store([bad_hash], random_blocks(SPEC, 1))
    except (TypeError, ValueError) as exc:
        refused = "expected" in str(exc)
    for r in range(3):  # other requests: their stores spill older blocks to DISK (today: they raise)
        assert store.store(chain(2, SPEC, NS, start=100 * (r + 1)), random_blocks(SPEC, 2, seed=r)) == 2
    store.check_invariants()
    assert refused, "a bad hash must be refused at the call with an 'expected ..., got ...' error"


def test_duplicate_hash_in_one_load_does_not_raise_or_leak_a_pending_slot(make_store):
    store = make_store(gpu_blocks=4, cpu_blocks=4)
    (h,) = chain(1, SPEC, NS)
    block = random_blocks(SPEC, 1, seed=3)
    store.store([h], block)
    store.store(chain(4, SPEC, NS, start=100), random_blocks(SPEC, 4))  # h spills to CPU
    assert store.medium_of(h) is Medium.CPU
    store.load([h, h]).lease.release()
    store.check_invariants()
    n, out = _read_back(store, [h])
    assert n == 1 and torch.equal(out, block)


def test_duplicate_hash_in_one_store_request_stores_it_once(make_store):
    store = make_store(gpu_blocks=4)
    (h,) = chain(1, SPEC, NS)
    blocks = random_blocks(SPEC, 2)
    assert store.store([h, h], blocks) >= 1
    n, out = _read_back(store, [h])
    assert n == 1 and torch.equal(out, blocks[:1])
    store.check_invariants()


def test_non_bytes_namespace_is_refused_at_construction(tmp_path, opened):
    config = _config(tmp_path, gpu=1, disk=8)
    try:
        store = opened(TieredStore(SPEC, config, "n" * 32, device="cpu"))
    except (TypeError, ValueError):
        return
    store.store(chain(1, SPEC, NS), random_blocks(SPEC, 1))
    store.store(chain(1, SPEC, NS, start=50), random_blocks(SPEC, 1))  # spills the first


def test_disk_only_config_is_refused_at_construction_not_at_first_store(tmp_path, opened):
    with pytest.raises(ValueError, match="gpu_bytes or cpu_bytes"):
        StoreConfig(gpu_bytes=0, cpu_bytes=0, disk_bytes=1 << 20, block_size=BLOCK_SIZE, data_dir=tmp_path)


@pytest.mark.parametrize(
    "env",
    [
        {"KVTIER_GPU_BYTES": "lots"},
        {"KVTIER_CPU_BYTES": "-5"},
        {"KVTIER_DISK_BYTES": "12 parsecs"},
        {"KVTIER_BLOCK_SIZE": "x"},
        {"KVTIER_BLOCK_SIZE": "-16"},
        {"KVTIER_NUM_IO_THREADS": "0"},
        {"KVTIER_HASH_NAME": "md5"},
        {"KVTIER_WRITE_POLICY": "sometimes"},
        {"KVTIER_GPU_BYTES": "0", "KVTIER_CPU_BYTES": "0", "KVTIER_DISK_BYTES": "0"},
    ],
)
def test_garbage_env_values_raise_value_error(env):
    with pytest.raises(ValueError, match="expected"):
        StoreConfig.from_env(env)


def test_garbage_flush_on_close_env_value_raises_value_error():
    with pytest.raises(ValueError, match="expected"):
        StoreConfig.from_env({"KVTIER_FLUSH_ON_CLOSE": "ture"})


# == Ownership: pins and pending slots of dropped handles (O1), close with work in flight ========
def test_dropped_prefetch_handle_gives_back_its_slots_regression_o1(tmp_path, opened):
    store, hashes, blocks = _stored_then_reopened(opened, tmp_path, 4)
    handle = store.prefetch(hashes)
    assert handle.num_blocks == 4
    del handle
    gc.collect()
    assert all(store.ref_cnt(h) == 0 for h in hashes)  # the pins do come back
    n, out = _read_back(store, hashes)
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
        _patch_record(txn, hashes[0], lambda v: v[:-3] + bytes([v[-3] ^ 0x5A]) + v[-2:])

    store, hashes, blocks = _stored_then_reopened(opened, tmp_path, 2, edit=flip_payload)
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
    store = _open(data_dir, gpu=4, cpu=8, disk=32, write_policy="write_through")
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


# == Threads ======================================================================================
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
    store, hashes, blocks = _stored_then_reopened(opened, tmp_path, 4, gpu=8)
    real = DiskTier.read_into
    monkeypatch.setattr(DiskTier, "read_into", lambda self, *a: (time.sleep(0.05), real(self, *a))[1])
    handle = store.prefetch(hashes)
    results = []
    writer = threading.Thread(target=lambda: results.append(store.store(hashes, blocks)))
    writer.start()
    writer.join()
    assert results[0] in range(0, 5)  # the blocks being brought up are not written twice
    handle.wait().lease.release()
    n, out = _read_back(store, hashes)
    assert n == 4 and torch.equal(out, blocks)
    store.check_invariants()


# == Eviction corners ==============================================================================
def test_everything_pinned_makes_store_and_prefetch_short_not_raise(tmp_path, opened):
    store, hashes, blocks = _stored_then_reopened(opened, tmp_path, 2, gpu=2)
    held = chain(2, SPEC, NS, start=800)
    store.store(held, random_blocks(SPEC, 2, seed=8))
    lease = store.lookup(held, pin=True).lease  # the whole top pool is pinned
    assert store.load(hashes).block_ids == []
    assert store.store(chain(1, SPEC, NS, start=900), random_blocks(SPEC, 1)) == 0
    lease.release()
    n, out = _read_back(store, hashes)
    assert n == 2 and torch.equal(out, blocks)
    store.check_invariants()


def test_request_longer_than_the_top_pool_goes_through_when_lower_tiers_have_room(make_store):
    store = make_store(gpu_blocks=4, cpu_blocks=4, disk_blocks=8)
    hashes, blocks = chain(10, SPEC, NS), random_blocks(SPEC, 10)
    assert store.store(hashes, blocks) == 10
    assert store.lookup(hashes).num_hit_blocks == 10
    n, out = _read_back(store, hashes[:4])
    assert n == 4 and torch.equal(out, blocks[:4])
    store.check_invariants()


@pytest.mark.parametrize("tiers", [dict(gpu_blocks=4), dict(gpu_blocks=4, cpu_blocks=4)], ids=["gpu", "gpu+cpu"])
def test_store_of_a_request_larger_than_all_tiers_never_claims_evicted_blocks(make_store, tiers):
    store = make_store(**tiers)
    hashes, blocks = chain(10, SPEC, NS), random_blocks(SPEC, 10)
    claimed = store.store(hashes, blocks)
    assert claimed == store.lookup(hashes).num_hit_blocks  # honest (B2): holds today
    assert claimed >= 1  # keeps the head rather than the tail
    n, out = _read_back(store, hashes[:claimed])
    assert torch.equal(out, blocks[:n])


def test_write_through_with_one_block_tiers_stays_consistent(make_store):
    store = make_store(gpu_blocks=1, cpu_blocks=1, disk_blocks=1, write_policy="write_through")
    for r in range(6):
        hashes, blocks = chain(3, SPEC, NS, start=100 * r), random_blocks(SPEC, 3, seed=r)
        claimed = store.store(hashes, blocks)
        store.wait_for_writes()
        assert claimed >= 1
        n, out = _read_back(store, hashes[:1])
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


# == DISK integrity ================================================================================
def _flip(offset, mask=0xFF):
    return lambda v: v[:offset] + bytes([v[offset] ^ mask]) + v[offset + 1 :]


_DAMAGE = {
    **{f"flip_header_byte_{o}": _flip(o) for o in (0, 4, 6, 7, 8, 40, 71, _SIZE_OFFSET, _SEQ_OFFSET, _CHECKSUM_OFFSET)},
    "flip_payload_first": _flip(96, 0x01),
    "flip_payload_last": lambda v: v[:-1] + bytes([v[-1] ^ 0x80]),
    "truncate_to_0": lambda v: v[:0],
    "truncate_to_50": lambda v: v[:50],
    "truncate_header_only": lambda v: v[:96],
    "truncate_half": lambda v: v[: len(v) // 2],
    "extend": lambda v: v + b"\0" * 8,
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_damaged_record_is_a_miss_from_it_on_never_garbage_regression_d1(tmp_path, opened, damage):
    store, hashes, blocks = _stored_then_reopened(
        opened, tmp_path, 3, edit=lambda txn, hs: _patch_record(txn, hs[1], _DAMAGE[damage])
    )
    n, out = _read_back(store, hashes)
    assert n == 1 and torch.equal(out, blocks[:1])
    assert store.medium_of(hashes[1]) is None  # dropped (at open, or when the read failed)
    store.check_invariants()
    store.store(chain(3, SPEC, NS, start=500), random_blocks(SPEC, 3, seed=5))
    store.flush()
    store.check_invariants()


def test_record_corrupted_while_the_store_is_open_is_a_counted_miss_regression_d1(tmp_path, opened):
    store, hashes, blocks = _stored_then_reopened(opened, tmp_path, 3)
    with store.disk.env.begin(write=True) as txn:  # behind the index's back
        _patch_record(txn, hashes[1], _flip(200, 0x04))
    n, out = _read_back(store, hashes)
    assert n == 1 and torch.equal(out, blocks[:1])
    assert store.stats.load_failures == {"corrupt": 1}
    assert store.medium_of(hashes[1]) is None
    store.check_invariants()


def test_corrupt_size_field_of_one_record_drops_only_that_record_on_reopen(tmp_path, opened):
    def grow_newest(txn, hashes):
        newest = _records_by_seq(txn)[-1]
        _patch_record(txn, newest, lambda v: v[:_SIZE_OFFSET] + struct.pack("<Q", 1 << 40) + v[_SIZE_OFFSET + 8 :])

    store, hashes, blocks = _stored_then_reopened(opened, tmp_path, 6, edit=grow_newest)
    assert len(store.disk) >= 5, "good records were dropped because of one bad header"
    store.check_invariants()


def test_corrupt_seq_field_does_not_make_later_disk_writes_raise(tmp_path, opened):
    def max_seq(txn, hashes):
        _patch_record(txn, hashes[0], lambda v: v[:_SEQ_OFFSET] + b"\xff" * 8 + v[_SEQ_OFFSET + 8 :])

    store, hashes, _ = _stored_then_reopened(opened, tmp_path, 3, edit=max_seq)
    new, new_blocks = chain(2, SPEC, NS, start=700), random_blocks(SPEC, 2, seed=7)
    store.store(new, new_blocks)
    store.flush()
    store.close()
    again = opened(_open(tmp_path, gpu=4, disk=12))
    n, out = _read_back(again, new)
    assert n == 2 and torch.equal(out, new_blocks)


def test_record_deleted_behind_the_store_is_forgotten_not_claimed_forever(tmp_path, opened):
    store, hashes, blocks = _stored_then_reopened(opened, tmp_path, 3)
    with store.disk.env.begin(write=True) as txn:
        txn.delete(hashes[1])
    n, _ = _read_back(store, hashes)
    assert n == 1 and store.stats.load_failures == {"missing": 1}
    assert store.lookup(hashes).num_hit_blocks == 1
    store.check_invariants()


def test_disk_cap_smaller_than_one_record_stores_in_memory_and_never_raises_regression_d3(tmp_path, opened):
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=512, block_size=BLOCK_SIZE, dtype=torch.float32)
    config = StoreConfig(gpu_bytes=2 * spec.block_nbytes, cpu_bytes=0, disk_bytes=4096, block_size=BLOCK_SIZE,
                         data_dir=tmp_path)
    store = opened(TieredStore(spec, config, NS, device="cpu"))
    for r in range(4):
        hashes = chain(2, spec, NS, start=100 * r)
        assert store.store(hashes, random_blocks(spec, 2, seed=r)) == 2
    store.flush()
    assert len(store.disk) == 0 and store.disk.used_bytes == 0
    store.check_invariants()


def _spill_burst_child(data_dir, base, conn) -> None:
    """Child: store 2-block requests through a 2-block pool, so every store spills to DISK;
    after each, report which of the last requests are wholly on DISK (committed)."""
    torch.set_num_threads(1)
    store = _open(data_dir, gpu=2, disk=100_000)
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

        store = _open(data_dir, gpu=2, disk=100_000)
        try:
            store.disk.check()  # index rebuilt from the records == database, usage exact
            for b, indices in completed.items():
                for j in sorted(indices):
                    n, out = _read_back(store, chain(2, SPEC, NS, start=b + 10 * j))
                    assert n == 2 and torch.equal(out, random_blocks(SPEC, 2, seed=b + j)), (b, j)
            # nothing on DISK is garbage: every record present reads back verified
            for h in list(store.disk.lru_order()):
                from kvtier.tiers.disk import ReadStatus

                assert store.disk.read_into(h, NS, torch.empty(SPEC.block_shape)) is ReadStatus.OK
            assert store.stats.load_failures == {}
            store.check_invariants()
        finally:
            store.close()


def _fill_small_filesystem_child(data_dir, conn) -> None:
    import faulthandler

    faulthandler.disable()  # the expected SIGBUS needs no Python traceback dump
    torch.set_num_threads(1)
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)  # 64 KiB
    config = StoreConfig(gpu_bytes=2 * spec.block_nbytes, cpu_bytes=0, disk_bytes=16 << 20, block_size=16,
                         data_dir=data_dir)
    store = TieredStore(spec, config, NS, device="cpu")
    for i in range(60):  # ~3.8 MiB through a 2 MiB filesystem
        block = torch.full((1, *spec.block_shape), float(i))
        store.store(chain(1, spec, NS, start=100 * i), block)
    store.close()
    conn.send("done")


@pytest.fixture
def small_filesystem(tmp_path):
    """A 2 MiB tmpfs (needs root; skipped elsewhere)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                        capture_output=True).returncode
    if rc != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_full_filesystem_under_the_disk_tier_does_not_kill_the_process_regression_d3(small_filesystem):
    parent, child = _FORK.Pipe(duplex=False)
    proc = _FORK.Process(target=_fill_small_filesystem_child, args=(small_filesystem / "kv", child), daemon=True)
    proc.start()
    child.close()
    finished = parent.poll(30)
    proc.join(10)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.exitcode == 0 and finished, f"the process died with exit code {proc.exitcode} (-7 = SIGBUS)"


def _second_writer_child(data_dir, conn) -> None:
    """Child: open the store, then (when told) fill its DISK tier, then hold it open."""
    torch.set_num_threads(1)
    store = _open(data_dir, gpu=1, disk=4)
    conn.send("opened")
    conn.recv()
    for i in range(6):
        store.store(chain(1, SPEC, NS, start=100 + 10 * i), random_blocks(SPEC, 1, seed=i))
    store.flush()
    conn.send("written")
    conn.recv()
    store.close()


def test_second_process_on_the_same_data_dir_is_refused_or_stays_within_the_cap(tmp_path, opened):
    data_dir = tmp_path / "kv"
    ours, theirs = _FORK.Pipe(duplex=True)
    proc = _FORK.Process(target=_second_writer_child, args=(data_dir, theirs), daemon=True)
    proc.start()
    try:
        assert ours.poll(20) and ours.recv() == "opened"
        try:
            store = opened(_open(data_dir, gpu=1, disk=4))
        except (RuntimeError, OSError, ValueError, lmdb.Error):
            return  # refused with an error: fine
        ours.send("go")
        assert ours.poll(20) and ours.recv() == "written"
        for i in range(6):
            store.store(chain(1, SPEC, NS, start=900 + 10 * i), random_blocks(SPEC, 1, seed=50 + i))
        store.flush()
        with store.disk.env.begin() as txn:
            assert txn.stat()["entries"] <= 4, "DISK cap exceeded"
        store.disk.check()
    finally:
        ours.send("exit")
        ours.send("exit")
        proc.join(10)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)


# == HF connector on a tiny random Llama ===========================================================
HF_BLOCK = 16


def _hf_config(tmp_path, llama, gpu, cpu=0, disk_bytes=0) -> StoreConfig:
    from kvtier.connectors.hf import kv_spec_for

    nbytes = kv_spec_for(llama, HF_BLOCK).block_nbytes
    return StoreConfig(gpu_bytes=gpu * nbytes, cpu_bytes=cpu * nbytes, disk_bytes=disk_bytes, block_size=HF_BLOCK,
                       data_dir=tmp_path)


@pytest.fixture
def connectors():
    made = []
    yield lambda conn: made.append(conn) or conn
    for conn in made:
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass


def _connector(llama, config, emulate_gpu=False):
    """``emulate_gpu``: the GPU pool of ``config`` in host memory (a model on the CPU gets
    none: its budget joins the CPU pool), for the two-pool hierarchy of a CUDA machine."""
    from kvtier.connectors.hf import HFConnector

    conn = HFConnector.from_model(llama, config, model_id="tiny-llama")
    if not emulate_gpu:
        return conn
    conn.close()
    store = TieredStore(conn.store.spec, config, conn.namespace, device="cpu", emulate_gpu=True)
    return HFConnector(llama, store, conn.key_context)


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


def _generate(llama, input_ids, connector=None, plan=None, max_new_tokens=6):
    kwargs = {}
    if connector is not None:
        plan = plan or connector.before_prefill(input_ids)
        kwargs = plan.generate_kwargs()
    with torch.inference_mode():
        out = llama.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs)
    if connector is not None:
        connector.after_request(out[0], plan.cache)
    return out[0, input_ids.shape[1] :].tolist(), plan


def test_hf_turns_restart_and_a_corrupt_record_give_the_cold_greedy_output(llama, tmp_path, connectors):
    config = _hf_config(tmp_path, llama, gpu=64, disk_bytes=32 << 20)
    history = _prompt(40, seed=1)
    conn = connectors(_connector(llama, config))
    for turn in range(4):
        if turn == 2:  # restart, with one DISK record of the history damaged in between
            hashes = conn.block_hashes(history[0])
            conn.close()
            env = lmdb.open(str(tmp_path / "disk"), map_size=1 << 30)
            with env.begin(write=True) as txn:
                _patch_record(txn, hashes[2], _flip(500, 0x10))
            env.close()
            conn = connectors(_connector(llama, config))
        cold, _ = _generate(llama, history)
        warm, plan = _generate(llama, history, conn)
        assert warm == cold, f"turn {turn}"
        if turn == 2:
            assert plan.num_cached_tokens == 2 * HF_BLOCK and conn.store.stats.load_failures == {"corrupt": 1}
        elif turn:
            assert plan.num_cached_tokens >= HF_BLOCK * 2
        history = torch.cat([history, torch.tensor([cold]), _prompt(19, seed=10 + turn)], dim=1)
    conn.store.check_invariants()


def test_hf_bad_inputs_raise_value_error_and_leave_the_store_intact(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=16)))
    ids = _prompt(40, seed=3)
    _generate(llama, ids, conn)
    for bad in (torch.zeros(2, 40, dtype=torch.long), torch.zeros(1, 1, 5, dtype=torch.long),
                torch.tensor(5), torch.zeros(1, 0, dtype=torch.long), [-1] * 40, []):
        with pytest.raises(ValueError, match="expected"):
            conn.before_prefill(bad)
        with pytest.raises(ValueError, match="expected"):
            conn.prefetch(bad)
    with torch.inference_mode():
        out = llama(_prompt(40, seed=4), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    with pytest.raises(ValueError, match="expected"):
        conn.after_request(torch.full((40,), -3), cache)
    with pytest.raises(ValueError, match="expected"):
        conn.after_request(torch.zeros(2, 40, dtype=torch.long), cache)
    assert conn.before_prefill(ids).num_cached_tokens == 32
    conn.store.check_invariants()


def test_hf_reused_prefetch_ticket_never_serves_reused_slots(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=4)))
    ids = _prompt(50, seed=1)
    cold, _ = _generate(llama, ids)
    _generate(llama, ids, conn)
    ticket = conn.prefetch(ids)
    first, _ = _generate(llama, ids, conn, plan=conn.before_prefill(ids, ticket))
    assert first == cold
    _generate(llama, _prompt(70, seed=2), conn)  # other traffic takes the slots
    retry, _ = _generate(llama, ids, conn, plan=conn.before_prefill(ids, ticket))
    assert retry == cold


def test_hf_float_token_ids_are_refused(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=4)))
    with pytest.raises((TypeError, ValueError), match="expected"):
        conn.block_hashes(torch.full((16,), 3.7))
    with pytest.raises((TypeError, ValueError), match="expected"):
        conn.before_prefill(torch.full((1, 20), 3.7))


def test_hf_after_request_without_a_cache_raises_a_typed_error(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=4)))
    with pytest.raises((TypeError, ValueError), match="expected"):
        conn.after_request(_prompt(40)[0], None)


@pytest.mark.xfail(strict=True, reason="LIMITATION: a load lands in the top pool, so HFConnector.before_prefill "
                   "serves at most top.num_blocks blocks (here 4 of 10, all stored, from CPU); fix: load and gather "
                   "in chunks of the top pool")
def test_hf_after_request_stores_a_request_longer_than_the_gpu_pool(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=4, cpu=64), emulate_gpu=True))
    ids = _prompt(10 * HF_BLOCK + 3, seed=5)
    cold, _ = _generate(llama, ids, conn)
    assert conn.store.lookup(conn.block_hashes(ids[0])).num_hit_blocks == 10
    warm, plan = _generate(llama, ids, conn)
    assert plan.num_cached_tokens == 10 * HF_BLOCK and warm == cold


def test_hf_after_request_with_a_grad_cache_keeps_the_pool_out_of_autograd(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=8)))
    ids = _prompt(40, seed=6)
    out = llama(ids, use_cache=True)  # no torch.no_grad(): K/V require grad
    cache = getattr(out, "cache", None) or out.past_key_values
    assert conn.after_request(ids[0], cache) == 2
    assert not conn.store.top.tensor.requires_grad and conn.store.top.tensor.grad_fn is None


def test_hf_prefill_counts_queried_and_hit_blocks_once_regression_m1(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=16)))
    ids = _prompt(5 * HF_BLOCK + 1, seed=7)
    _generate(llama, ids[:, : 2 * HF_BLOCK + 1], conn)  # blocks 0-1 cached
    before_lookups, before_hits = conn.store.stats.lookup_blocks, sum(conn.store.stats.hit_blocks.values())
    plan = conn.before_prefill(ids)
    assert plan.num_cached_tokens == 2 * HF_BLOCK
    assert conn.store.stats.lookup_blocks - before_lookups == 5
    assert sum(conn.store.stats.hit_blocks.values()) - before_hits == 2


def _served_vs_own_keys(llama_a, llama_b, tmp_path, ids) -> tuple[int, float]:
    """Store ``ids`` through model A, then prefill model B from the same data_dir; returns
    (cached tokens served to B, max |served K - B's own K|) over every layer."""
    config = _hf_config(tmp_path, llama_a, gpu=64, disk_bytes=32 << 20)
    first = _connector(llama_a, config)
    try:
        _generate(llama_a, ids, first)
    finally:
        first.close()
    second = _connector(llama_b, config)
    try:
        plan = second.before_prefill(ids)
        n = plan.num_cached_tokens
        if n == 0:
            return 0, 0.0
        with torch.inference_mode():
            out = llama_b(ids, use_cache=True)
        own = getattr(out, "cache", None) or out.past_key_values
        from kvtier.connectors.hf import _cache_layers

        served_keys, _ = _cache_layers(plan.cache)
        own_keys, _ = _cache_layers(own)
        diff = max((s - o[:, :, :n]).abs().max().item() for s, o in zip(served_keys, own_keys))
        return n, diff
    finally:
        second.close()


def test_hf_checkpoints_differing_in_unsampled_weights_do_not_share_blocks(llama, tmp_path):
    import copy

    edited = copy.deepcopy(llama)
    with torch.no_grad():  # row 201 of the 256x64 embedding holds no sampled element
        edited.model.embed_tokens.weight[201] = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    ids = _prompt(50, seed=3)
    ids[0, 5] = 201
    n, diff = _served_vs_own_keys(llama, edited, tmp_path, ids)
    assert n == 0 or diff <= 1e-5, f"{n} cached tokens served with K off by {diff:.3f}"


def test_hf_same_weights_with_another_rope_config_do_not_share_blocks(llama, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=500.0,
    )
    other = transformers.LlamaForCausalLM(cfg).eval()
    other.load_state_dict(llama.state_dict())
    n, diff = _served_vs_own_keys(llama, other, tmp_path, _prompt(50, seed=3))
    assert n == 0 or diff <= 1e-5, f"{n} cached tokens served with K off by {diff:.3f}"


def test_hf_turns_with_a_full_lmdb_map_match_cold_output_and_never_raise_regression_d3(
    llama, tmp_path, connectors, caplog
):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=2, disk_bytes=32 << 20)))
    first = _prompt(40, seed=11)
    _generate(llama, first, conn)
    _generate(llama, _prompt(40, seed=12), conn)  # pushes `first` down to DISK
    assert conn.store.medium_of(conn.block_hashes(first[0])[0]) is Medium.DISK
    env = conn.store.disk.env
    env.set_mapsize((env.info()["last_pgno"] + 4) * conn.store.disk.page_nbytes)  # the map is now full
    history = _prompt(40, seed=13)
    for turn in range(3):  # every turn spills; the writes find no room
        cold, _ = _generate(llama, history)
        warm, _ = _generate(llama, history, conn)
        assert warm == cold, f"turn {turn}"
        history = torch.cat([history, torch.tensor([cold]), _prompt(19, seed=20 + turn)], dim=1)
    cold, _ = _generate(llama, first)
    warm, plan = _generate(llama, first, conn)
    assert plan.num_cached_tokens == 32 and warm == cold  # written before the map filled: still read
    assert any("DISK write" in r.getMessage() for r in caplog.records), "the map never filled: nothing tested"
    conn.store.check_invariants()
