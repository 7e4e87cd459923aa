"""DISK writes overlapped with the tier's writer thread (kvtier.tiers.disk._WriteOverlap):
the victims' hashes and the caller's ``after_put`` copies run there while LMDB copies the
next block on the caller's thread. The records must be the bytes one thread writes, the
hashes must follow the sequence each put really got, and every ``after_put`` must be done,
in order, before ``write_batch`` returns."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
import torch

from kvtier.records import encode_record
from kvtier.tiers import disk as disk_module
from kvtier.tiers.disk import DiskTier, ReadStatus, record_footprint
from kvtier.tiers.pool import BlockPool
from tests.conftest import NS, filled_pool, map_full_at, random_blocks, tiny_spec

SPEC = tiny_spec()


def _hash(i: int) -> bytes:
    return hashlib.sha256(b"overlap %d" % i).digest()


def _pool(n: int, seed: int = 0) -> BlockPool:
    return filled_pool(n, SPEC, seed)


@pytest.fixture
def overlapped(monkeypatch):
    monkeypatch.setattr(disk_module, "OVERLAP_MIN_NBYTES", 0)


def _stored(tier: DiskTier, hashes) -> list[bytes | None]:
    with tier.env.begin() as txn:
        return [txn.get(h) for h in hashes]


def test_overlapped_batch_stores_the_same_bytes_as_one_thread(tmp_path, monkeypatch):
    pool = _pool(6)
    puts = [(_hash(i), NS, pool.tensor[i], hashlib.sha256(b"fp %d" % i).digest()) for i in range(6)]
    stored = {}
    for mode, threshold in [("serial", 1 << 62), ("overlap", 0)]:
        monkeypatch.setattr(disk_module, "OVERLAP_MIN_NBYTES", threshold)
        tier = DiskTier(tmp_path / mode, 1 << 20)
        assert tier.write_batch(puts) == [True] * 6
        stored[mode] = _stored(tier, [p[0] for p in puts])
        assert (tier._writer is not None) == (mode == "overlap")  # the overlap did run
        tier.close()
    assert stored["serial"] == stored["overlap"]
    assert stored["overlap"] == [encode_record(NS, p[2], seq, p[3]).tobytes() for seq, p in enumerate(puts, 1)]


def test_after_put_runs_on_the_writer_thread_in_order_and_is_done_on_return(tmp_path, overlapped):
    pool = _pool(8)
    tier = DiskTier(tmp_path, 1 << 20)
    calls: list[tuple[int, str]] = []
    done = threading.Event()

    def after_put(i: int) -> None:
        calls.append((i, threading.current_thread().name))
        if i == 7:
            done.set()

    assert tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(8)], after_put=after_put) == [True] * 8
    assert done.is_set()  # no call left running after the return
    assert [i for i, _ in calls] == list(range(8))
    assert all(name.startswith("kvtier-disk-write") for _, name in calls)
    tier.close()


def test_after_put_keeps_the_callers_grad_mode(tmp_path, overlapped):
    pool = _pool(3)
    tier = DiskTier(tmp_path, 1 << 20)
    modes = []
    with torch.no_grad():
        tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(3)],
                         after_put=lambda i: modes.append(torch.is_grad_enabled()))
    with torch.inference_mode():
        tier.write_batch([(_hash(10 + i), NS, pool.tensor[i]) for i in range(3)],
                         after_put=lambda i: modes.append(torch.is_inference_mode_enabled()))
    assert modes == [False] * 3 + [True] * 3
    tier.close()


def test_a_put_refused_for_room_mid_batch_rehashes_the_later_headers(tmp_path, overlapped):
    """Headers are hashed ahead with the sequence each put would get; when one is refused
    (no room) the later ones get other sequences and must be hashed again."""
    small = _pool(4)
    big = torch.cat([torch.zeros(32, dtype=SPEC.dtype), random_blocks(SPEC, 64, seed=3).view(-1)])[32:]
    big = big.view(64, *SPEC.block_shape)  # 64 blocks as one (32 KiB), 128 B of its storage before it
    cap = 3 * record_footprint(SPEC.block_nbytes) + 4096
    tier = DiskTier(tmp_path, cap)
    puts = [(_hash(0), NS, small.tensor[0]), (_hash(1), NS, big), (_hash(2), NS, small.tensor[1]),
            (_hash(3), NS, small.tensor[2])]
    assert tier.write_batch(puts) == [True, False, True, True]
    assert _stored(tier, [_hash(0), _hash(2), _hash(3)]) == [
        encode_record(NS, small.tensor[i], seq).tobytes() for i, seq in [(0, 1), (1, 2), (2, 3)]
    ]
    out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
    assert tier.read_into(_hash(3), NS, out) is ReadStatus.OK and torch.equal(out, small.tensor[2])
    tier.check()
    tier.close()


@pytest.mark.parametrize("exc", [RuntimeError("copy failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_an_after_put_that_raises_aborts_the_batch_as_on_one_thread(tmp_path, overlapped, exc):
    pool = _pool(5)
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.write_batch([(_hash(100), NS, pool.tensor[4])]) == [True]  # stored before: must stay

    def after_put(i: int) -> None:
        if i == 2:
            raise exc

    with pytest.raises(type(exc)):
        tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(4)], after_put=after_put)
    assert _stored(tier, [_hash(i) for i in range(4)]) == [None] * 4  # the transaction was aborted
    assert len(tier) == 1 and _hash(100) in tier
    tier.check()
    # the tier keeps working: the writer thread survived
    assert tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(4)]) == [True] * 4
    tier.check()
    tier.close()


def test_close_stops_the_writer_thread(tmp_path, overlapped):
    pool = _pool(2)
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(2)])
    writer = tier._writer
    assert writer is not None
    tier.close()
    assert tier._writer is None
    with pytest.raises(RuntimeError):  # shut down: it takes no more work
        writer.submit(int)


def test_after_puts_are_done_in_order_on_return_even_when_slow(tmp_path, overlapped):
    """Slow callbacks, the first the slowest: a second writer thread or a return before they
    finish would show here."""
    import time

    pool = _pool(5)
    tier = DiskTier(tmp_path, 1 << 20)
    calls: list[int] = []

    def after_put(i: int) -> None:
        time.sleep(0.002 * (5 - i))
        calls.append(i)

    assert tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(5)], after_put=after_put) == [True] * 5
    assert calls == [0, 1, 2, 3, 4]
    tier.close()


def test_a_failed_put_returns_only_after_the_copy_ins_already_started(tmp_path, overlapped, monkeypatch):
    """LMDB's map full at the 4th put: the batch fails, and the callbacks of the three puts
    before it are done when write_batch returns (the caller frees their slots next)."""
    import time

    pool = _pool(6)
    tier = DiskTier(tmp_path, 1 << 20)
    puts = map_full_at(monkeypatch, 4)
    calls: list[int] = []

    def after_put(i: int) -> None:
        time.sleep(0.01)
        calls.append(i)

    assert tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(6)], after_put=after_put) == [False] * 6
    assert calls == [0, 1, 2] and len(puts) == 4
    assert len(tier) == 0
    tier.check()
    tier.close()


def test_real_sized_blocks_overlap_and_small_or_single_ones_do_not(tmp_path):
    """The shipped threshold (no fixture): a batch of two 1 MiB blocks takes the writer thread,
    a batch with a block under the threshold or of one block does not; the records are exact."""
    assert 1 << 20 >= disk_module.OVERLAP_MIN_NBYTES > _pool(1).tensor[0].numel() * 4
    data = torch.randn(3, (1 << 20) // 4)  # three blocks of 1 MiB (float32), any shape will do
    slab = torch.cat([torch.zeros(32), data.view(-1)])[32:].view(3, -1)  # 128 B before the first's storage
    tier = DiskTier(tmp_path, 16 << 20)
    assert tier.write_batch([(_hash(0), NS, slab[0])]) == [True]  # one block
    small = _pool(2)
    assert tier.write_batch([(_hash(1), NS, slab[1]), (_hash(2), NS, small.tensor[0])]) == [True, True]  # one small
    assert tier._writer is None
    assert tier.write_batch([(_hash(3), NS, slab[2]), (_hash(4), NS, slab[0])]) == [True, True]
    assert tier._writer is not None
    assert _stored(tier, [_hash(3), _hash(4)]) == [encode_record(NS, slab[2], 4).tobytes(),
                                                   encode_record(NS, slab[0], 5).tobytes()]
    tier.check()
    tier.close()


def test_a_batch_written_while_the_interpreter_shuts_down_still_lands(tmp_path, overlapped, monkeypatch):
    """concurrent.futures refuses new work once the interpreter starts shutting down, before
    atexit handlers run (a store closed from one flushes its memory to DISK): the batch goes
    on on the caller's thread, every record exact, every after_put called in order."""
    import concurrent.futures.thread as cf_thread

    pool = _pool(4)
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(2)]) == [True] * 2  # the writer exists
    monkeypatch.setattr(cf_thread, "_shutdown", True)
    calls: list[tuple[int, str]] = []
    puts = [(_hash(i), NS, pool.tensor[i]) for i in range(2, 4)] + [(_hash(9), NS, pool.tensor[0])]
    assert tier.write_batch(puts, after_put=lambda i: calls.append((i, threading.current_thread().name))) == [True] * 3
    assert [i for i, _ in calls] == [0, 1, 2] and {t for _, t in calls} == {threading.current_thread().name}
    assert _stored(tier, [_hash(2), _hash(3), _hash(9)]) == [
        encode_record(NS, pool.tensor[i], seq).tobytes() for i, seq in [(2, 3), (3, 4), (0, 5)]]
    tier.check()
    monkeypatch.setattr(cf_thread, "_shutdown", False)
    tier.close()


