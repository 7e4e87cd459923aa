"""DISK writes overlapped with the tier's writer thread (kvtier.tiers.disk._WriteOverlap):
the victims' hashes and the caller's ``after_put`` copies run there while LMDB copies the
next block on the caller's thread. The records must be the bytes one thread writes, the
hashes must follow the sequence each put really got, and every ``after_put`` must be done,
in order, before ``write_batch`` returns."""

from __future__ import annotations

import hashlib
import threading

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
