"""The HF connector's DISK hit read straight into its hit buffer (``TieredStore.prefetch``'s
``sinks``, ``DiskTier.read_into_views``): every block verified before it is served, a failed
one ending the prefix, the blocks still promoted into the top pool (published by
``finish_loads`` or the next hook), and hits on several threads at once exact."""

from __future__ import annotations

import threading

import lmdb
import numpy as np
import pytest
import torch

from kvtier.connectors import hf
from kvtier import records
from kvtier.kernels import host_copy
from kvtier.records import HEADER_NBYTES, BlockPlaces, ReadStatus, decode_into_places, decode_into_view, encode_record
from kvtier.store import prefetch
from kvtier.types import Medium
from tests.conftest import flip_byte, patch_record
from tests.unit.connectors.test_hf_layout import BLOCK, assert_exact, config, connector, prompt, store_prompt

NS = b"n" * 32


def on_disk(model, tmp_path, ids, head_major=True, **kwargs):
    """A connector whose store holds ``ids``'s blocks on DISK only (stored, closed, reopened)."""
    cfg = config(tmp_path)
    kv = connector(model, cfg, head_major)
    store_prompt(kv, model, ids)
    kv.close()
    return connector(model, cfg, head_major, **kwargs)


def gathered(monkeypatch) -> list[list[int]]:
    """Request positions the connector gathers from the top pool (hf.gather_into), per call."""
    calls: list[list[int]] = []
    real = hf.gather_into

    def spy(spec, pool, out, block_ids, indices):
        calls.append(list(indices))
        real(spec, pool, out, block_ids, indices)

    monkeypatch.setattr(hf, "gather_into", spy)
    return calls


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("job_nbytes", [1, 8 << 20], ids=["one block a job", "one job"])
def test_a_disk_hit_is_read_into_the_hit_buffer_bit_for_bit_and_promoted(model, tmp_path, monkeypatch, head_major,
                                                                         job_nbytes):
    monkeypatch.setattr(prefetch, "_DISK_JOB_NBYTES", job_nbytes)
    monkeypatch.setattr(prefetch, "_SINK_JOB_NBYTES", job_nbytes)  # reads into the hit buffer too
    ids = prompt(6 * BLOCK + 5, seed=11)
    kv = on_disk(model, tmp_path, ids, head_major)
    calls = gathered(monkeypatch)
    plan = kv.before_prefill(ids)
    assert_exact(plan, model, ids, 6 * BLOCK)
    assert plan.sources == [Medium.DISK] * 6 and calls == []  # nothing gathered from the pool
    kv.finish_loads()  # the copies into the top pool: published now
    store, hashes = kv.store, kv.block_hashes(ids[0])
    assert [store.placement.medium_of(h) for h in hashes[:6]] == [Medium.CPU] * 6
    assert store.stats.loaded_blocks[Medium.DISK] == 6 and not store.stats.load_failures
    del plan  # the hit buffer is free again
    again = kv.before_prefill(ids)  # now from the CPU pool, gathered
    assert_exact(again, model, ids, 6 * BLOCK) and again.sources == [Medium.CPU] * 6
    assert sorted(i for c in calls for i in c) == list(range(6))
    kv.close()