# -- headers written once their hash is done (issue 17: the caller never waits for a hash) --------
BIG = tiny_spec(block_size=64)  # 8 KiB blocks: values of more than a page, on LMDB's overflow pages


class _Choreography:
    """Makes the writer thread's hash of block ``held`` be running (started, not done) when
    the caller's put of it asks for its header, and keeps it running until the caller's put of
    block ``until`` returned: block ``held``'s header is deferred past later puts, and the
    hashes queued behind it (``held + 1`` .. ``until``) are not started when their puts end
    (taken back by the caller). ``fail``: the held hash raises once released. Records which
    puts left a header deferred (``deferred``: batch indices)."""

    def __init__(self, monkeypatch, blocks: torch.Tensor, held: int, until: int, fail: bool = False) -> None:
        self.deferred: list[int] = []
        self.started, self.released = threading.Event(), threading.Event()
        held_ptr, until_ptr = blocks[held].data_ptr(), blocks[until].data_ptr()
        real_header, real_put, real_overlap_put = disk_module.encode_header, disk_module.put_record, \
            disk_module._WriteOverlap.put
        choreo = self

        def encode_header(namespace, block, *args, **kwargs):
            if threading.current_thread().name.startswith("kvtier-disk-write") and block.data_ptr() == held_ptr:
                choreo.started.set()
                assert choreo.released.wait(5.0), "the caller never released the held hash"
                if fail:
                    raise RuntimeError("hash failed")
            return real_header(namespace, block, *args, **kwargs)

        def put_record(txn, key, namespace, block, *args, **kwargs):
            if block.data_ptr() == held_ptr:
                assert choreo.started.wait(5.0), "the writer never started the held hash"
            real_put(txn, key, namespace, block, *args, **kwargs)
            if block.data_ptr() == until_ptr:
                choreo.released.set()

        def overlap_put(self, txn, i, *args, **kwargs):
            last = self._deferred[-1] if self._deferred else None
            real_overlap_put(self, txn, i, *args, **kwargs)
            if self._deferred and self._deferred[-1] is not last:
                choreo.deferred.append(i)

        monkeypatch.setattr(disk_module, "encode_header", encode_header)
        monkeypatch.setattr(disk_module, "put_record", put_record)
        monkeypatch.setattr(disk_module._WriteOverlap, "put", overlap_put)


