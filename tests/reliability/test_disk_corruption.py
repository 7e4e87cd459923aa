"""DISK records damaged behind kvtier's back (D1): a damaged record is a miss from it on, never
garbage; a bad header field costs that record only; a deleted record is forgotten."""

from __future__ import annotations

import struct

import pytest
import torch

from tests.conftest import NS, chain, flip_byte, open_store, patch_record, random_blocks, read_back, stored_then_reopened, tiny_spec

SPEC = tiny_spec()
# DISK record header (kvtier/records.py): magic 4s, version H, dtype B, ndim B, shape 8I,
# namespace 32s, payload_nbytes Q, seq Q, checksum Q.
_SIZE_OFFSET = struct.calcsize("<4sHBB8I32s")  # 72
_SEQ_OFFSET = _SIZE_OFFSET + 8  # 80
_CHECKSUM_OFFSET = _SEQ_OFFSET + 8  # 88


def _records_by_seq(txn) -> list[bytes]:
    """Record keys, oldest store first."""
    seqs = {bytes(k): struct.unpack_from("<Q", v, _SEQ_OFFSET)[0] for k, v in txn.cursor()}
    return sorted(seqs, key=seqs.get)


_DAMAGE = {
    **{f"flip_header_byte_{o}": flip_byte(o) for o in (0, 4, 6, 7, 8, 40, 71, _SIZE_OFFSET, _SEQ_OFFSET, _CHECKSUM_OFFSET)},
    "flip_payload_first": flip_byte(96, 0x01),
    "flip_payload_last": lambda v: v[:-1] + bytes([v[-1] ^ 0x80]),
    "truncate_to_0": lambda v: v[:0],
    "truncate_to_50": lambda v: v[:50],
    "truncate_header_only": lambda v: v[:96],
    "truncate_half": lambda v: v[: len(v) // 2],
    "extend": lambda v: v + b"\0" * 8,
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_damaged_record_is_a_miss_from_it_on_never_garbage_regression_d1(tmp_path, opened, damage):
    store, hashes, blocks = stored_then_reopened(
        opened, tmp_path, 3, edit=lambda txn, hs: patch_record(txn, hs[1], _DAMAGE[damage])
    )
    n, out = read_back(store, hashes)
    assert n == 1 and torch.equal(out, blocks[:1])
    assert store.medium_of(hashes[1]) is None  # dropped (at open, or when the read failed)
    store.check_invariants()
    store.store(chain(3, SPEC, NS, start=500), random_blocks(SPEC, 3, seed=5))
    store.flush()
    store.check_invariants()


def test_record_corrupted_while_the_store_is_open_is_a_counted_miss_regression_d1(tmp_path, opened):
    store, hashes, blocks = stored_then_reopened(opened, tmp_path, 3)
    with store.disk.env.begin(write=True) as txn:  # behind the index's back
        patch_record(txn, hashes[1], flip_byte(200, 0x04))
    n, out = read_back(store, hashes)
    assert n == 1 and torch.equal(out, blocks[:1])
    assert store.stats.load_failures == {"corrupt": 1}
    assert store.medium_of(hashes[1]) is None
    store.check_invariants()


def test_corrupt_size_field_of_one_record_drops_only_that_record_on_reopen(tmp_path, opened):
    def grow_newest(txn, hashes):
        newest = _records_by_seq(txn)[-1]
        patch_record(txn, newest, lambda v: v[:_SIZE_OFFSET] + struct.pack("<Q", 1 << 40) + v[_SIZE_OFFSET + 8 :])

    store, hashes, blocks = stored_then_reopened(opened, tmp_path, 6, edit=grow_newest)
    assert len(store.disk) >= 5, "good records were dropped because of one bad header"
    store.check_invariants()


def test_corrupt_seq_field_does_not_make_later_disk_writes_raise(tmp_path, opened):
    def max_seq(txn, hashes):
        patch_record(txn, hashes[0], lambda v: v[:_SEQ_OFFSET] + b"\xff" * 8 + v[_SEQ_OFFSET + 8 :])

    store, hashes, _ = stored_then_reopened(opened, tmp_path, 3, edit=max_seq)
    new, new_blocks = chain(2, SPEC, NS, start=700), random_blocks(SPEC, 2, seed=7)
    store.store(new, new_blocks)
    store.flush()
    store.close()
    again = opened(open_store(tmp_path, gpu=4, disk=12))
    n, out = read_back(again, new)
    assert n == 2 and torch.equal(out, new_blocks)


def test_record_deleted_behind_the_store_is_forgotten_not_claimed_forever(tmp_path, opened):
    store, hashes, blocks = stored_then_reopened(opened, tmp_path, 3)
    with store.disk.env.begin(write=True) as txn:
        txn.delete(hashes[1])
    n, _ = read_back(store, hashes)
    assert n == 1 and store.stats.load_failures == {"missing": 1}
    assert store.lookup(hashes).num_hit_blocks == 1
    store.check_invariants()

