"""DiskTier: verified records, exact accounting, cap, reopen, corrupt and full-disk cases."""

from __future__ import annotations

import hashlib
import os

import lmdb
import pytest
import torch

from kvtier.tiers.disk import HEADER_NBYTES, DiskTier, ReadStatus, record_footprint

pytestmark = pytest.mark.usefixtures("write_overlap")
NS = b"n" * 32


def blocks(n, shape=(2, 2, 4, 1, 8), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=g).to(dtype)


def hashes(n, salt=b""):
    return [os.urandom(31) + bytes([i]) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_byte_exact(tmp_path, dtype):
    tier = DiskTier(tmp_path, 1 << 20)
    data = blocks(3, dtype=dtype)
    hs = hashes(3)
    assert tier.write_batch([(h, NS, b) for h, b in zip(hs, data)]) == [True] * 3
    for h, b in zip(hs, data):
        out = torch.full_like(b, 7)
        assert tier.read_into(h, NS, out) is ReadStatus.OK
        assert torch.equal(out.view(torch.uint8), b.view(torch.uint8))
    tier.check()
    tier.close()


def test_accounting_is_exact_and_cap_holds(tmp_path):
    b = blocks(1)[0]
    footprint = record_footprint(b.numel() * 4)
    tier = DiskTier(tmp_path, 3 * footprint)
    hs = hashes(4)
    results = tier.write_batch([(h, NS, b) for h in hs])
    assert results == [True, True, True, False]  # the fourth would exceed the cap
    assert tier.used_bytes == 3 * footprint == tier.capacity_bytes
    tier.write_batch([(hs[3], NS, b)], deletes=[hs[0]])
    assert hs[0] not in tier and hs[3] in tier and tier.used_bytes == 3 * footprint
    tier.check()
    tier.close()


def test_free_bytes_after_writes_in_flight_counts_a_landed_write_once(tmp_path):
    """Background DISK writes reserve room (kvtier.store.placement): a write that already
    landed is in used_bytes and must not be counted again as pending (it made write-through
    stores evict DISK blocks they did not need to)."""
    b = blocks(1)[0]
    nbytes = b.numel() * 4
    footprint = record_footprint(nbytes)
    tier = DiskTier(tmp_path, 8 * footprint)
    landed, pending = hashes(2)
    assert tier.write_batch([(landed, NS, b)]) == [True]
    assert tier.free_bytes_after([], nbytes) == 7 * footprint
    assert tier.free_bytes_after([landed], nbytes) == 7 * footprint
    assert tier.free_bytes_after([landed, pending], nbytes) == 6 * footprint
    tier.close()


def test_reopen_rebuilds_index_in_store_order(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    hs = hashes(4)
    for h, b in zip(hs, blocks(4)):
        tier.write_batch([(h, NS, b)])
    used = tier.used_bytes
    tier.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert list(again.lru_order()) == hs and again.used_bytes == used
    again.check()
    again.close()


def test_smaller_cap_on_reopen_drops_oldest(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    hs = hashes(4)
    data = blocks(4)
    for h, b in zip(hs, data):
        tier.write_batch([(h, NS, b)])
    tier.close()
    small = DiskTier(tmp_path, 2 * record_footprint(data[0].numel() * 4))
    assert list(small.lru_order()) == hs[2:]
    small.check()
    small.close()


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "garbage"])
def test_corrupt_record_is_reported_and_dropped_regression_d1(tmp_path, damage):
    tier = DiskTier(tmp_path, 1 << 20)
    (h,), (b,) = hashes(1), blocks(1)
    tier.write_batch([(h, NS, b)])
    with tier.env.begin(write=True) as txn:
        value = bytearray(txn.get(h))
        if damage == "flip_payload":
            value[HEADER_NBYTES + 5] ^= 1
        elif damage == "flip_header":
            value[50] ^= 1
        elif damage == "truncate":
            value = value[:-3]
        else:
            value = bytearray(b"not a kvtier record")
        txn.put(h, bytes(value))
    out = torch.full_like(b, 7)
    assert tier.read_into(h, NS, out) is ReadStatus.CORRUPT
    tier.remove([h])  # the store drops what a read reported corrupt
    assert h not in tier
    assert tier.read_into(h, NS, out) is ReadStatus.MISSING
    tier.check()
    tier.close()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_block_over_several_read_pieces_is_verified_in_every_piece(tmp_path, monkeypatch, where):
    # read_into hashes and copies a payload in pieces of records._READ_CHUNK_NBYTES: a payload of
    # 2.5 pieces round-trips exactly, and a flipped byte in any piece (the last one short) is CORRUPT
    import kvtier.records as records

    monkeypatch.setattr(records, "_READ_CHUNK_NBYTES", 4096)
    (h,), (b,) = hashes(1), blocks(1, shape=(2, 2, 4, 40, 8))  # 10240 bytes: pieces of 4096, 4096, 2048
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write_batch([(h, NS, b)])
    out = torch.full_like(b, 7)
    assert tier.read_into(h, NS, out) is ReadStatus.OK and torch.equal(out.view(torch.uint8), b.view(torch.uint8))
    offset = {"first": 0, "middle": 4096 + 17, "last": 10239}[where]
    with tier.env.begin(write=True) as txn:
        value = bytearray(txn.get(h))
        value[HEADER_NBYTES + offset] ^= 0x40
        txn.put(h, bytes(value))
    assert tier.read_into(h, NS, torch.full_like(b, 7)) is ReadStatus.CORRUPT
    tier.close()


def test_wrong_namespace_shape_or_dtype_is_not_served(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    hs, data = hashes(3), blocks(3)
    tier.write_batch([(h, NS, b) for h, b in zip(hs, data)])
    assert tier.read_into(hs[0], b"m" * 32, torch.empty_like(data[0])) is ReadStatus.CORRUPT
    assert tier.read_into(hs[1], NS, torch.empty(2, 2, 4, 1, 4)) is ReadStatus.CORRUPT
    assert tier.read_into(hs[2], NS, torch.empty_like(data[2]).half()) is ReadStatus.CORRUPT
    tier.close()


def test_full_map_makes_stores_return_false_and_keeps_blocks_regression_d3(tmp_path):
    # A cap far above what the LMDB map can hold: the map fills before the cap does.
    tier = DiskTier(tmp_path, 1 << 20)
    tier.env.set_mapsize(256 << 10)
    big = torch.randn(64 << 10)  # 256 KiB payload: cannot fit in a 256 KiB map
    (h_small,), (b_small,) = hashes(1), blocks(1)
    assert tier.write_batch([(h_small, NS, b_small)]) == [True]
    (h_big,) = hashes(1)
    assert tier.write_batch([(h_big, NS, big)]) == [False]
    out = torch.empty_like(b_small)
    assert tier.read_into(h_small, NS, out) is ReadStatus.OK and torch.equal(out, b_small)
    tier.check()
    tier.close()


def test_not_a_directory_raises(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises((lmdb.Error, OSError)):
        DiskTier(path, 1 << 20)


def test_concurrent_rewrite_and_read_of_one_block_gives_whole_block_or_miss(tmp_path):
    """A reader racing a writer that deletes and rewrites the same block sees one whole
    version or a miss, never a mix (LMDB MVCC: readers keep their snapshot)."""
    import threading

    tier = DiskTier(tmp_path, 8 << 20)
    (h,) = hashes(1)
    versions = [torch.full((2, 2, 64, 1, 8), float(v)) for v in (1, 2)]
    tier.write_batch([(h, NS, versions[0])])
    stop = threading.Event()
    seen: list[str] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            tier.write_batch([(h, NS, versions[i % 2])], deletes=[h])

    def reader() -> None:
        out = torch.empty_like(versions[0])
        for _ in range(300):
            status = tier.read_into(h, NS, out)
            if status is ReadStatus.OK:
                assert out.unique().numel() == 1 and out[0, 0, 0, 0, 0].item() in (1.0, 2.0)
                seen.append("ok")
            else:
                assert status is ReadStatus.MISSING
                seen.append("miss")

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert seen.count("ok") > 0 and len(seen) == 600
    tier.check()
    tier.close()


def test_another_versions_records_survive_opening_the_directory(tmp_path):
    """A release of another record format version opening a DISK directory must not wipe
    it (issue 11): its records are kept (never served), counted, and make way for new ones.
    Version ``+1`` stands for the next release's records."""
    import struct

    from kvtier.records import encode_record

    tier = DiskTier(tmp_path, 1 << 20)
    tier.close()
    value = bytearray(encode_record(NS, blocks(1)[0], 1))
    (version,) = struct.unpack_from("<H", value, 4)
    struct.pack_into("<H", value, 4, version + 1)
    key = hashes(1)[0]
    env = lmdb.open(str(tmp_path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(key, bytes(value))
    env.close()
    tier = DiskTier(tmp_path, 1 << 20)
    assert key not in tier and len(tier) == 0  # a miss
    assert tier.used_bytes == record_footprint(blocks(1)[0].numel() * 4)  # counted
    tier.check()
    tier.close()
    env = lmdb.open(str(tmp_path), map_size=1 << 24)
    with env.begin() as txn:
        assert txn.get(key) == bytes(value)  # kept as it was
    env.close()


@pytest.mark.slow
def test_a_small_tier_spills_in_steady_state_without_filling_its_map(tmp_path):
    """A tier of 200 MiB taking batches of DISK_TXN_BYTES that each evict the oldest records
    (as every spill into a full tier does): LMDB cannot reuse pages freed by the current or
    the previous transaction, so the map needs two transactions' worth of slack beyond the
    cap; without it every spill from the third on failed with MDB_MAP_FULL, for good (the
    hostile review of issue 17's deferred headers). Every batch lands; the last batch's records
    read back exact."""
    from kvtier.tiers.disk import DISK_TXN_BYTES

    block_nbytes = 2 << 20
    n = DISK_TXN_BYTES // block_nbytes
    data = torch.cat([torch.zeros(32), torch.randn(n * block_nbytes // 4)])[32:].view(n, -1)  # 128 B before slot 0
    tier = DiskTier(tmp_path, 200 << 20)
    per = record_footprint(block_nbytes)
    written: list[bytes] = []
    for r in range(8):
        hashes = [hashlib.sha256(b"steady %d %d" % (r, i)).digest() for i in range(n)]
        room = tier.capacity_bytes - tier.used_bytes
        victims = list(tier.lru_order())[: max(0, -(-(n * per - room) // per))]
        assert tier.write_batch([(h, NS, data[i]) for i, h in enumerate(hashes)], deletes=victims) == [True] * n, r
        written = [h for h in written if h not in victims] + hashes
    assert set(tier.lru_order()) == set(written)
    out = torch.empty_like(data[0])
    for i, h in enumerate(written[-n:]):
        assert tier.read_into(h, NS, out) is ReadStatus.OK and torch.equal(out, data[i])
    tier.check()
    tier.close()