@pytest.mark.parametrize("job_nbytes", [1, 8 << 20], ids=["one block a job", "one job"])
@pytest.mark.parametrize("damage", ["corrupt", "missing", "token_mismatch"])
def test_a_bad_record_mid_chain_ends_the_prefix_and_nothing_after_it_is_served(model, tmp_path, monkeypatch,
                                                                              job_nbytes, damage):
    monkeypatch.setattr(prefetch, "_DISK_JOB_NBYTES", job_nbytes)
    monkeypatch.setattr(prefetch, "_SINK_JOB_NBYTES", job_nbytes)  # reads into the hit buffer too
    ids = prompt(6 * BLOCK + 1, seed=12)
    cfg = config(tmp_path)
    kv = connector(model, cfg)
    store_prompt(kv, model, ids)
    hashes = kv.block_hashes(ids[0])
    kv.close()
    if damage == "missing":  # gone behind the open store's index's back
        kv = connector(model, cfg)
        with kv.store.disk.env.begin(write=True) as txn:
            txn.delete(hashes[3])
    else:
        env = lmdb.open(str(tmp_path / "disk"))
        txn = env.begin(write=True)
        if damage == "corrupt":  # one payload byte of block 3
            patch_record(txn, hashes[3], flip_byte(-5, 0x10))
        else:  # an intact record of other tokens: another fingerprint (and the checksum to match)
            value = bytes(txn.get(hashes[3]))
            block = torch.tensor(np.frombuffer(value, dtype=np.float32, offset=HEADER_NBYTES))
            shape = tuple(int(x) for x in np.frombuffer(value[8:40], dtype="<u4")[: value[7]])
            txn.put(hashes[3], encode_record(value[40:72], block.view(shape), 0, b"x" * 32).tobytes())
        txn.commit()
        env.close()
        kv = connector(model, cfg)
    plan = kv.before_prefill(ids)
    assert_exact(plan, model, ids, 3 * BLOCK)
    assert plan.sources == [Medium.DISK] * 3
    kv.finish_loads()
    store = kv.store
    assert store.stats.load_failures[damage] == 1 and store.stats.loaded_blocks[Medium.DISK] == 3, store.stats.load_failures
    held = [store.placement.medium_of(h) for h in hashes[:6]]
    assert held[:3] == [Medium.CPU] * 3  # promoted
    assert held[3] == (Medium.DISK if damage == "token_mismatch" else None)  # a corrupt or missing record is dropped
    if damage == "token_mismatch":  # found at planning (the index keeps the record's fingerprint): not read
        assert held[4:] == [Medium.DISK] * 2
    else:  # read and kept in the top pool (as any load does), never served
        assert held[4:] == [Medium.CPU] * 2
    kv.close()


def test_a_failing_read_fails_its_blocks_and_never_hangs_the_hit(model, tmp_path, monkeypatch):
    ids = prompt(4 * BLOCK + 1, seed=13)
    kv = on_disk(model, tmp_path, ids)

    def broken(*args, **kwargs):
        raise OSError("EIO")

    monkeypatch.setattr(kv.store.disk, "read_into_views", broken)
    plan = kv.before_prefill(ids)
    assert plan.num_cached_tokens == 0 and plan.sources == []
    kv.finish_loads()
    assert kv.store.stats.load_failures["error"] == 4
    kv.close()


def test_a_mixed_prefix_gathers_the_pool_blocks_and_reads_the_disk_ones(model, tmp_path, monkeypatch):
    ids = prompt(6 * BLOCK + 1, seed=14)
    kv = on_disk(model, tmp_path, ids)
    head = kv.before_prefill(ids[:, : 2 * BLOCK + 1])  # blocks 0-1 into the CPU pool
    assert head.sources == [Medium.DISK] * 2
    del head
    calls = gathered(monkeypatch)
    plan = kv.before_prefill(ids)
    assert_exact(plan, model, ids, 6 * BLOCK)
    assert plan.sources == [Medium.CPU] * 2 + [Medium.DISK] * 4
    assert sorted(i for c in calls for i in c) == [0, 1]  # only the pool's blocks were gathered
    kv.close()


def test_after_request_right_after_a_disk_hit_stores_the_new_blocks(model, tmp_path):
    """The hit's blocks are still pending in the top pool until published: after_request
    publishes them first, so its store does not stop at them."""
    ids = prompt(4 * BLOCK + 1, seed=15)
    kv = on_disk(model, tmp_path, ids)
    longer = torch.cat([ids, prompt(3 * BLOCK, seed=16)], dim=1)
    plan = kv.before_prefill(longer)
    assert plan.num_cached_tokens == 4 * BLOCK
    with torch.inference_mode():
        out = model(longer[:, 4 * BLOCK :], use_cache=True, **plan.generate_kwargs())
    cache = getattr(out, "cache", None) or out.past_key_values
    assert kv.after_request(longer[0], cache) == 7
    assert kv.store.lookup(kv.block_hashes(longer[0])).num_hit_blocks == 7
    kv.close()