def test_a_running_hash_is_written_after_later_puts_and_queued_ones_are_taken_back(tmp_path, overlapped,
                                                                                   monkeypatch):
    """Block 1's hash is still running when its put ends (deferred past the puts of blocks
    2-4); blocks 2-4's hashes, queued behind it, are taken back and computed by the caller;
    every slot is overwritten by its copy-in after its put: every record is encode_record's
    bytes of the block as it was, and reads back OK."""
    pool = filled_pool(8, BIG, seed=5)
    choreo = _Choreography(monkeypatch, pool.tensor, held=1, until=4)
    before = pool.tensor.clone()
    fps = [hashlib.sha256(b"fp %d" % i).digest() for i in range(8)]
    tier = DiskTier(tmp_path, 1 << 22)

    def clobber(i: int) -> None:  # the next block's copy-in, as store() into a full slab does
        pool.tensor[i].fill_(float(i + 1000))

    puts = [(_hash(i), NS, pool.tensor[i], fps[i]) for i in range(8)]
    assert tier.write_batch(puts, after_put=clobber) == [True] * 8
    assert 1 in choreo.deferred and not {2, 3, 4} & set(choreo.deferred)  # deferred; taken back
    assert torch.equal(pool.tensor[3], torch.full_like(pool.tensor[3], 1003.0))  # the slots were overwritten
    assert _stored(tier, [_hash(i) for i in range(8)]) == [
        encode_record(NS, before[i], seq, fps[i]).tobytes() for i, seq in enumerate(range(1, 9))]
    for i in range(8):
        out = torch.empty(BIG.block_shape, dtype=BIG.dtype)
        assert tier.read_into(_hash(i), NS, out, fps[i]) is ReadStatus.OK and torch.equal(out, before[i])
    tier.check()
    tier.close()


