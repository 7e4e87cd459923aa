"""The DISK tier's index, kept apart from its records so that opening reads O(blocks) bytes.

Opening a DISK tier used to rebuild its index (hash -> footprint, fingerprint, store order)
from every record's header through the memory map; with the kernel's readahead that pulled
in most of each record (0.55 s for 475 MB after a page-cache drop; tens of seconds for a full
16 GiB tier: issue 17). The index now lives in a small LMDB environment of its own
(``<disk dir>/index``), one 73-byte entry per record, updated after every write transaction
of the records' environment.

Consistency: the index records which records environment it matches and in which state
(``synced``: the inode of its ``data.mdb``, so that another directory's index copied in never
matches, its last transaction id and its entry count). A crash between the two commits, a write by another release
or by :func:`kvtier.tiers.disk.clear_directory`, a failed index update or a missing index all
leave ``synced`` different from the records environment's, and the tier then rebuilds the
index from the records' headers once (as before) and persists it. Reads never trust the
index alone: every record is still verified against its own header and checksum
(:func:`kvtier.records.decode_into`). An index that cannot be opened or read (not an LMDB
environment, truncated, corrupt, a file in its place) is removed and written anew from the
records; where no index can be kept (no room to create one), the tier scans its records on
every open, as before the index (:func:`open_index`).
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Iterable, NamedTuple

try:
    import lmdb
except ImportError:  # kvtier.tiers.disk refuses to open without it
    lmdb = None  # type: ignore[assignment]

from kvtier.types import BlockHash

logger = logging.getLogger(__name__)

INDEX_VERSION = b"2"
_ENTRY = struct.Struct("<QQ32s?")  # seq, footprint bytes, fingerprint, another release's record
_SYNCED = struct.Struct("<QQQ")  # records environment: data.mdb's inode, last transaction id, entries
_CREATE_ROOM_BYTES = 64 << 20  # free space needed to create an index (its first pages and slack)


class IndexDamaged(Exception):
    """The persisted index cannot be read: it is removed and rebuilt from the records."""


class IndexEntry(NamedTuple):
    """One record as the index knows it."""

    seq: int  # the writer's store sequence (LRU order on open); 0 for another release's record
    footprint: int  # bytes, page-rounded (kvtier.tiers.disk.record_footprint)
    fingerprint: bytes  # the record's token fingerprint, 32 bytes
    foreign: bool  # a record of another format version: kept, never served


class DiskIndex:
    """The persisted index of one DISK directory.

    Args:
        path: the index environment's directory (created if missing).
        map_size: LMDB map size, bytes (virtual; the file grows with the entries).

    Raises:
        lmdb.Error: the directory cannot be opened.
    """

    def __init__(self, path: Path, map_size: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        # No writemap: the index's few KB per transaction go through pwrite, so a full
        # filesystem is an lmdb.Error (the index turns invalid, rebuilt on the next open),
        # never a SIGBUS on a sparse map. No lock file (lock=False): the DISK tier's own
        # directory lock admits one process, and LMDB's lock.mdb is itself a sparse map (a
        # SIGBUS on a full filesystem). sync=False: committed writes survive kill -9.
        self.env = lmdb.open(str(path), map_size=map_size, max_dbs=2, writemap=False, sync=False,
                             metasync=False, readahead=False, lock=False)
        try:
            _check_length(self.env, path / "data.mdb")
            self._entries = self.env.open_db(b"entries")
            self._meta = self.env.open_db(b"meta")
        except BaseException:
            self.env.close()
            raise
        self.valid = True  # False after a failed update: later updates are not written

    def load(self, synced: tuple[int, int, int]) -> dict[BlockHash, IndexEntry] | None:
        """Every entry, or ``None`` when the index does not match the records environment
        whose (inode, last transaction id, entries) is ``synced``, or is not well-formed.

        Raises:
            IndexDamaged: LMDB could not read it (remove it and rebuild).
        """
        try:
            return self._load(synced)
        except lmdb.Error as exc:
            raise IndexDamaged(str(exc)) from exc

    def _load(self, synced: tuple[int, int, int]) -> dict[BlockHash, IndexEntry] | None:
        with self.env.begin() as txn:
            if (txn.get(b"version", db=self._meta) != INDEX_VERSION
                    or txn.get(b"synced", db=self._meta) != _SYNCED.pack(*synced)):
                return None
            entries: dict[BlockHash, IndexEntry] = {}
            for key, value in txn.cursor(db=self._entries):
                if len(value) != _ENTRY.size:
                    return None
                entries[BlockHash(bytes(key))] = IndexEntry(*_ENTRY.unpack(value))
            return entries

    def rewrite(self, entries: dict[BlockHash, IndexEntry], synced: tuple[int, int, int]) -> None:
        """Replace the whole index with ``entries``, matching ``synced``. A failure leaves
        it invalid (the next open rebuilds)."""
        try:
            with self.env.begin(write=True) as txn:
                txn.drop(self._entries, delete=False)
                for h, entry in entries.items():
                    txn.put(h, _ENTRY.pack(*entry), db=self._entries)
                txn.put(b"version", INDEX_VERSION, db=self._meta)
                txn.put(b"synced", _SYNCED.pack(*synced), db=self._meta)
            self.valid = True
        except lmdb.Error as exc:
            self.valid = False
            logger.warning("DISK index not written (the next open rebuilds it): %s", str(exc))

    def update(
        self, puts: Iterable[tuple[BlockHash, IndexEntry]], deletes: Iterable[BlockHash], synced: tuple[int, int, int]
    ) -> None:
        """Apply one committed write transaction of the records environment. After a failure
        the index stops claiming to be in sync (the next open rebuilds it)."""
        if not self.valid:
            return
        try:
            with self.env.begin(write=True) as txn:
                for h in deletes:
                    txn.delete(h, db=self._entries)
                for h, entry in puts:
                    txn.put(h, _ENTRY.pack(*entry), db=self._entries)
                txn.put(b"synced", _SYNCED.pack(*synced), db=self._meta)
        except lmdb.Error as exc:
            self.valid = False
            logger.warning("DISK index update failed (the next open rebuilds it): %s", str(exc))
            try:  # an index that may lag must not claim to match a later state
                with self.env.begin(write=True) as txn:
                    txn.delete(b"synced", db=self._meta)
            except lmdb.Error:
                pass  # a full map: nothing was written either, and synced is behind

    def snapshot(self) -> dict[BlockHash, IndexEntry]:
        """Every entry (for invariant checks)."""
        with self.env.begin() as txn:
            return {BlockHash(bytes(k)): IndexEntry(*_ENTRY.unpack(v)) for k, v in txn.cursor(db=self._entries)}

    def close(self) -> None:
        self.env.close()


def open_index(path: Path, map_size: int) -> DiskIndex | None:
    """The persisted index in ``path``, or ``None`` where none can be kept (the tier then
    scans its records' headers on every open). What is in ``path`` and cannot be opened as
    an index (garbage, a truncated or corrupt file, a file where the directory should be)
    is removed and the index created anew, which needs 64 MiB free on the filesystem."""
    for attempt in range(2):
        try:
            if not path.exists() and not _has_room(path.parent):
                logger.warning("DISK index not kept: under %d MiB free beside %s", _CREATE_ROOM_BYTES >> 20, path)
                return None
            return DiskIndex(path, map_size)
        except (lmdb.Error, OSError, IndexDamaged) as exc:
            logger.warning("DISK index %s unreadable (%s): removed, rebuilt from the records", path, exc)
            if not remove_index(path):
                return None
    return None


def remove_index(path: Path) -> bool:
    """Remove what is at ``path`` (the index directory, or a file in its place). Returns
    whether nothing is left there."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    except OSError as exc:
        logger.warning("DISK index %s could not be removed: %s", path, exc)
    return not (path.exists() or path.is_symlink())


def _has_room(directory: Path) -> bool:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize >= _CREATE_ROOM_BYTES


def _check_length(env, data_file: Path) -> None:
    """LMDB reads its pages through a map: a page past the end of a truncated file is a
    SIGBUS, not an error. The file must hold every page its meta page names."""
    pages = env.info()["last_pgno"] + 1
    if data_file.stat().st_size < pages * env.stat()["psize"]:
        raise IndexDamaged(f"{data_file} is shorter than its {pages} pages")
