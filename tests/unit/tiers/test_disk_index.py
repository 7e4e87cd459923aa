"""The DISK tier's persisted index (kvtier.tiers.disk_index): opening reads it instead of the
records; a directory without one (written by an older release) or with one behind the
records is rebuilt once from the records' headers and persisted."""

from __future__ import annotations

import hashlib
import shutil

import lmdb
import pytest
import torch

from kvtier.records import encode_record
from kvtier.tiers.disk import DiskTier, ReadStatus
from kvtier.tiers.disk_index import DiskIndex

NS = b"n" * 32


def blocks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, 2, 2, 4, 1, 8), generator=g)


def hashes(n, tag="a"):
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def fingerprints(hs):
    return [hashlib.sha256(b"fp" + h).digest() for h in hs]


def no_scan(monkeypatch):
    """Make reading the records' headers on open an error: only the persisted index may be used."""
    def refuse(self):
        raise AssertionError("opened by scanning the records")
    monkeypatch.setattr(DiskTier, "_scan_records", refuse)


def write(tier, hs, data, fps):
    for h, b, fp in zip(hs, data, fps):
        assert tier.write_batch([(h, NS, b, fp)]) == [True]


def assert_served(tier, hs, data, fps):
    for h, b, fp in zip(hs, data, fps):
        out = torch.full_like(b, 7)
        assert tier.read_into(h, NS, out, fp) is ReadStatus.OK
        assert torch.equal(out, b)


def test_reopen_uses_the_persisted_index_not_the_records(tmp_path, monkeypatch):
    hs, data = hashes(5), blocks(5)
    fps = fingerprints(hs)
    tier = DiskTier(tmp_path, 1 << 20)
    write(tier, hs, data, fps)
    tier.remove([hs[1]])
    tier.touch(hs[0])  # uses are not persisted: order on open is store order, as before
    used = tier.used_bytes
    tier.close()
    no_scan(monkeypatch)
    again = DiskTier(tmp_path, 1 << 20)
    kept = [hs[0], *hs[2:]]
    assert list(again.lru_order()) == kept and again.used_bytes == used
    assert [again.fingerprint_of(h) for h in kept] == [fps[0], *fps[2:]]
    assert_served(again, kept, [data[0], *data[2:]], [fps[0], *fps[2:]])
    again.check()
    again.close()