def test_hits_on_several_threads_at_once_are_exact(model, tmp_path):
    """Two threads hit (the same prompt and another) on one connector at once, from DISK and
    then from CPU: one gets the kept buffer, the other tensors of its own; each hit's K/V
    are the model's own."""
    a, b = prompt(5 * BLOCK + 1, seed=17), prompt(4 * BLOCK + 1, seed=18)
    cfg = config(tmp_path, cpu_bytes=16 << 20)
    kv = connector(model, cfg)
    store_prompt(kv, model, a)
    store_prompt(kv, model, b)
    kv.close()
    kv = connector(model, cfg)
    errors: list[BaseException] = []
    for rounds in range(3):
        barrier = threading.Barrier(3)

        def hit(ids, n):
            try:
                barrier.wait()
                plan = kv.before_prefill(ids)  # 0 while the other thread's load of it is in flight
                if plan.num_cached_tokens:
                    assert_exact(plan, model, ids, n)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=hit, args=args) for args in ((a, 5 * BLOCK), (a, 5 * BLOCK), (b, 4 * BLOCK))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    kv.finish_loads()
    assert_exact(kv.before_prefill(a), model, a, 5 * BLOCK)
    kv.close()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "a block of a larger buffer"])
def test_decode_into_view_gives_the_record_bytes_or_refuses(strided):
    block = torch.randn(3, 2, 2, BLOCK, 16)
    record = memoryview(encode_record(NS, block, 1, b"f" * 32).tobytes())
    big = torch.zeros(3, 2, 2, 4 * BLOCK, 16)
    out = big[:, :, :, BLOCK : 2 * BLOCK] if strided else torch.zeros_like(block)
    assert decode_into_view(record, NS, out, b"f" * 32) is ReadStatus.OK and torch.equal(out, block)
    if strided:
        assert torch.count_nonzero(big[:, :, :, :BLOCK]) == 0 and torch.count_nonzero(big[:, :, :, 2 * BLOCK :]) == 0
    damaged = bytearray(record)
    damaged[-3] ^= 1
    assert decode_into_view(memoryview(bytes(damaged)), NS, out) is ReadStatus.CORRUPT
    assert decode_into_view(record, b"m" * 32, out) is ReadStatus.CORRUPT  # another namespace
    assert decode_into_view(record, NS, out, b"g" * 32) is ReadStatus.TOKEN_MISMATCH
    assert decode_into_view(record, NS, torch.zeros(3, 2, 2, BLOCK, 8)) is ReadStatus.CORRUPT  # another shape
    assert decode_into_view(memoryview(bytes(record)[:200]), NS, out) is ReadStatus.CORRUPT  # cut short


def _fused() -> bool:
    """The compiled kernels load here and hash with python-xxhash's exported xxh3."""
    return host_copy.library() is not None and host_copy._hashing


def _into_pool(kv, places) -> bool:
    """A DISK read into the top pool's slots (a promotion), not into the hit buffer (a delivery)."""
    pool = kv.store.top.tensor.untyped_storage().data_ptr()
    return isinstance(places, BlockPlaces) and places.first.untyped_storage().data_ptr() == pool


