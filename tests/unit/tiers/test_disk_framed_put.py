"""DISK writes that copy a block once (kvtier.tiers.disk.put_record): LMDB copies the slot,
framed by the bytes before it, into its map and the header is written over that frame. What
lands must be exactly the record :func:`kvtier.records.encode_record` builds, the memory
before the block must be left alone, and every check on read still applies."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvtier.records import HEADER_NBYTES, encode_record
from kvtier.tiers.disk import DiskTier, ReadStatus
from kvtier.tiers.pool import FRAME_PAD_NBYTES, BlockPool
from tests.conftest import NS, chain, filled_pool, random_blocks, tiny_spec

pytestmark = pytest.mark.usefixtures("write_overlap")
SPEC = tiny_spec()


def _hash(i: int) -> bytes:
    return hashlib.sha256(b"framed %d" % i).digest()


def _pool(n: int, seed: int = 0) -> BlockPool:
    return filled_pool(n, SPEC, seed)


def test_cpu_pool_has_a_page_before_slot_0():
    pool = _pool(3)
    assert FRAME_PAD_NBYTES >= HEADER_NBYTES
    assert pool.tensor.storage_offset() * pool.tensor.element_size() == FRAME_PAD_NBYTES
    assert pool.tensor.data_ptr() % 64 == 0  # the allocator's alignment is kept
    assert pool.tensor.shape == (3, *SPEC.block_shape) and pool.tensor.dtype == SPEC.dtype


@pytest.mark.parametrize("source", ["pool", "standalone"])
def test_stored_value_is_exactly_encode_records_bytes(tmp_path, source):
    """Pool slots (slot 0 included) take the framed put; a tensor with nothing before it the
    buffered one: both store the same bytes as encode_record, and read back bit-exact."""
    if source == "pool":
        pool = _pool(4)
        data = [pool.tensor[i] for i in range(4)]
    else:
        data = [random_blocks(SPEC, 1, seed=i)[0].clone() for i in range(4)]
        assert all(b.storage_offset() == 0 for b in data)
    fingerprints = [hashlib.sha256(b"fp %d" % i).digest() for i in range(4)]
    tier = DiskTier(tmp_path, 1 << 20)
    hs = [_hash(i) for i in range(4)]
    assert tier.write_batch([(h, NS, b, fp) for h, b, fp in zip(hs, data, fingerprints)]) == [True] * 4
    with tier.env.begin() as txn:
        for seq, (h, b, fp) in enumerate(zip(hs, data, fingerprints), start=1):
            assert txn.get(h) == encode_record(NS, b, seq, fp).tobytes()
    for h, b, fp in zip(hs, data, fingerprints):
        out = torch.full_like(b, 3.0)
        assert tier.read_into(h, NS, out, fp) is ReadStatus.OK
        assert torch.equal(out.view(torch.uint8), b.view(torch.uint8))
    tier.check()
    tier.close()


def test_memory_before_the_block_is_left_alone(tmp_path):
    """The frame LMDB copies is the previous slot's tail (the pool's pad for slot 0): it must
    read the same after the write, and never reach the stored record."""
    pool = _pool(3, seed=4)
    before = pool.tensor.clone()
    flat = pool.tensor.view(torch.uint8).reshape(-1)
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.write_batch([(_hash(1), NS, pool.tensor[1]), (_hash(0), NS, pool.tensor[0])]) == [True, True]
    assert torch.equal(pool.tensor, before)
    with tier.env.begin() as txn:
        value = txn.get(_hash(1))
    tail_of_slot_0 = bytes(flat[SPEC.block_nbytes - HEADER_NBYTES : SPEC.block_nbytes].numpy())
    assert value[:HEADER_NBYTES] != tail_of_slot_0
    assert value[:4] == b"KVTB"
    tier.close()


@pytest.mark.parametrize(
    "offset", [0, 120, HEADER_NBYTES, HEADER_NBYTES + 17, -1], ids=["magic", "checksum", "payload0", "payload", "last"]
)
def test_damage_to_a_framed_record_is_corrupt_and_dropped(tmp_path, offset):
    pool = _pool(2, seed=5)
    tier = DiskTier(tmp_path, 1 << 20)
    h = _hash(7)
    assert tier.write_batch([(h, NS, pool.tensor[1])]) == [True]
    with tier.env.begin(write=True) as txn:
        value = bytearray(txn.get(h))
        value[offset] ^= 0x01
        txn.put(h, bytes(value))
    out = torch.empty_like(pool.tensor[1])
    assert tier.read_into(h, NS, out) is ReadStatus.CORRUPT
    tier.close()


def test_framed_put_on_a_full_map_fails_cleanly_and_keeps_stored_blocks(tmp_path):
    """D3 on the framed path: a put LMDB's map cannot hold is a False, nothing of it is
    visible, the block already stored still reads back."""
    pool = _pool(2, seed=6)
    tier = DiskTier(tmp_path, 1 << 20)
    tier.env.set_mapsize(256 << 10)
    assert tier.write_batch([(_hash(0), NS, pool.tensor[1])]) == [True]
    big = torch.randn((2, 64 << 10))  # row 1: a 256 KiB payload framed by row 0
    assert tier.write_batch([(_hash(1), NS, big[1])]) == [False]
    assert _hash(1) not in tier
    with tier.env.begin() as txn:
        assert txn.get(_hash(1)) is None
    out = torch.empty_like(pool.tensor[1])
    assert tier.read_into(_hash(0), NS, out) is ReadStatus.OK and torch.equal(out, pool.tensor[1])
    tier.check()
    tier.close()


def test_store_into_a_full_cpu_slab_spills_every_byte(make_store):
    """The store path that now takes the framed put: a CPU slab full of blocks held nowhere
    else, then new blocks stored into it; every old block is on DISK, bit-exact."""
    store = make_store(gpu_blocks=0, cpu_blocks=4, disk_blocks=16)
    old, new = chain(4, SPEC, NS), chain(4, SPEC, NS, start=4000)
    old_blocks, new_blocks = random_blocks(SPEC, 4, seed=1), random_blocks(SPEC, 4, seed=2)
    assert store.store(old, old_blocks) == 4
    assert store.store(new, new_blocks) == 4
    assert all(h in store.disk for h in old)
    for h, b in zip(old, old_blocks):
        out = torch.empty_like(b)
        assert store.disk.read_into(h, NS, out) is ReadStatus.OK
        assert torch.equal(out.view(torch.uint8), b.view(torch.uint8))
    store.check_invariants()


def test_framed_put_over_another_versions_record_and_after_a_delete_in_the_same_batch(tmp_path):
    """A framed put that replaces a value (another release's record under the same key, or a
    record deleted earlier in the same transaction) writes its header into the new value's
    pages: both read back bit-exact and equal encode_record's bytes; the old bytes are gone."""
    import struct

    import lmdb

    pool = _pool(3, seed=9)
    foreign_key, again_key = _hash(20), _hash(21)
    value = bytearray(encode_record(NS, pool.tensor[2], 1))
    (version,) = struct.unpack_from("<H", value, 4)
    struct.pack_into("<H", value, 4, version + 1)  # the next release's record
    env = lmdb.open(str(tmp_path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(foreign_key, bytes(value))
    env.close()
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.foreign_bytes > 0 and foreign_key not in tier
    assert tier.write_batch([(foreign_key, NS, pool.tensor[1]), (again_key, NS, pool.tensor[0])]) == [True, True]
    assert tier.write_batch([(again_key, NS, pool.tensor[2])], deletes=[again_key]) == [True]
    assert tier.foreign_bytes == 0
    with tier.env.begin() as txn:
        assert txn.get(foreign_key) == encode_record(NS, pool.tensor[1], 1).tobytes()
        assert txn.get(again_key) == encode_record(NS, pool.tensor[2], 3).tobytes()
    for key, slot in ((foreign_key, 1), (again_key, 2)):
        out = torch.empty_like(pool.tensor[0])
        assert tier.read_into(key, NS, out) is ReadStatus.OK and torch.equal(out, pool.tensor[slot])
    tier.check()
    tier.close()