def test_a_batch_repeating_a_key_is_refused_whole(tmp_path):
    """A second value under a key may be written into the first's pages (and the index holds
    a key once): a batch that repeats one is a ValueError, nothing of it written."""
    pool = filled_pool(3, BIG, seed=6)
    tier = DiskTier(tmp_path, 1 << 22)
    with pytest.raises(ValueError, match="distinct block hashes"):
        tier.write_batch([(_hash(0), NS, pool.tensor[0]), (_hash(1), NS, pool.tensor[1]),
                          (_hash(0), NS, pool.tensor[2])])
    assert len(tier) == 0 and _stored(tier, [_hash(0), _hash(1)]) == [None, None]
    assert tier.write_batch([(_hash(0), NS, pool.tensor[0]), (_hash(1), NS, pool.tensor[1])]) == [True, True]
    tier.check()
    tier.close()


def test_values_under_a_page_are_never_deferred(tmp_path, overlapped, monkeypatch):
    """A value in a leaf node moves when the leaf splits: its header is written at once, the
    caller waiting for its running hash."""
    pool = _pool(8, seed=7)
    assert pool.tensor[0].numel() * pool.tensor.element_size() + 128 < 4096
    choreo = _Choreography(monkeypatch, pool.tensor, held=1, until=1)
    asked = threading.Event()
    real_framed = disk_module.put_framed

    def put_framed(txn, key, framed, header):
        def asking(value):
            if key == _hash(1):
                asked.set()  # the caller asks for block 1's header: its hash is held, running
            return header(value)

        real_framed(txn, key, framed, asking)

    def release_once_asked():
        assert asked.wait(5.0)
        threading.Event().wait(0.05)  # the caller is inside the header wait by now
        choreo.released.set()

    monkeypatch.setattr(disk_module, "put_framed", put_framed)
    threading.Thread(target=release_once_asked, daemon=True).start()
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(8)]) == [True] * 8
    assert asked.is_set() and choreo.deferred == []
    assert _stored(tier, [_hash(i) for i in range(8)]) == [
        encode_record(NS, pool.tensor[i], i + 1).tobytes() for i in range(8)]
    tier.check()
    tier.close()


def test_a_deferred_hash_that_raises_aborts_the_batch(tmp_path, overlapped, monkeypatch):
    """A deferred hash that fails on the writer thread fails the batch: nothing of it is
    committed (no record whose header was never written), what was stored before stays, the
    tier goes on."""
    pool = filled_pool(6, BIG, seed=8)
    tier = DiskTier(tmp_path, 1 << 22)
    assert tier.write_batch([(_hash(100), NS, pool.tensor[5])]) == [True]
    choreo = _Choreography(monkeypatch, pool.tensor, held=2, until=3, fail=True)
    with pytest.raises(RuntimeError, match="hash failed"):
        tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(5)])
    assert 2 in choreo.deferred
    assert _stored(tier, [_hash(i) for i in range(5)]) == [None] * 5
    assert _hash(100) in tier and len(tier) == 1
    monkeypatch.undo()
    assert tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(5)]) == [True] * 5
    tier.check()
    tier.close()