def test_a_directory_written_by_the_previous_release_is_indexed_once(tmp_path, monkeypatch):
    """Main's layout (record format v2 in the main database, no index) as an older release
    writes it: it opens with every block, in store order, and its index is persisted so the
    next open reads only that."""
    hs, data = hashes(4), blocks(4)
    fps = fingerprints(hs)
    env = lmdb.open(str(tmp_path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for seq, (h, b, fp) in enumerate(zip(hs, data, fps), 1):
            txn.put(h, bytes(encode_record(NS, b, 10 - seq, fp)))  # seq order: the reverse of key order
    env.close()
    assert not (tmp_path / "index").exists()
    tier = DiskTier(tmp_path, 1 << 20)
    assert list(tier.lru_order()) == hs[::-1]
    assert_served(tier, hs, data, fps)
    tier.check()
    tier.close()
    no_scan(monkeypatch)
    again = DiskTier(tmp_path, 1 << 20)
    assert list(again.lru_order()) == hs[::-1]
    assert [again.fingerprint_of(h) for h in hs] == fps
    again.check()
    again.close()


@pytest.mark.parametrize("lag", ["index_update_lost", "index_removed", "records_written_elsewhere"])
def test_an_index_that_does_not_match_the_records_is_rebuilt(tmp_path, monkeypatch, lag):
    """A crash between the records' commit and the index's (the update lost), a deleted
    index, or records written by another process: the next open rebuilds from the records."""
    hs, data = hashes(3), blocks(3)
    fps = fingerprints(hs)
    tier = DiskTier(tmp_path, 1 << 20)
    write(tier, hs[:2], data[:2], fps[:2])
    if lag == "index_update_lost":
        monkeypatch.setattr(DiskIndex, "update", lambda self, puts, deletes, synced: None)
        write(tier, hs[2:], data[2:], fps[2:])
        tier.close()
        monkeypatch.undo()
    elif lag == "index_removed":
        write(tier, hs[2:], data[2:], fps[2:])
        tier.close()
        shutil.rmtree(tmp_path / "index")
    else:
        tier.close()
        env = lmdb.open(str(tmp_path), map_size=1 << 24)
        with env.begin(write=True) as txn:
            txn.put(hs[2], bytes(encode_record(NS, data[2], 99, fps[2])))
        env.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert list(again.lru_order()) == hs
    assert_served(again, hs, data, fps)
    again.check()
    again.close()


def test_a_failed_index_update_is_not_trusted_on_open(tmp_path, monkeypatch):
    """The index's own write fails (its map full): the tier keeps serving, and the next open
    rebuilds rather than load an index that lags."""
    hs, data = hashes(3), blocks(3)
    fps = fingerprints(hs)
    tier = DiskTier(tmp_path, 1 << 20)
    write(tier, hs[:1], data[:1], fps[:1])
    real_put = lmdb.Transaction.put

    class FullIndex:
        def __init__(self, txn):
            self.txn = txn

        def __getattr__(self, name):
            return getattr(self.txn, name)

        def __enter__(self):
            self.txn.__enter__()
            return self

        def __exit__(self, *exc):
            return self.txn.__exit__(*exc)

        def put(self, *args, **kwargs):
            raise lmdb.MapFullError("injected: index map full")

    index_env = tier._index.env
    real_begin = index_env.begin
    monkeypatch.setattr(tier._index, "env", type("Env", (), {
        "begin": lambda self, **kw: FullIndex(real_begin(**kw)),
        "close": lambda self: index_env.close(),
    })())
    write(tier, hs[1:], data[1:], fps[1:])
    assert not tier._index.valid and real_put is lmdb.Transaction.put
    assert_served(tier, hs, data, fps)
    tier.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert list(again.lru_order()) == hs
    again.check()
    again.close()


def _damage(index_dir, how):
    data = index_dir / "data.mdb"
    if how == "garbage":
        data.write_bytes(b"\x5a" * data.stat().st_size)
    elif how == "first-8KiB":
        with open(data, "r+b") as f:
            f.write(b"\xff" * 8192)
    elif how == "tiny":
        with open(data, "r+b") as f:
            f.truncate(100)
    elif how == "half":  # a partial copy: LMDB would read pages past the end (a SIGBUS)
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    elif how == "btree-pages":  # the two meta pages kept, every other page overwritten
        size = data.stat().st_size
        with open(data, "r+b") as f:
            f.seek(8192)
            f.write(b"\xa5" * (size - 8192))
    elif how == "file-in-place":
        shutil.rmtree(index_dir)
        index_dir.write_bytes(b"not an index")
    elif how == "dir-as-data":
        data.unlink()
        data.mkdir()


@pytest.mark.parametrize("how", ["garbage", "first-8KiB", "tiny", "half", "btree-pages", "file-in-place", "dir-as-data"])
def test_a_damaged_index_is_removed_and_rebuilt_from_the_records(tmp_path, how):
    hs, data = hashes(6), blocks(6)
    fps = fingerprints(hs)
    tier = DiskTier(tmp_path, 1 << 20)
    write(tier, hs, data, fps)
    tier.close()
    _damage(tmp_path / "index", how)
    again = DiskTier(tmp_path, 1 << 20)  # never raises, never a SIGBUS
    assert_served(again, hs, data, fps)
    again.check()
    again.close()
    reopened = DiskTier(tmp_path, 1 << 20)  # the rebuilt index is the one used now
    assert list(reopened.lru_order()) == hs
    reopened.check()
    reopened.close()


def test_another_directorys_index_with_the_same_history_is_not_trusted(tmp_path):
    """Two tiers written the same way have the same last transaction id and entry count:
    the index also names its records file (its inode), so a copied-in index never matches."""
    a, b = tmp_path / "a", tmp_path / "b"
    ha, hb = hashes(5, "a"), hashes(5, "b")
    da, db = blocks(5, seed=1), blocks(5, seed=2)
    for path, hs, data in ((a, ha, da), (b, hb, db)):
        tier = DiskTier(path, 1 << 20)
        write(tier, hs, data, fingerprints(hs))
        tier.close()
    shutil.rmtree(a / "index")
    shutil.copytree(b / "index", a / "index")
    tier = DiskTier(a, 1 << 20)
    assert all(h in tier for h in ha) and not any(h in tier for h in hb)
    assert_served(tier, ha, da, fingerprints(ha))
    tier.check()
    assert tier.used_bytes == 5 * tier.footprint(da[0].numel() * da.element_size())


def test_without_room_for_an_index_the_tier_scans_its_records(tmp_path, monkeypatch):
    """A new index needs 64 MiB free; on a fuller filesystem none is created (LMDB's files
    are sparse maps: a write into one on a full filesystem is a SIGBUS) and every open scans
    the records' headers, as before the index."""
    from kvtier.tiers import disk_index

    hs, data = hashes(3), blocks(3)
    fps = fingerprints(hs)
    tier = DiskTier(tmp_path, 1 << 20)
    write(tier, hs, data, fps)
    tier.close()
    shutil.rmtree(tmp_path / "index")  # a directory of an older release
    monkeypatch.setattr(disk_index, "_has_room", lambda directory: False)
    again = DiskTier(tmp_path, 1 << 20)
    assert not (tmp_path / "index").exists()
    assert_served(again, hs, data, fps)
    again.check()


def test_the_index_keeps_no_lock_file(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    write(tier, hashes(1), blocks(1), fingerprints(hashes(1)))
    tier.close()
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == ["data.mdb"]