class _Timeline:
    """Spies on the DISK tier: when each delivery (``read_into_views``) ran and when each
    promotion (``read_into``, the second read into a top-pool slot) started; ``hold`` keeps
    the delivery of the job whose first block it names waiting until released."""

    def __init__(self, monkeypatch, kv, hold=None) -> None:
        import time

        disk = kv.store.disk
        self.events: list[tuple[str, float]] = []
        self.release = threading.Event()
        real_views, real_into = disk.read_into_views, disk.read_into

        def views(block_hashes, namespace, places, *args, **kwargs):
            if _into_pool(kv, places):  # promotions of several blocks: one call into the pool's slots
                self.events.extend(("promoting", time.perf_counter()) for _ in block_hashes)
                return real_views(block_hashes, namespace, places, *args, **kwargs)
            if hold is not None and block_hashes[0] == hold:
                self.release.wait(10)
            out = real_views(block_hashes, namespace, places, *args, **kwargs)
            self.events.append(("delivered", time.perf_counter()))
            return out

        def into(*args, **kwargs):
            self.events.append(("promoting", time.perf_counter()))
            return real_into(*args, **kwargs)

        monkeypatch.setattr(disk, "read_into_views", views)
        monkeypatch.setattr(disk, "read_into", into)

    def promotions_after_deliveries(self) -> bool:
        last_delivery = max(t for kind, t in self.events if kind == "delivered")
        return all(t >= last_delivery for kind, t in self.events if kind == "promoting")


def test_the_promotions_start_only_after_the_last_delivery_of_the_prefix(model, tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "_DISK_JOB_NBYTES", 1)  # one job per block: 6 jobs on 2 I/O threads
    monkeypatch.setattr(prefetch, "_SINK_JOB_NBYTES", 1)  # reads into the hit buffer too
    ids = prompt(6 * BLOCK + 3, seed=31)
    kv = on_disk(model, tmp_path, ids)
    hashes = kv.block_hashes(ids[0])
    timeline = _Timeline(monkeypatch, kv, hold=hashes[0])  # the first job delivers last
    threading.Timer(0.3, timeline.release.set).start()
    plan = kv.before_prefill(ids)
    assert_exact(plan, model, ids, 6 * BLOCK)
    kv.finish_loads()
    kinds = [kind for kind, _ in timeline.events]
    assert kinds.count("delivered") == 6 and kinds.count("promoting") == 6
    assert timeline.promotions_after_deliveries(), timeline.events
    assert [kv.store.placement.medium_of(h) for h in hashes[:6]] == [Medium.CPU] * 6
    kv.close()


@pytest.mark.parametrize("then", ["reset", "close"])
def test_a_reset_or_close_while_the_promotions_run_loses_nothing_and_never_hangs(model, tmp_path, monkeypatch, then):
    monkeypatch.setattr(prefetch, "_DISK_JOB_NBYTES", 1)
    monkeypatch.setattr(prefetch, "_SINK_JOB_NBYTES", 1)  # reads into the hit buffer too
    ids = prompt(4 * BLOCK + 3, seed=32)
    kv = on_disk(model, tmp_path, ids)
    disk, release, started = kv.store.disk, threading.Event(), threading.Event()
    real_into = disk.read_into

    def slow_promotion(*args, **kwargs):  # the promotions wait until released
        started.set()
        release.wait(10)
        return real_into(*args, **kwargs)

    monkeypatch.setattr(disk, "read_into", slow_promotion)
    plan = kv.before_prefill(ids)  # returns on the deliveries; the promotions are held
    assert_exact(plan, model, ids, 4 * BLOCK)
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    store = kv.store
    if then == "reset":
        kv.reset()  # publishes the load first (waits for the promotions), then empties every tier
        assert release.is_set()
        with store.residency.lock:
            store.residency.drain()
            store.residency.check()  # nothing left pending
        for pool in store.pools:
            pool.check()
        del plan
        assert kv.before_prefill(ids).num_cached_tokens == 0  # the reset emptied every tier
        kv.close()
    else:
        kv.close()  # publishes the load (waits for the promotions), flushes, closes
        assert release.is_set()
        again = connector(model, config(tmp_path), True)
        del plan
        assert_exact(again.before_prefill(ids), model, ids, 4 * BLOCK)  # every block still on DISK
        again.close()


