"""DISK reads through the file (``preadv`` at the record's offset in data.mdb) instead of
LMDB's map: byte-exact, verified as the map path, and any doubt (a wrong or stale offset, no
mapping, a corrupt record) decided through the map, so that nothing healthy is ever dropped."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvtier.records import HEADER_NBYTES, ReadStatus, decode_file_into, encode_record
from kvtier.tiers import disk as disk_module
from kvtier.tiers.disk import DiskTier, _MappedFile, record_footprint
from tests.conftest import flip_byte, patch_record

NS = b"n" * 32
SHAPE = (2, 2, 16, 2, 64)  # 8192 elements: 32 KiB in float32, 16 KiB in bf16


def blocks(n, shape=SHAPE, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=g).to(dtype)


def keys(n):
    return [os.urandom(31) + bytes([i]) for i in range(n)]


@pytest.fixture
def file_reads(monkeypatch):
    """Every read takes the file path (whatever the page cache holds) and is counted:
    ``calls`` of decode_file_into, ``results`` it returned (``None``: went to the map)."""
    monkeypatch.setattr(_MappedFile, "cold_offset", lambda self, key, value: self.offset_of(value))
    seen = {"calls": 0, "results": []}
    real = disk_module.decode_file_into

    def spy(*args):
        seen["calls"] += 1
        result = real(*args)
        seen["results"].append(result)
        return result

    monkeypatch.setattr(disk_module, "decode_file_into", spy)
    return seen


def _skip_without_file_path(tier):
    if tier._records.fd < 0:
        pytest.skip("no /proc/self/maps or os.preadv here: every read takes the map")


def _map_read(tier, h, like, fingerprint=None):
    out = torch.full_like(like, 3)
    with tier.env.begin(buffers=True) as txn:
        from kvtier.records import decode_into

        status = decode_into(txn.get(h), NS, out, fingerprint)
    return status, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_file_path_is_byte_exact_and_equals_the_map_path(tmp_path, file_reads, dtype, monkeypatch):
    monkeypatch.setattr("kvtier.records._CHUNK_NBYTES", 4096)  # many chunks per record
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    data = blocks(5, dtype=dtype)
    hs = keys(5)
    assert tier.write_batch([(h, NS, b, h) for h, b in zip(hs, data)]) == [True] * 5
    for h, b in zip(hs, data):
        out = torch.full_like(b, 7)
        assert tier.read_into(h, NS, out, h) is ReadStatus.OK
        assert torch.equal(out.view(torch.uint8), b.view(torch.uint8))
        status, mapped = _map_read(tier, h, b, h)
        assert status is ReadStatus.OK and torch.equal(mapped.view(torch.uint8), out.view(torch.uint8))
    assert file_reads["calls"] == 5 and file_reads["results"] == [ReadStatus.OK] * 5
    tier.check()
    tier.close()


def test_file_path_offset_is_the_values_place_in_data_mdb(tmp_path):
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    b = blocks(1)[0]
    h = keys(1)[0]
    tier.write_batch([(h, NS, b, h)])
    with tier.env.begin(buffers=True) as txn:
        value = txn.get(h)
        offset = tier._records.offset_of(value)
        assert offset is not None and offset > 0
        with open(tmp_path / "data.mdb", "rb") as f:
            f.seek(offset)
            assert f.read(len(value)) == bytes(value)
    tier.close()


def test_records_not_yet_mapped_take_the_file_once(tmp_path, monkeypatch):
    """The real choice: after a reopen no record is in this process's page tables, so the
    first read of each takes the file; a record written, or read once, takes the map."""
    seen = []
    real = disk_module.decode_file_into
    monkeypatch.setattr(disk_module, "decode_file_into", lambda *a: seen.append(a[2]) or real(*a))
    tier = DiskTier(tmp_path, 1 << 23)
    _skip_without_file_path(tier)
    data = blocks(4, shape=(4, 2, 16, 4, 64))  # 256 KiB each: overflow pages of their own
    hs = keys(4)
    tier.write_batch([(h, NS, b, h) for h, b in zip(hs, data)])
    out = torch.empty_like(data[0])
    assert tier.read_into(hs[0], NS, out, hs[0]) is ReadStatus.OK and torch.equal(out, data[0])
    assert seen == []  # written by this process: in its page tables
    tier.close()
    tier = DiskTier(tmp_path, 1 << 23)
    for k in (2, 2, 0):
        assert tier.read_into(hs[k], NS, out, hs[k]) is ReadStatus.OK and torch.equal(out, data[k])
    assert len(seen) == 2  # hs[2] once (then mapped), hs[0] once
    tier.remove([hs[2]])
    assert hs[2] not in tier._records.mapped
    tier.clear()
    assert not tier._records.mapped
    tier.close()


@pytest.mark.parametrize("shift", [4096, -4096, 1, HEADER_NBYTES, 1 << 40])
def test_wrong_offset_falls_back_to_the_map_and_drops_nothing(tmp_path, monkeypatch, shift):
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    data = blocks(4)
    hs = keys(4)
    tier.write_batch([(h, NS, b, h) for h, b in zip(hs, data)])
    real = _MappedFile.offset_of
    monkeypatch.setattr(_MappedFile, "cold_offset", lambda self, key, v: max(0, real(self, v) + shift))
    for h, b in zip(hs, data):
        out = torch.full_like(b, 7)
        assert tier.read_into(h, NS, out, h) is ReadStatus.OK
        assert torch.equal(out, b)
    assert all(h in tier for h in hs)
    assert tier._records._doubts == 4 and tier._records._stale  # each doubted, the mappings looked up again
    tier.check()
    tier.close()


def test_stale_mapping_is_looked_up_again(tmp_path):
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    b, h = blocks(1)[0], keys(1)[0]
    tier.write_batch([(h, NS, b, h)])
    with tier.env.begin(buffers=True) as txn:
        right = tier._records.offset_of(txn.get(h))
    tier._records._ranges = tuple((s + 8192, e + 8192, o) for s, e, o in tier._records._ranges)  # a moved map
    with tier.env.begin(buffers=True) as txn:
        value = txn.get(h)
        assert tier._records.offset_of(value) in (None, right - 8192)  # outside: looked up again -> right
        tier._records._ranges, tier._records._stale = (), False
        assert tier._records.offset_of(value) == right  # no mapping known: read /proc/self/maps again
    tier.close()


def test_no_mapping_found_reads_through_the_map(tmp_path, file_reads):
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    tier._records._real = "/no/such/data.mdb"  # /proc/self/maps never matches
    data, hs = blocks(2), keys(2)
    tier.write_batch([(h, NS, b, h) for h, b in zip(hs, data)])
    for h, b in zip(hs, data):
        out = torch.empty_like(b)
        assert tier.read_into(h, NS, out, h) is ReadStatus.OK and torch.equal(out, b)
    assert file_reads["calls"] == 0
    tier.close()


def test_no_file_path_without_preadv(tmp_path, monkeypatch, file_reads):
    monkeypatch.delattr(os, "preadv", raising=False)
    tier = DiskTier(tmp_path, 1 << 22)
    assert tier._records.fd == -1
    b, h = blocks(1)[0], keys(1)[0]
    tier.write_batch([(h, NS, b, h)])
    out = torch.empty_like(b)
    assert tier.read_into(h, NS, out, h) is ReadStatus.OK and torch.equal(out, b)
    assert file_reads["calls"] == 0
    tier.close()


@pytest.mark.parametrize("where", [HEADER_NBYTES + 5, HEADER_NBYTES + 20000, 10, 100])  # payload, header
def test_corrupt_record_on_the_file_path_is_corrupt_and_only_it_is_dropped(tmp_path, file_reads, where):
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    data, hs = blocks(3), keys(3)
    tier.write_batch([(h, NS, b, h) for h, b in zip(hs, data)])
    with tier.env.begin(write=True) as txn:
        patch_record(txn, hs[1], flip_byte(where))
    out = torch.empty_like(data[1])
    assert tier.read_into(hs[1], NS, out, hs[1]) is ReadStatus.CORRUPT  # decided by the map
    assert file_reads["results"][-1] is None  # the file path did not decide
    for h, b in ((hs[0], data[0]), (hs[2], data[2])):
        assert tier.read_into(h, NS, out, h) is ReadStatus.OK and torch.equal(out, b)
    assert file_reads["results"][-2:] == [ReadStatus.OK, ReadStatus.OK]
    tier.remove([hs[1]])  # what the store does with a CORRUPT record
    assert hs[1] not in tier and hs[0] in tier and hs[2] in tier
    tier.check()
    tier.close()


def test_token_mismatch_and_wrong_shape_on_the_file_path(tmp_path, file_reads):
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    b, h = blocks(1)[0], keys(1)[0]
    tier.write_batch([(h, NS, b, h)])
    assert tier.read_into(h, NS, torch.empty_like(b), b"x" * 32) is ReadStatus.TOKEN_MISMATCH
    assert tier.read_into(h, NS, torch.empty(b.numel(), dtype=b.dtype), h) is ReadStatus.CORRUPT
    assert tier.read_into(h, b"m" * 32, torch.empty_like(b), h) is ReadStatus.CORRUPT
    assert h in tier
    tier.close()


def test_file_path_after_a_map_resize(tmp_path, file_reads):
    """LMDB maps anew when its map size changes: offsets come from the new mapping."""
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    data, hs = blocks(3), keys(3)
    tier.write_batch([(h, NS, b, h) for h, b in zip(hs, data)])
    out = torch.empty_like(data[0])
    assert tier.read_into(hs[0], NS, out, hs[0]) is ReadStatus.OK
    before = tier._records._ranges
    tier.env.set_mapsize(tier.env.info()["map_size"] * 4)
    more_data, more = blocks(2, seed=1), keys(2)
    tier.write_batch([(h, NS, b, h) for h, b in zip(more, more_data)])
    for h, b in zip(hs + more, [*data, *more_data]):
        assert tier.read_into(h, NS, out, h) is ReadStatus.OK and torch.equal(out, b)
    assert file_reads["results"][-5:] == [ReadStatus.OK] * 5  # all from the file, none doubted
    assert tier._records._ranges != before
    tier.check()
    tier.close()


def test_forked_child_reads_through_its_own_mapping(tmp_path):
    tier = DiskTier(tmp_path, 1 << 22)
    _skip_without_file_path(tier)
    b, h = blocks(1)[0], keys(1)[0]
    tier.write_batch([(h, NS, b, h)])
    tier.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        ok = 0
        try:
            tier.after_fork_in_child()
            with tier.env.begin(buffers=True) as txn:
                value = txn.get(h)
                offset = tier._records.offset_of(value)
                st = decode_file_into(tier._records.fd, offset, value, NS, out := torch.empty_like(b), h)
            ok = int(st is ReadStatus.OK and torch.equal(out, b))
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"\x01"
    os.waitpid(pid, 0)
    os.close(r)
    tier.close()


# -- kvtier.records.decode_file_into on a plain file ------------------------------------------
def _file_with_record(tmp_path, block, lead=1000):
    record = encode_record(NS, block, 5, b"f" * 32)
    path = tmp_path / "records.bin"
    path.write_bytes(b"\0" * lead + record.tobytes() + b"\0" * 10)
    return path, memoryview(record.tobytes()), lead


def test_decode_file_into_reads_exactly_the_payload(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.records._CHUNK_NBYTES", 1000)  # chunks not a divisor of the size
    block = blocks(1)[0]
    path, value, lead = _file_with_record(tmp_path, block)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = torch.empty_like(block)
        assert decode_file_into(fd, lead, value, NS, out, b"f" * 32) is ReadStatus.OK
        assert torch.equal(out, block)
        assert decode_file_into(fd, lead, value, NS, out, b"g" * 32) is None  # mismatch: the map decides
        assert decode_file_into(fd, lead + 1, value, NS, out) is None  # wrong offset
        assert decode_file_into(fd, lead - 8, value, NS, out) is None
        assert decode_file_into(fd, os.fstat(fd).st_size - 100, value, NS, out) is None  # short read
        assert decode_file_into(fd, lead, value, NS, torch.empty(3)) is None  # size does not match
    finally:
        os.close(fd)


def test_decode_file_into_header_must_equal_the_mapped_one(tmp_path):
    block = blocks(1)[0]
    path, value, lead = _file_with_record(tmp_path, block)
    other = bytearray(value)
    other[60] ^= 1  # the mapped copy differs from the file's (a stale offset onto a look-alike)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert decode_file_into(fd, lead, memoryview(bytes(other)), NS, torch.empty_like(block)) is None
    finally:
        os.close(fd)


def test_decode_file_into_bad_fd_is_none(tmp_path):
    block = blocks(1)[0]
    _, value, lead = _file_with_record(tmp_path, block)
    assert decode_file_into(987654, lead, value, NS, torch.empty_like(block)) is None
    np.testing.assert_equal(len(value), HEADER_NBYTES + block.numel() * 4)