def test_a_copy_in_run_here_at_shutdown_waits_for_the_running_hash_of_its_slot(tmp_path, overlapped, monkeypatch):
    """The interpreter starts shutting down right after the put of block 0, whose hash is still
    running on the writer: its after_put (the next block's copy into the slot) then runs on
    the caller's thread, and must wait for that hash, or the record gets the checksum of other
    bytes (the hostile review: block 0 read back CORRUPT)."""
    import concurrent.futures.thread as cf_thread

    pool = filled_pool(4, BIG, seed=12)
    choreo = _Choreography(monkeypatch, pool.tensor, held=0, until=3)
    before = pool.tensor.clone()
    real_put = disk_module.put_record

    def put_then_shut_down(txn, key, namespace, block, *args, **kwargs):
        real_put(txn, key, namespace, block, *args, **kwargs)
        if block.data_ptr() == pool.tensor[0].data_ptr():
            monkeypatch.setattr(cf_thread, "_shutdown", True)

    entered = threading.Event()
    real_after_put = disk_module._WriteOverlap.after_put

    def after_put(self, fn, i):
        entered.set()
        real_after_put(self, fn, i)

    def release_once_entered():  # a copy-in that does not wait overwrites slot 0 meanwhile
        assert entered.wait(5.0)
        threading.Event().wait(0.05)
        choreo.released.set()

    monkeypatch.setattr(disk_module, "put_record", put_then_shut_down)
    monkeypatch.setattr(disk_module._WriteOverlap, "after_put", after_put)
    threading.Thread(target=release_once_entered, daemon=True).start()
    tier = DiskTier(tmp_path, 1 << 22)
    puts = [(_hash(i), NS, pool.tensor[i]) for i in range(4)]
    assert tier.write_batch(puts, after_put=lambda i: pool.tensor[i].fill_(float(i + 1000))) == [True] * 4
    monkeypatch.setattr(cf_thread, "_shutdown", False)
    assert choreo.deferred == [0]
    assert _stored(tier, [_hash(i) for i in range(4)]) == [
        encode_record(NS, before[i], i + 1).tobytes() for i in range(4)]
    tier.check()
    tier.close()


def test_finish_waits_for_a_hash_whose_header_write_was_interrupted():
    """A KeyboardInterrupt while write_headers waits for a deferred hash: finish() still waits
    for that hash (it reads a slot the caller frees next), not only for the ones after it."""
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(1)
    gate, done = threading.Event(), threading.Event()

    def hashing() -> bytes:
        gate.wait(5.0)
        done.set()
        return bytes(128)

    class Interrupted:  # the running hash's future, its wait interrupted by a signal
        def __init__(self, future) -> None:
            self.future = future

        def result(self, timeout=None):
            raise KeyboardInterrupt

        def __getattr__(self, name):
            return getattr(self.future, name)

    overlap = disk_module._WriteOverlap(executor, [], {}, 4096)
    overlap._deferred = [(Interrupted(executor.submit(hashing)), _hash(0), np.zeros(8192, dtype=np.uint8))]
    with pytest.raises(KeyboardInterrupt):
        overlap.write_headers(None)  # interrupted before it reads the transaction
    finishing = threading.Thread(target=overlap.finish)
    finishing.start()
    finishing.join(0.05)
    assert finishing.is_alive()  # waiting for the interrupted hash
    gate.set()
    finishing.join(5.0)
    assert not finishing.is_alive() and done.is_set()
    executor.shutdown()


def test_a_value_found_elsewhere_at_the_commit_aborts_the_batch(tmp_path, overlapped, monkeypatch):
    """Were LMDB to move a value within its transaction after its deferred header was written,
    the check before the commit finds it elsewhere and aborts the batch: nothing is committed
    with a header in the wrong place; what was stored before stays."""
    pool = filled_pool(6, BIG, seed=13)
    tier = DiskTier(tmp_path, 1 << 22)
    assert tier.write_batch([(_hash(100), NS, pool.tensor[5])]) == [True]
    choreo = _Choreography(monkeypatch, pool.tensor, held=1, until=3)
    real = disk_module._stored_value
    elsewhere = np.zeros(pool.tensor[0].numel() * 4 + 128, dtype=np.uint8)

    def moved(txn, key, nbytes):
        value = real(txn, key, nbytes)
        return elsewhere if key == _hash(1) and choreo.released.is_set() else value

    monkeypatch.setattr(disk_module, "_stored_value", moved)
    assert tier.write_batch([(_hash(i), NS, pool.tensor[i]) for i in range(5)]) == [False] * 5
    assert 1 in choreo.deferred
    assert _stored(tier, [_hash(i) for i in range(5)]) == [None] * 5
    assert _hash(100) in tier and len(tier) == 1
    tier.check()
    tier.close()