def test_a_job_that_fails_to_start_opens_the_gate_for_the_others(model, tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "_DISK_JOB_NBYTES", 1)
    monkeypatch.setattr(prefetch, "_SINK_JOB_NBYTES", 1)  # reads into the hit buffer too
    ids = prompt(4 * BLOCK + 3, seed=33)
    kv = on_disk(model, tmp_path, ids)
    engine = kv.store._prefetcher.engine
    real_submit, submitted = engine.submit, []

    def submit(job):
        submitted.append(job)
        if len(submitted) == 3:
            raise KeyError("no handler")  # the third DISK job never starts
        return real_submit(job)

    monkeypatch.setattr(engine, "submit", submit)
    with pytest.raises(KeyError):
        kv.before_prefill(ids)
    monkeypatch.setattr(engine, "submit", real_submit)
    kv.close()  # the first two jobs' promotions ran (the gate opened): close does not hang
    assert all(job.delivery is not None and job.delivery.ok for job in submitted[:2])


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_decode_into_view_of_a_block_larger_than_l2_checks_every_byte(where):
    """A block of 720 KiB (hashed whole, then copied whole: no chunk of it skips the
    check): one flipped payload byte anywhere is CORRUPT; intact, the strided place in the
    larger buffer gets the block bit for bit and nothing around it changes."""
    block = torch.randn(30, 2, 3, 16, 64)  # 720 KiB of float32: more than a 512 KiB chunk
    record = memoryview(encode_record(NS, block, 1, b"f" * 32).tobytes())
    big = torch.zeros(30, 2, 3, 48, 64)
    out = big[:, :, :, 16:32]
    assert decode_into_view(record, NS, out, b"f" * 32) is ReadStatus.OK and torch.equal(out, block)
    assert torch.count_nonzero(big[:, :, :, :16]) == 0 and torch.count_nonzero(big[:, :, :, 32:]) == 0
    payload = len(record) - HEADER_NBYTES
    at = HEADER_NBYTES + {"first": 0, "middle": payload // 2 + 5, "last": payload - 1}[where]
    damaged = bytearray(record)
    damaged[at] ^= 0x10
    assert decode_into_view(memoryview(bytes(damaged)), NS, out, b"f" * 32) is ReadStatus.CORRUPT


def test_a_hits_promotions_run_after_every_delivery_one_after_another_on_one_thread(model, tmp_path, monkeypatch):
    """The DeliveryGate's held promotions (reads into the top pool) go to the I/O pool as one
    task once every block is delivered, and run there one after another: never on both I/O
    threads at once while the caller finishes the hit (each promotion here takes 20 ms, so
    promotions submitted one by one would spread over both threads); every block still lands,
    verified, in the top pool."""
    import time

    from kvtier.tiers.disk import DiskTier

    monkeypatch.setattr(prefetch, "_DISK_JOB_NBYTES", 1)  # one block a job: six jobs over two threads
    monkeypatch.setattr(prefetch, "_SINK_JOB_NBYTES", 1)  # reads into the hit buffer too
    ids = prompt(6 * BLOCK + 2, seed=34)
    kv = on_disk(model, tmp_path, ids)
    events: list[tuple[str, str, bytes]] = []
    real_views, real_into = DiskTier.read_into_views, DiskTier.read_into

    def views(self, hashes, *a, **k):
        result = real_views(self, hashes, *a, **k)
        events.extend(("deliver", threading.current_thread().name, h) for h in hashes)
        return result

    def into(self, h, *a, **k):
        events.append(("promote", threading.current_thread().name, h))
        time.sleep(0.02)
        return real_into(self, h, *a, **k)

    monkeypatch.setattr(DiskTier, "read_into_views", views)
    monkeypatch.setattr(DiskTier, "read_into", into)
    plan = kv.before_prefill(ids)
    assert_exact(plan, model, ids, 6 * BLOCK)
    kv.finish_loads()
    hashes = kv.block_hashes(ids[0])[:6]
    delivered = [e for e in events if e[0] == "deliver"]
    promoted = [e for e in events if e[0] == "promote"]
    assert sorted(h for *_, h in delivered) == sorted(hashes) and sorted(h for *_, h in promoted) == sorted(hashes)
    assert events.index(promoted[0]) > max(events.index(e) for e in delivered)  # after every delivery
    assert len({t for _, t, _ in promoted}) == 1  # one after another, on one thread
    assert [kv.store.placement.medium_of(h) for h in hashes] == [Medium.CPU] * 6
    del plan
    kv.close()


def test_reads_into_the_hit_buffer_run_as_one_job_per_io_thread(model, tmp_path, monkeypatch):
    # nothing is gathered as such a job lands: one run of the prefix per I/O thread, whatever the
    # job size for reads into the pool (_DISK_JOB_NBYTES), so the first read starts early
    monkeypatch.setattr(prefetch, "_DISK_JOB_NBYTES", 1)
    ids = prompt(6 * BLOCK + 3, seed=33)
    kv = on_disk(model, tmp_path, ids)
    disk, runs = kv.store.disk, []
    real_views = disk.read_into_views

    def views(block_hashes, namespace, places, *args, **kwargs):
        if not _into_pool(kv, places):  # the promotions of several blocks read into the pool the same way
            runs.append(len(block_hashes))
        return real_views(block_hashes, namespace, places, *args, **kwargs)

    monkeypatch.setattr(disk, "read_into_views", views)
    plan = kv.before_prefill(ids)
    assert_exact(plan, model, ids, 6 * BLOCK)
    assert plan.sources == [Medium.DISK] * 6
    threads = kv.store.config.num_io_threads
    assert len(runs) == min(6, threads) and sum(runs) == 6 and max(runs) - min(runs) <= 1
    kv.finish_loads()
    kv.close()


@pytest.mark.parametrize("kernels", ["one call", "per block (python-xxhash)", "numpy"])
def test_decode_into_places_gives_each_record_its_bytes_or_its_status(request, monkeypatch, kernels):
    # the batch path (every intact-looking record hashed and copied in one kernel call) and the
    # per-block fallbacks give each place the same bytes and each block the same status
    if kernels == "numpy":
        monkeypatch.setattr(host_copy, "_library", None)
        monkeypatch.setattr(host_copy, "_loaded", True)
    elif kernels == "per block (python-xxhash)":
        monkeypatch.setattr(host_copy, "_hashing", False)
    elif not _fused():
        pytest.skip("no compiled kernels or no exported xxh3 here")
    monkeypatch.setattr(host_copy, "STREAMING_MIN_NBYTES", 0)
    blocks = [torch.randn(3, 2, 2, BLOCK, 16) for _ in range(6)]
    values = [memoryview(encode_record(NS, b, 1, b"f" * 32).tobytes()) for b in blocks]
    damaged = bytearray(values[2])
    damaged[HEADER_NBYTES + 7] ^= 1
    values[2] = memoryview(bytes(damaged))  # corrupt
    values[3] = None  # missing
    values[4] = memoryview(encode_record(b"m" * 32, blocks[4], 1, b"f" * 32).tobytes())  # another namespace
    fingerprints = [b"f" * 32] * 6
    fingerprints[5] = b"g" * 32  # intact, other tokens
    big = torch.zeros(3, 2, 2, 7 * BLOCK, 16)
    first = big[:, :, :, :BLOCK]
    places = BlockPlaces(first, BLOCK * 16, [6, 0, 1, 2, 3, 4])  # place k of block k: out of order
    statuses = decode_into_places(values, NS, places, fingerprints)
    assert statuses == [ReadStatus.OK, ReadStatus.OK, ReadStatus.CORRUPT, ReadStatus.MISSING, ReadStatus.CORRUPT,
                        ReadStatus.TOKEN_MISMATCH]
    assert torch.equal(big[:, :, :, 6 * BLOCK :], blocks[0]) and torch.equal(big[:, :, :, :BLOCK], blocks[1])
    assert torch.count_nonzero(big[:, :, :, 3 * BLOCK : 4 * BLOCK]) == 0  # the missing block's place: untouched
    assert torch.count_nonzero(big[:, :, :, 5 * BLOCK : 6 * BLOCK]) == 0  # nobody's place


def test_block_places_refuse_places_outside_their_buffer_and_bad_steps():
    big = torch.zeros(3, 2, 2, 4 * BLOCK, 16)
    first = big[:, :, :, :BLOCK]
    assert len(BlockPlaces(first, BLOCK * 16, range(4))) == 4
    with pytest.raises(ValueError, match="storage"):
        BlockPlaces(first, BLOCK * 16, range(5))  # the fifth place is past the buffer
    for step in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="step"):
            BlockPlaces(first, step, range(2))
    for positions in ([-1], [0.5], [True]):
        with pytest.raises(ValueError, match="positions"):
            BlockPlaces(first, BLOCK * 16, positions)
    with pytest.raises(ValueError, match="CPU"):
        BlockPlaces(torch.zeros(3, 2, 2, BLOCK, 16, device="meta"), BLOCK * 16, [0])
    with pytest.raises(ValueError, match="one place"):
        decode_into_places([None, None], NS, BlockPlaces(first, BLOCK * 16, [0]), [None, None])



def test_block_places_refuse_places_that_share_bytes_or_a_strided_last_dimension():
    # from a hostile review: two blocks aimed at one place, or places a step shorter than a
    # block apart, let a block reported OK hold another record's bytes
    big = torch.zeros(3, 2, 2, 4 * BLOCK, 16)
    first = big[:, :, :, :BLOCK]
    with pytest.raises(ValueError, match="distinct"):
        BlockPlaces(first, BLOCK * 16, [1, 1])
    with pytest.raises(ValueError, match="do not overlap"):
        BlockPlaces(first, 16, [0, 1])  # one token apart: each place's rows overlap the next's
    flat = torch.zeros(10, 4)
    with pytest.raises(ValueError, match="do not overlap"):
        BlockPlaces(flat[0], 1, [0, 1])
    assert len(BlockPlaces(flat[0], 4, [0, 3, 9])) == 3  # whole blocks apart
    assert len(BlockPlaces(first, BLOCK * 16, np.arange(4))) == 4  # numpy positions: ints too
    with pytest.raises(ValueError, match="last dimension"):
        BlockPlaces(torch.zeros(4, 3, 5)[0].t(), 15, [1])


def test_a_negated_view_does_not_take_the_kernel_from_places_of_its_layout(monkeypatch):
    # plans are cached per layout: one made for a negated view (no row layout) must not be the
    # plan of a plain tensor of the same dtype, shape and strides
    if not _fused():
        pytest.skip("no compiled kernels or no exported xxh3 here")
    calls = []
    real = host_copy.hash_copy_blocks
    monkeypatch.setattr(host_copy, "hash_copy_blocks", lambda *a: calls.append(1) or real(*a))
    block = torch.randn(3, 2, 2, BLOCK, 16)
    record = memoryview(encode_record(NS, block, 1).tobytes())
    big = torch.zeros(3, 2, 2, 2 * BLOCK, 16)
    records._view_plan(torch.zeros_like(big)._neg_view()[:, :, :, :BLOCK])  # what a decode into it plans first
    assert decode_into_places([record], NS, BlockPlaces(big[:, :, :, :BLOCK], BLOCK * 16, [1]), [None]) == [ReadStatus.OK]
    assert calls == [1] and torch.equal(big[:, :, :, BLOCK:], block)
