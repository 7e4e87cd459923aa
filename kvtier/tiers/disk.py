"""DISK tier: an LMDB environment with one record per block, a byte cap and LRU order.

Record value = a block record (:mod:`kvtier.records`: 128-byte header + raw block bytes);
key = the block hash. Every read is verified (magic, version, namespace, dtype, shape, size,
checksum); a record that fails is reported as ``CORRUPT`` and dropped, never served (case D1).
The index keeps each record's token fingerprint (from its header) and every read checks the
record against the caller's expected fingerprint (or the index's): a record of other tokens
is ``TOKEN_MISMATCH``, never served, and stays (it is intact, and its own prompt's).

Records of another format version (another kvtier release sharing the directory) are kept,
never served and never counted as blocks: they count in ``used_bytes`` and are the first to
go when a write needs room (dropped lazily, oldest key order first), so opening a directory
with a release of another version does not wipe it.

Durability: the environment is opened with ``writemap=True, sync=False``: a committed write
transaction is in the shared page cache, so it survives a ``kill -9`` of the process (LMDB
writes the meta page last, so a crash mid-transaction leaves the previous state);
:meth:`DiskTier.flush` fsyncs for power-loss durability. The index (hash -> footprint,
fingerprint, LRU order by store sequence) is persisted apart from the records
(:mod:`kvtier.tiers.disk_index`), so reopening reads a few bytes per block; when it does not
match the records (a crash between the two commits, a directory written by an older release)
it is rebuilt once from the records' headers.

Writes copy each block once: LMDB copies a CPU pool slot, framed by the 128 bytes before it,
straight into its map and the header is written over the frame in the transaction's own pages
(:func:`put_record`; py-lmdb has no ``MDB_RESERVE``, and a record built in a buffer first cost a
second memory-bound copy: store() into a full CPU slab in bench/transfers.py went from
0.60-0.71x to 0.70-0.81x of a raw write in three before/after sittings,
bench/results/2026-12-02-perf-disk/README.md; issue 17). Batches of blocks of >= 640 KiB hash each next
victim, and run the caller's copy-in after each put, on the tier's writer thread while LMDB
copies on the caller's (:class:`_WriteOverlap`: store() into a full slab of 2 MiB blocks
0.47-0.52x -> 0.67-0.69x of a raw write, its spill 0.69-0.77x -> 0.87-1.00x, same process,
bench/results/2026-12-02-overlap/); the caller never waits for a hash, a header whose hash is
still running is written before the commit (0.57x -> 0.69-0.71x on a later VM,
bench/results/2026-12-03-deferred-headers/).

Reads copy the payload straight out of LMDB's map into the destination (one copy, hashed
chunk by chunk while hot: :func:`kvtier.records.decode_into`); a cold record comes in by
the kernel's fault readahead (``read_ahead_kb``, 8 MiB on the test VM), in 2 MiB folios
mapped one PMD each: the map is advised ``MADV_HUGEPAGE`` (:func:`advise_huge_pages`). Measured and left
out (bench/results/2026-12-01-perf/disk.txt): ``pread`` into the destination (slower when
warm), and ``MADV_RANDOM`` plus ``MADV_WILLNEED`` per record (cold reads 20x slower).

Accounting: ``used_bytes`` is the sum of record footprints, each rounded up to whole LMDB
pages as LMDB stores large values on overflow pages; it never exceeds ``capacity_bytes``.
One process writes a directory at a time (the daemon is how processes share a cache).
Threads: reads (:meth:`DiskTier.read_into`) may run on many I/O threads at once and never
touch the index; index changes and writes take the tier's lock.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

try:
    import lmdb
except ImportError:  # only the DISK tier needs it; GPU/CPU tiers run without
    lmdb = None  # type: ignore[assignment]

from kvtier.records import (
    HEADER_NBYTES, VERSION, BlockPlaces, ReadStatus, decode_into, decode_into_places, decode_into_view, encode_header,
    encode_record, parse_header, record_version,
)
from kvtier.tiers.disk_index import DiskIndex, IndexDamaged, IndexEntry, open_index, remove_index
from kvtier.tiers.host_memory import MADV_HUGEPAGE
from kvtier.tiers.lru import SegmentedLRU
from kvtier.types import NO_FINGERPRINT, BlockHash, Fingerprint, Medium

logger = logging.getLogger(__name__)

_OVERFLOW_PAGE_HEADER = 16  # bytes LMDB reserves at the start of an overflow page run

DISK_TXN_BYTES = 64 << 20
"""Bytes of blocks per LMDB write transaction of a spill (kvtier.store.placement) or a DISK
write job (kvtier.transfer.handlers). The map holds two of them beyond the cap (LMDB reuses no
page freed by the current transaction or the one before it, so a tier kept full by spills
needs that room: without it a 200 MiB tier's spills failed with ``MDB_MAP_FULL`` from the third
on, for good; the hostile review of issue 17's deferred headers). A store into a full CPU slab
ran at 0.66x of a raw write with 32 MiB transactions, 0.68-0.71x with 64 MiB and 0.71-0.72x
with 128 MiB (bench/results/2026-12-03-deferred-headers/txn_bytes.txt): each transaction ends
with the writer thread's last hash and copy-in, then the commit, one thread waiting on the
other; 128 MiB was within the runs' spread and would double the map's slack, so 64 MiB stays."""


def txn_blocks(block_nbytes: int) -> int:
    """Blocks of ``block_nbytes`` bytes per write transaction: :data:`DISK_TXN_BYTES`' worth,
    at least one."""
    return max(1, DISK_TXN_BYTES // block_nbytes)


class DiskTier:
    """LMDB-backed block store.

    Args:
        path: directory of the LMDB environment (created if missing).
        capacity_bytes: cap on the sum of record footprints, bytes.

    Raises:
        ValueError: ``capacity_bytes`` < one page.
        ImportError: the ``lmdb`` package is not installed.
        RuntimeError: another store has the directory open.
        lmdb.Error: the directory cannot be opened (permissions, not an LMDB environment).
    """

    medium = Medium.DISK

    def __init__(self, path: str | os.PathLike, capacity_bytes: int) -> None:
        if lmdb is None:
            raise ImportError("the DISK tier needs the lmdb package: pip install lmdb (or set disk_bytes=0)")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock_directory(self.path)
        # Slack for B-tree pages, pages freed by transactions still visible to a reader, and
        # the pages the last two write transactions freed (not reusable yet: DISK_TXN_BYTES).
        map_size = capacity_bytes + capacity_bytes // 4 + 2 * DISK_TXN_BYTES + (64 << 20)
        self.env = lmdb.open(
            str(self.path), map_size=map_size, writemap=True, sync=False, metasync=False,
            max_dbs=0, max_readers=512, readahead=True,
        )
        self.huge_page_map = advise_huge_pages(self.path / "data.mdb", self.env.info()["map_size"])
        self.page_nbytes: int = self.env.stat()["psize"]
        # which records file the persisted index must belong to (kvtier.tiers.disk_index):
        # fixed while the environment is open, so read once here, not on every write
        self._records_ino = (self.path / "data.mdb").stat().st_ino
        if capacity_bytes < self.page_nbytes:
            raise ValueError(f"expected DISK capacity >= {self.page_nbytes} bytes, got {capacity_bytes}")
        # ~120 B per entry, at most one entry per page of records, B-tree slack: capacity / 16
        self._index_map_size = (64 << 20) + capacity_bytes // 16
        self._index: DiskIndex | None = open_index(self.path / "index", self._index_map_size)
        self.capacity_bytes = capacity_bytes
        self._lru: SegmentedLRU[BlockHash, int] = SegmentedLRU(max_ghosts=1 << 16)  # hash -> footprint bytes
        self._fingerprints: dict[BlockHash, Fingerprint] = {}  # hash -> the record's token fingerprint
        self._foreign: dict[BlockHash, int] = {}  # records of another version -> footprint, drop order
        self._foreign_used = 0
        self._used = 0  # footprints of every record, other versions' included
        self._seq = 0
        self._lock = threading.RLock()
        self._writer: ThreadPoolExecutor | None = None  # started by the first overlapped write
        self.read_only = False
        self._rebuild_index()

    def after_fork_in_child(self) -> None:
        """In a forked child: a read-only view. The parent's LMDB environment must not be
        used across fork (its reader slots would carry the parent's pid), so the child opens
        its own, read-only; writes are refused (the parent owns the directory and its index).
        """
        self.env.close()  # the child's handle only: the parent's mapping, locks and slots stay
        self.env = lmdb.open(str(self.path), readonly=True, lock=True, max_readers=512, readahead=True)
        self.huge_page_map = advise_huge_pages(self.path / "data.mdb", self.env.info()["map_size"])
        if self._index is not None:
            self._index.close()  # the child's handle only; it never writes
            self._index = None
        self._lock = threading.RLock()
        self._writer = None  # the parent's thread is not in the child (and the child never writes)
        self.read_only = True
        self._lock_file = None  # the parent's flock stays the parent's

    # -- accounting ------------------------------------------------------------------------
    def footprint(self, payload_nbytes: int) -> int:
        """Bytes one record of ``payload_nbytes`` occupies in the database (page-rounded)."""
        return record_footprint(payload_nbytes, self.page_nbytes)

    def footprint_of(self, block_hash: BlockHash) -> int:
        """Footprint (bytes) of a stored record."""
        return self._lru[block_hash]

    def fingerprint_of(self, block_hash: BlockHash) -> Fingerprint | None:
        """The token fingerprint of a stored record (from its header), ``None`` if absent."""
        return self._fingerprints.get(block_hash)

    @property
    def used_bytes(self) -> int:
        """Footprints of every record in the database, other versions' included."""
        return self._used

    @property
    def foreign_bytes(self) -> int:
        """Footprints of the records of another format version (dropped first when a write
        needs room)."""
        return self._foreign_used

    @property
    def free_bytes(self) -> int:
        """Room for new records: the cap less this version's records (another version's
        records make way for new ones)."""
        return self.capacity_bytes - self._used + self._foreign_used

    def free_bytes_after(self, pending: Iterable[BlockHash], payload_nbytes: int) -> int:
        """Bytes still free once the writes of ``pending`` (records of ``payload_nbytes``
        each, submitted but maybe not yet committed) land: those already in the index count
        once, in ``used_bytes``; another version's records are free room, as in
        :attr:`free_bytes`. Read under the tier's lock, so a write committing meanwhile is
        counted exactly once."""
        with self._lock:
            not_landed = sum(1 for h in pending if h not in self._lru)
            return self.free_bytes - not_landed * self.footprint(payload_nbytes)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def lru_order(self) -> Iterator[BlockHash]:
        """Block hashes in eviction order (kvtier.tiers.lru); a snapshot."""
        with self._lock:
            return iter(list(self._lru.eviction_order()))

    def was_evicted(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` was evicted from DISK recently (the last 65,536 victims of
        this process; not remembered across restarts) and not written again since."""
        with self._lock:
            return self._lru.was_evicted(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """A use: most recent, protected from scans."""
        with self._lock:
            if block_hash in self._lru:
                self._lru.touch(block_hash)

    def touch_many(self, block_hashes: Sequence[BlockHash]) -> None:
        """:meth:`touch` of each of ``block_hashes`` held here, in order (others skipped)."""
        with self._lock:
            self._lru.touch_many(block_hashes)

    def refresh(self, block_hash: BlockHash) -> None:
        with self._lock:
            if block_hash in self._lru:
                self._lru.refresh(block_hash)

    # -- writes ----------------------------------------------------------------------------
    def write_batch(
        self,
        puts: Sequence[tuple[BlockHash, bytes, torch.Tensor]] = (),
        deletes: Sequence[BlockHash] = (),
        evicted: bool = True,
        after_put: Callable[[int], None] | None = None,
    ) -> list[bool]:
        """Delete ``deletes`` and write ``puts`` in one LMDB write transaction.

        Args:
            puts: ``(block_hash, namespace, block[, fingerprint[, digest]])`` with ``block`` a
                contiguous CPU tensor of one block (``[num_layers, 2, block_size,
                num_kv_heads, head_dim]``), ``fingerprint`` its token fingerprint (default
                :data:`~kvtier.types.NO_FINGERPRINT`) and ``digest`` the xxh3-64 of its bytes
                when known (a pool slot's :meth:`~kvtier.tiers.pool.BlockPool.payload_digest_at`;
                default ``None``: the block is hashed here).
            deletes: hashes to drop.
            evicted: the deletes make room (remembered by the eviction policy).
            after_put: called with ``i`` as soon as ``puts[i]``'s record is in the
                transaction (LMDB has copied its block: the block's memory may be reused from
                then on, while it is still in cache; kvtier.store.placement). Not called for
                a put that was skipped or refused; must not raise. The transaction may still
                fail to commit afterwards (every result ``False`` then).

        Returns:
            one bool per put: ``True`` when stored (or already present), ``False`` when it did
            not fit (the caller must make room first; the cap is never exceeded) or the disk
            or map is full (D3: a failed store is a return value, stored blocks stay readable).

        Raises:
            ValueError: a block hash appears twice in ``puts`` (nothing is written).
        """
        if len({put[0] for put in puts}) != len(puts):
            raise ValueError("expected distinct block hashes in one write_batch, got a repeated one")
        if self.read_only:
            return [False] * len(puts)
        with self._lock:
            return self._write_batch(puts, deletes, evicted, after_put)

    def _write_batch(self, puts, deletes, evicted, after_put=None) -> list[bool]:
        results: list[bool] = []
        sizes = [put[2].numel() * put[2].element_size() for put in puts]
        if puts and not self._filesystem_has_room(sum(sizes)):
            logger.warning("DISK: filesystem of %s is full; %d blocks not written", self.path, len(puts))
            return [False] * len(puts)
        foreign = iter(list(self._foreign.items()))
        dropped: list[BlockHash] = []  # records of another version dropped to make room
        gone = set(deletes)
        overlap = self._overlap(puts, gone, min(sizes, default=0))
        try:
            with self.env.begin(write=True, buffers=True) as txn:  # buffers: see put_record
                for h in deletes:
                    txn.delete(h)
                used = self._used - sum(self._lru.get(h, 0) for h in gone)
                staged: list[tuple[BlockHash, IndexEntry]] = []
                for i, (h, namespace, block, *rest) in enumerate(puts):
                    if self._kept(h, gone):
                        results.append(True)
                        continue
                    fingerprint = rest[0] if rest else NO_FINGERPRINT
                    digest = rest[1] if len(rest) > 1 else None
                    size = self.footprint(sizes[i])
                    if h in self._foreign and h not in dropped:  # overwritten below
                        used -= self._foreign[h]
                        dropped.append(h)
                    while used + size > self.capacity_bytes and (old := next(foreign, None)) is not None:
                        if old[0] not in dropped:
                            txn.delete(old[0])
                            used -= old[1]
                            dropped.append(old[0])
                    if used + size > self.capacity_bytes:
                        results.append(False)
                        continue
                    self._seq += 1
                    if overlap is None:
                        put_record(txn, h, namespace, block, self._seq, fingerprint, digest=digest)
                        if after_put is not None:
                            after_put(i)
                    else:
                        overlap.put(txn, i, h, namespace, block, self._seq, fingerprint, digest)
                        if after_put is not None:
                            overlap.after_put(after_put, i)
                    used += size
                    staged.append((h, IndexEntry(self._seq, size, fingerprint, False)))
                    results.append(True)
                if overlap is not None:
                    overlap.write_headers(txn)  # every record's header before the commit
                    overlap.finish()  # a copy-in that raised aborts the transaction, as on one thread
        except (lmdb.Error, OSError, struct.error) as exc:
            # Nothing of this transaction is visible; the index is unchanged.
            logger.warning("DISK write of %d blocks failed: %s", len(puts), str(exc))  # text, not the exception
            return [False] * len(puts)
        finally:
            if overlap is not None:  # after an error: every copy-in done before the caller frees a slot
                overlap.finish()
        for h in deletes:
            self._forget(h, evicted)
        for h in dropped:
            size = self._foreign.pop(h)
            self._used -= size
            self._foreign_used -= size
        for h, entry in staged:
            self._lru.add(h, entry.footprint)
            self._fingerprints[h] = entry.fingerprint
            self._used += entry.footprint
        self._update_index(staged, [*deletes, *dropped])
        return results

    def _kept(self, block_hash: BlockHash, gone: set[BlockHash]) -> bool:
        """A put of ``block_hash`` is skipped: it is stored and not among the batch's deletes."""
        return block_hash in self._lru and block_hash not in gone

    def _overlap(self, puts: Sequence, gone: set[BlockHash], min_nbytes: int) -> "_WriteOverlap | None":
        """The writer thread's part of a batch of ``puts`` (:class:`_WriteOverlap`), or
        ``None`` for a batch too small for it to pay (under two blocks, or its smallest block,
        ``min_nbytes`` bytes, under :data:`OVERLAP_MIN_NBYTES`). ``gone``: the batch's deletes."""
        if len(puts) < 2 or min_nbytes < OVERLAP_MIN_NBYTES:
            return None
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-write")
        seqs, seq = {}, self._seq
        for i, put in enumerate(puts):  # the sequence each put gets if none is refused for room
            if not self._kept(put[0], gone):
                seq += 1
                seqs[i] = seq
        return _WriteOverlap(self._writer, puts, seqs, self.page_nbytes)

    def _synced(self) -> tuple[int, int, int]:
        """The records environment's (data.mdb's inode, last transaction id, entries): what the
        persisted index must match (kvtier.tiers.disk_index; the inode so that another
        directory's index with the same history never matches)."""
        return self._records_ino, self.env.info()["last_txnid"], self.env.stat()["entries"]

    def _update_index(self, puts: Sequence[tuple[BlockHash, IndexEntry]], deletes: Sequence[BlockHash]) -> None:
        """Record a committed write transaction in the persisted index (under the lock)."""
        if self._index is not None and (puts or deletes):
            self._index.update(puts, deletes, self._synced())

    def _filesystem_has_room(self, nbytes: int) -> bool:
        """With ``writemap`` a write into a sparse map file on a full filesystem is a SIGBUS,
        not an error: check the free space (plus 64 MiB for LMDB's own pages) first."""
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize >= nbytes + (64 << 20)

    def remove(self, block_hashes: Sequence[BlockHash]) -> None:
        """Drop records (not an eviction: corrupt or unwanted). Missing hashes are ignored."""
        if self.read_only:
            return
        with self._lock:
            self._write_batch((), [h for h in block_hashes if h in self._lru], False)

    def clear(self) -> int:
        """Drop every record in one write transaction and fsync (a reset: it must not come
        back after a power loss). Returns the records dropped. Reads in flight finish on the
        snapshot they began with (LMDB's MVCC).

        Raises:
            RuntimeError: a read-only view (a forked child's): the parent owns the directory.
        """
        if self.read_only:
            raise RuntimeError(f"DISK tier at {self.path} is read-only in this process (forked); "
                               "reset it from the process that opened it")
        with self._lock:
            dropped = _drop_all(self.env)
            self._lru.clear()
            self._fingerprints.clear()
            self._foreign.clear()
            self._used = self._foreign_used = 0
            if self._index is not None:
                self._index.rewrite({}, self._synced())
            return dropped

    def _forget(self, block_hash: BlockHash, evicted: bool = False) -> None:
        if block_hash in self._lru:
            self._used -= self._lru.pop(block_hash, evicted=evicted)
            self._fingerprints.pop(block_hash, None)

    # -- reads -----------------------------------------------------------------------------
    def read_into(
        self, block_hash: BlockHash, namespace: bytes, out: torch.Tensor, fingerprint: Fingerprint | None = None
    ) -> ReadStatus:
        """Copy the block's bytes into ``out`` (a contiguous CPU tensor of the block's shape
        and dtype) and verify it against ``fingerprint`` (the request's; ``None``: the one
        the index holds for it). Unless ``OK`` the content of ``out`` is unspecified (the
        caller must not use it). Thread-safe; changes no index state (the caller drops
        CORRUPT records with :meth:`remove` and counts the use with :meth:`touch`)."""
        expected = fingerprint if fingerprint is not None else self._fingerprints.get(block_hash)
        with self.env.begin(buffers=True) as txn:
            value = txn.get(block_hash)
            if value is None:
                return ReadStatus.MISSING
            return decode_into(value, namespace, out, expected)

    def read_into_views(
        self, block_hashes: Sequence[BlockHash], namespace: bytes, views: "Sequence[torch.Tensor] | BlockPlaces",
        fingerprints: Sequence[Fingerprint | None],
    ) -> list[ReadStatus]:
        """:meth:`read_into` of several blocks, each straight into its place in a caller's
        buffer (``views``: tensors of the block's shape and dtype, any strides, or a
        :class:`~kvtier.records.BlockPlaces`), verified while it is copied (one pass over its
        bytes: :func:`kvtier.records.decode_into_places` for places, all of them in one
        kernel call; :func:`kvtier.records.decode_into_view` per tensor), from one read
        transaction. ``fingerprints``: ``[n]``, as for :meth:`read_into`. Returns each block's
        status; a view whose block is not ``OK`` must not be used. Thread-safe; changes no
        index state, as :meth:`read_into`."""
        expected = [f if f is not None else self._fingerprints.get(h) for h, f in zip(block_hashes, fingerprints)]
        with self.env.begin(buffers=True) as txn:
            values = [txn.get(h) for h in block_hashes]
            if isinstance(views, BlockPlaces):
                return decode_into_places(values, namespace, views, expected)
            return [ReadStatus.MISSING if value is None else decode_into_view(value, namespace, view, fingerprint)
                    for value, view, fingerprint in zip(values, views, expected)]

    # -- lifecycle -------------------------------------------------------------------------
    def flush(self) -> None:
        """fsync the environment (committed writes already survive a process crash)."""
        if not self.read_only:
            self.env.sync(True)

    def close(self) -> None:
        if self.env is not None:
            if not self.read_only:
                self.env.sync(True)
            self.env.close()
            self.env = None  # type: ignore[assignment]
            self.abandon_handles()
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None
            if self._lock_file is not None:
                self._lock_file.close()  # drops the flock

    def abandon_handles(self) -> None:
        """After the environment was closed without a sync (kvtier.testing.faults.abandon, a
        simulated crash): close the persisted index too, unsynced, so the directory can be
        reopened in this process."""
        if self._index is not None:
            self._index.close()
            self._index = None

    def _load_index(self, synced: tuple[int, int, int]) -> dict[BlockHash, IndexEntry] | None:
        """The persisted index's entries when it matches ``synced``; ``None`` to rebuild. An
        index LMDB cannot read is removed and created anew (empty) for the rebuild."""
        if self._index is None:
            return None
        try:
            return self._index.load(synced)
        except IndexDamaged as exc:
            logger.warning("DISK index of %s unreadable (%s): rebuilt from the records", self.path, exc)
            self._index.close()
            remove_index(self.path / "index")
            self._index = open_index(self.path / "index", self._index_map_size)
            return None

    def _rebuild_index(self) -> None:
        """Load the persisted index when it matches the records (a few bytes per block);
        else rebuild it from every record's header and persist it (a directory written by
        an older release, or a crash between the records' commit and the index's)."""
        synced = self._synced()
        entries = self._load_index(synced)
        if entries is not None and any(e.footprint <= 0 or e.footprint % self.page_nbytes for e in entries.values()):
            entries = None  # not what this tier writes: trust the records instead
        bad: list[BlockHash] = []
        if entries is None:
            entries, bad = self._scan_records()
            logger.info("DISK: index of %s rebuilt from %d records' headers", self.path, len(entries) + len(bad))
            if self._index is not None:
                self._index.rewrite(entries, synced)
        ours = sorted((e.seq, h, e.footprint, e.fingerprint) for h, e in entries.items() if not e.foreign)
        for seq, h, size, fingerprint in ours:
            self._lru.add(h, size)
            self._fingerprints[h] = fingerprint
            self._used += size
            self._seq = max(self._seq, seq)
        for h, e in sorted(entries.items()):  # key order: the order other versions' records go
            if e.foreign:
                self._foreign[h] = e.footprint
                self._foreign_used += e.footprint
                self._used += e.footprint
        if self._foreign:
            logger.info("DISK: %d records of another format version kept (never served; dropped first for room)",
                        len(self._foreign))
        if bad:
            logger.warning("DISK: dropping %d records with unreadable headers", len(bad))
            self.write_batch(deletes=bad)
        # A smaller cap than the data on disk: drop other versions' records, then the least recently stored.
        if self._used > self.capacity_bytes and self._foreign and not self.read_only:
            self._drop_foreign(self._used - self.capacity_bytes)
        while self._used > self.capacity_bytes and len(self._lru):
            self.remove([next(self._lru.eviction_order())])

    def _scan_records(self) -> tuple[dict[BlockHash, IndexEntry], list[BlockHash]]:
        """Every record's index entry from its header (the slow path: a page or more read
        per record), and the keys of records whose header is unreadable."""
        entries: dict[BlockHash, IndexEntry] = {}
        bad: list[BlockHash] = []
        with self.env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                h = BlockHash(bytes(key))
                header = parse_header(value, len(value))
                if header is not None:
                    entries[h] = IndexEntry(header.seq, self.footprint(header.payload_nbytes),
                                            bytes(header.fingerprint), False)
                elif record_version(value) not in (None, VERSION):  # another release's: kept, never served
                    size = _page_round(len(value) + _OVERFLOW_PAGE_HEADER, self.page_nbytes)
                    entries[h] = IndexEntry(0, size, NO_FINGERPRINT, True)
                else:
                    bad.append(h)
        return entries, bad

    def _drop_foreign(self, nbytes: int) -> None:
        """Delete records of another version, in key order, until ``nbytes`` are freed."""
        drop, freed = [], 0
        for h, size in self._foreign.items():
            if freed >= nbytes:
                break
            drop.append(h)
            freed += size
        with self.env.begin(write=True) as txn:
            for h in drop:
                txn.delete(h)
        for h in drop:
            size = self._foreign.pop(h)
            self._used -= size
            self._foreign_used -= size
        self._update_index((), drop)

    def check(self) -> None:
        """Invariant check for tests: index and database agree (fingerprints too), cap
        respected, other versions' records accounted."""
        on_disk, fingerprints, foreign = {}, {}, {}
        with self.env.begin(buffers=True) as txn:
            for k, v in txn.cursor():
                header = parse_header(v, len(v))
                if header is None:
                    foreign[bytes(k)] = _page_round(len(v) + _OVERFLOW_PAGE_HEADER, self.page_nbytes)
                    continue
                on_disk[bytes(k)] = self.footprint(header.payload_nbytes)
                fingerprints[bytes(k)] = header.fingerprint
        assert on_disk == dict(self._lru.items()), "DISK index and database disagree"
        assert fingerprints == self._fingerprints, "DISK fingerprints and records disagree"
        assert foreign == self._foreign, "DISK records of other versions are not accounted"
        assert self._foreign_used == sum(foreign.values()), "DISK usage of other versions is off"
        assert self._used == sum(on_disk.values()) + self._foreign_used, "DISK usage accounting is off"
        assert self._used <= self.capacity_bytes, "DISK capacity exceeded"
        with self._lock:  # the index env has no lock file: its reads and writes are serialized here
            persisted = self._index.snapshot() if self._index is not None and self._index.valid else None
        if persisted is not None:
            assert {h: e.footprint for h, e in persisted.items() if not e.foreign} == on_disk, "DISK persisted index is off"
            assert {h: e.fingerprint for h, e in persisted.items() if not e.foreign} == fingerprints, \
                "DISK persisted fingerprints are off"
            assert {h: e.footprint for h, e in persisted.items() if e.foreign} == foreign, \
                "DISK persisted index of other versions' records is off"
            with self._lock:
                assert self._index.load(self._synced()) is not None, "DISK persisted index is not marked in sync"


def clear_directory(path: str | os.PathLike) -> int:
    """Empty the DISK tier in ``path`` offline (no store open on it): every record dropped in
    one write transaction, fsynced. Returns the records dropped.

    Raises:
        FileNotFoundError: ``path`` holds no DISK tier (nothing is created).
        RuntimeError: a store (in this process or another) has ``path`` open.
        ImportError: the ``lmdb`` package is not installed.
    """
    path = Path(path)
    if not (path / "data.mdb").is_file():
        raise FileNotFoundError(f"expected a kvtier DISK tier (data.mdb) in {path}")
    if lmdb is None:
        raise ImportError("clearing a DISK tier needs the lmdb package: pip install lmdb")
    lock_file = _lock_directory(path)
    try:
        # room for the freed pages' list on top of what the file holds
        map_size = (path / "data.mdb").stat().st_size + (64 << 20)
        env = lmdb.open(str(path), subdir=True, create=False, max_dbs=0, map_size=map_size)
        try:
            return _drop_all(env)
        finally:
            env.close()
    finally:
        lock_file.close()


def _drop_all(env) -> int:
    """Delete every key of ``env``'s main database in one transaction, then fsync."""
    main_db = env.open_db()  # the unnamed database: a handle, no transaction
    with env.begin(write=True) as txn:
        dropped = txn.stat()["entries"]
        txn.drop(main_db, delete=False)
    env.sync(True)
    return dropped


def advise_huge_pages(path: Path, map_size: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on this process's mappings of the file ``path`` that are
    ``map_size`` bytes long (LMDB's map of ``data.mdb``; py-lmdb does not give its address, so
    it is found in ``/proc/self/maps`` by device and inode). With it, a fault on a record not
    in the page cache reads it in 2 MiB folios mapped by one PMD (the kernel's mmap readahead
    for ``VM_HUGEPAGE``), not 4 KiB pages mapped 64 KiB per fault: a cold ``read_into`` of
    128 records of 2 MiB went from 2.16 to 2.57 GB/s (medians of 8 rounds after
    ``drop_caches``, faster in 8 of 8; raw ``readinto`` of the same bytes 2.49 GB/s), a
    ``write_batch`` into dropped pages from 0.73 to 1.84 GB/s (LMDB's ``writemap`` faults each
    page in before writing it; bench/results/2026-12-02-disk-5). Pages already cached keep
    their folios. Best effort: returns whether any mapping was advised (``False`` off Linux,
    without ``/proc``, or where the kernel refuses the advice: nothing else changes)."""
    if MADV_HUGEPAGE is None:
        return False
    try:
        st = os.stat(path)
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        advised = False
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or int(fields[4]) != st.st_ino:
                    continue
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                if os.makedev(major, minor) != st.st_dev:
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if end - start == map_size and int(fields[2], 16) == 0:
                    advised |= madvise(start, end - start, MADV_HUGEPAGE) == 0
        return advised
    except (OSError, AttributeError, ValueError) as exc:
        logger.debug("no MADV_HUGEPAGE on %s: %s", path, exc)
        return False


OVERLAP_MIN_NBYTES = 640 << 10
"""Smallest block whose writes overlap (:class:`_WriteOverlap`). Below it the two hand-offs a
block makes weigh more against its copies: a store into a full slab of 704 KiB blocks
(SmolLM2-135M's 16 tokens) gained in four of four logged A/B runs (0.38-0.41x -> 0.49-0.53x of a
raw write), of 512 KiB blocks it did not (0.35-0.36x either way), of 256 KiB it lost (0.28x ->
0.19x) (bench/results/2026-12-02-overlap/micro/ab_store.log)."""


class _WriteOverlap:
    """One write transaction's hashes and ``after_put`` copies on the tier's writer thread,
    while LMDB copies the next block into its map on the caller's thread.

    A store into a full CPU slab moves each victim's bytes three times: xxh3 reads it for the
    record's checksum, LMDB copies it into its map and the new block is copied into its slot.
    The transaction must stay on the thread that began it (LMDB's writer mutex), but py-lmdb
    releases the GIL in ``mdb_put``, as xxhash and torch's copies do, so the hash of the next
    victim and the copy-in after the last put run beside the put: each block's hash is
    submitted one put ahead (from its slot, before that slot's copy-in, which the writer runs
    after it). The caller never waits for a hash: once LMDB has copied a block, a hash already
    done is written into the record's header; one the writer has not started is taken back and
    computed on the caller's thread (the slot still in its cache from LMDB's copy); one still
    running is written once done, before the commit (:meth:`write_headers`). Waiting for that
    running hash after every put left the caller idle 17% of a store into a full slab while
    the writer, queued behind the copy-ins, still hashed: store() into a full slab of 2 MiB
    blocks went from 0.57x to 0.69-0.71x of a raw write (issue 17,
    bench/results/2026-12-03-deferred-headers/). Headers are hashed with the sequence each put
    would get; one whose sequence changed (an earlier put refused for room) is hashed again.
    A put that carries its block's digest (the slot's
    :meth:`~kvtier.tiers.pool.BlockPool.payload_digest_at`: :mod:`kvtier.records`) is not
    hashed at all: its header is made on the caller's thread from the digest, and the writer
    thread is left the copy-ins (store() into a full slab of 128 x 2 MiB blocks copied in by
    ``TieredStore.store``: 3.9-4.0 -> 4.5-4.8 GB/s, medians of paired rounds,
    bench/results/2026-12-04-payload-digest/).

    A deferred header is written where the value lay after its own put: only for a value of at
    least ``min_deferred_nbytes`` (the page size; far above LMDB's overflow threshold of about
    half a page), which LMDB keeps on overflow pages of its own that later puts of other keys
    never move (a value in a leaf node moves when the leaf splits), and in a batch that puts
    each key once (:meth:`DiskTier.write_batch` refuses a repeated one). Before the commit each
    one is checked to lie there still (one ``txn.get``, while the caller waits for the writer's
    last work anyway); a value found elsewhere aborts the transaction. Smaller values wait for
    their hash (only where tests lower :data:`OVERLAP_MIN_NBYTES`).

    ``after_put`` calls run on the writer thread, one at a time and in order, under the
    caller's grad and inference modes; :meth:`finish` waits for every one before the batch
    returns (the caller then frees or reuses the slots) and re-raises the first exception
    one raised.
    """

    def __init__(self, writer: ThreadPoolExecutor, puts: Sequence, seqs: dict[int, int],
                 min_deferred_nbytes: int) -> None:
        self._writer, self._puts, self._seqs = writer, puts, seqs
        self._min_deferred_nbytes = min_deferred_nbytes
        self._order = list(seqs)  # put indices, in order
        self._position = {i: p for p, i in enumerate(self._order)}
        self._submitted = 0  # hashes submitted: self._order[:self._submitted]
        self._hashes: dict[int, Future] = {}
        self._deferred: list[tuple[Future, BlockHash, np.ndarray]] = []  # (a running hash, key, stored value)
        self._copies: list[Future] = []
        self._grad, self._inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def put(
        self, txn, i: int, h: BlockHash, namespace: bytes, block: torch.Tensor, seq: int, fingerprint: bytes,
        digest: int | None = None,
    ) -> None:
        """Put ``puts[i]`` (``h``, ``namespace``, ``block``, ``fingerprint``, ``digest``: its
        fields) with sequence ``seq``: :func:`put_record`'s bytes (the header maybe written
        later, by :meth:`write_headers`), whose errors it raises. A put with its ``digest``
        is not hashed: its header is made here (128 bytes hashed)."""
        self._hash_ahead(self._position[i] + 1)
        if digest is not None:
            put_record(txn, h, namespace, block, seq, fingerprint, digest=digest)
            return
        future = self._hashes.pop(i, None)
        if future is not None and self._seqs[i] != seq:
            future.cancel()
            future = None

        def header(value: np.ndarray) -> bytes | None:
            if future is None or (not future.done() and future.cancel()):
                return encode_header(namespace, block, seq, fingerprint)  # not hashed ahead, or taken back
            if future.done() or len(value) < self._min_deferred_nbytes:
                return future.result()
            self._deferred.append((future, h, value))  # running: written before the commit
            return None

        put_record(txn, h, namespace, block, seq, fingerprint, header)

    def write_headers(self, txn) -> None:
        """Write every deferred header (waiting for its hash), then check that each value
        still lies where it was written (``txn.get``); before the commit.

        Raises:
            lmdb.Error: a value moved within the transaction (LMDB kept overflow values in
                place in every version checked; were one to move, the transaction is aborted,
                never committed with a header in the wrong place).
            BaseException: what a hash raised (the entries from it on stay for :meth:`finish`).
        """
        written: list[tuple[BlockHash, np.ndarray]] = []
        while self._deferred:
            future, key, value = self._deferred[0]
            write_header(value, future.result())
            written.append((key, value))
            del self._deferred[0]
        for key, value in written:
            if _stored_value(txn, key, len(value)).ctypes.data != value.ctypes.data:
                raise lmdb.Error(f"record {key.hex()[:16]} moved within its write transaction")

    def after_put(self, fn: Callable[[int], None], i: int) -> None:
        """Run ``fn(i)`` on the writer thread after the work submitted before it. Once the
        interpreter is shutting down (the writer takes no more work), on this thread, after
        everything submitted before it is done: the hashes too, as a hash of this slot may
        still be running (its header deferred) and the copy-in overwrites the slot."""
        future = self._submit(self._in_caller_modes, fn, i)
        if future is None:
            for earlier in self._pending():
                if not earlier.cancelled():
                    earlier.exception()
            future = Future()
            try:
                fn(i)
            except BaseException as exc:  # re-raised by finish(), as from the writer thread
                future.set_exception(exc)
            else:
                future.set_result(None)
        self._copies.append(future)

    def finish(self) -> None:
        """Wait for the writer thread's part of the batch: hashes not started are cancelled;
        running ones are waited for, their results unused (hashed ahead for a put refused for
        room, or left deferred by a failing transaction); then every copy, re-raising the first
        exception one raised."""
        for future in self._hashes.values():
            future.cancel()
        for future in self._hash_futures():
            if not future.cancelled():
                future.exception()  # waited so that nothing of the batch runs after it
        self._hashes.clear()
        self._deferred.clear()
        first: BaseException | None = None
        for future in self._copies:
            exc = future.exception()
            first = first if first is not None else exc
        self._copies.clear()
        if first is not None:
            raise first

    def _hash_futures(self) -> list[Future]:
        """The hashes not yet written: hashed ahead, then deferred."""
        return [*self._hashes.values(), *(future for future, *_ in self._deferred)]

    def _pending(self) -> list[Future]:
        """Every future of the batch submitted so far: copies, then hashes."""
        return [*self._copies, *self._hash_futures()]

    def _hash_ahead(self, last: int) -> None:
        while self._submitted <= min(last, len(self._order) - 1):
            i = self._order[self._submitted]
            self._submitted += 1
            _, namespace, block, *rest = self._puts[i]
            if len(rest) > 1 and rest[1] is not None:  # its digest known: nothing to hash
                continue
            if is_framed(block):
                fingerprint = rest[0] if rest else NO_FINGERPRINT
                future = self._submit(encode_header, namespace, block, self._seqs[i], fingerprint)
                if future is not None:  # else hashed by put() on the caller's thread
                    self._hashes[i] = future

    def _submit(self, fn: Callable, *args) -> Future | None:
        """``fn(*args)`` on the writer thread, or ``None`` when it takes no more work: from
        the start of the interpreter's shutdown on (``concurrent.futures`` refuses new work
        before ``atexit`` handlers run, and a store closed from one still flushes its memory
        to DISK: the batch goes on on the caller's thread)."""
        try:
            return self._writer.submit(fn, *args)
        except RuntimeError:
            return None

    def _in_caller_modes(self, fn: Callable[[int], None], i: int) -> None:
        with torch.inference_mode(self._inference), torch.set_grad_enabled(self._grad):
            fn(i)


def _lock_directory(path: Path):
    """Hold an exclusive ``flock`` on ``path/kvtier.lock`` for the tier's lifetime: a second
    writer would keep its own index and break the cap and the accounting.

    Raises:
        RuntimeError: another DiskTier (this process or another) has the directory open.
    """
    import fcntl

    lock_file = open(path / "kvtier.lock", "a+b")
    try:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        raise RuntimeError(
            f"{path} is in use by another kvtier store; use another data_dir, or share one cache "
            "between processes through the kvtier daemon"
        ) from None
    return lock_file


def put_record(
    txn, key: bytes, namespace: bytes, block: torch.Tensor, seq: int, fingerprint: bytes,
    header: Callable[[np.ndarray], bytes | None] | None = None, digest: int | None = None,
) -> None:
    """Write ``block``'s record (:func:`kvtier.records.encode_record`'s bytes exactly) under
    ``key`` in the LMDB write transaction ``txn`` (begun with ``buffers=True``), copying the
    block's bytes once.

    py-lmdb has no ``MDB_RESERVE`` (put a value of a size, then fill LMDB's own pages), so a
    record built in a buffer of its own is copied twice: the block into the buffer, the
    buffer into the map, both memory-bound (issue 17: store() into a full CPU slab at 0.49x a
    raw write). Instead, when the ``HEADER_NBYTES`` before the block belong to the same
    tensor storage (every CPU pool slot: :class:`kvtier.tiers.pool.BlockPool` keeps a page
    before slot 0), LMDB copies those bytes plus the block straight into the map (one copy),
    and the header is written over the first ``HEADER_NBYTES`` of the value LMDB just stored
    (:func:`put_framed`). Any other block (slot 0 of an unpadded tensor, a copy of a GPU
    block) takes the buffered :func:`~kvtier.records.encode_record`.

    ``header(value)``: called once LMDB has copied the block, with the value as stored (a
    read-only ``uint8`` array over the transaction's pages, :data:`HEADER_NBYTES` borrowed
    bytes then the block's); returns :func:`~kvtier.records.encode_header`'s bytes for this
    block, to be written now, or ``None`` when the caller writes them itself with
    :func:`write_header` before the transaction commits (:class:`_WriteOverlap`: only for a
    value on LMDB's overflow pages). Default: the header made here, from ``digest`` (the
    block's :func:`~kvtier.records.payload_digest`, when the caller knows it) or by hashing
    the block.

    Raises:
        lmdb.Error: the put failed (map full, ...): nothing of the record is visible.
    """
    framed = framed_block(block)
    if framed is None:
        txn.put(key, encode_record(namespace, block, seq, fingerprint))
        return
    put_framed(txn, key, framed, header or (lambda _: encode_header(namespace, block, seq, fingerprint, digest)))


def is_framed(block: torch.Tensor) -> bool:
    """Whether the ``HEADER_NBYTES`` before ``block`` (contiguous, on CPU) belong to the same
    storage, so that :func:`put_record` writes it with one copy."""
    return (block.is_contiguous() and block.device.type == "cpu"
            and block.storage_offset() * block.element_size() >= HEADER_NBYTES)


def framed_block(block: torch.Tensor) -> ctypes.Array | None:
    """``block``'s bytes with the ``HEADER_NBYTES`` before them (a ``c_uint8`` array of
    ``HEADER_NBYTES + block's nbytes`` over the tensor's own memory), or ``None`` unless
    :func:`is_framed`."""
    if not is_framed(block):
        return None
    nbytes = block.numel() * block.element_size()
    return (ctypes.c_uint8 * (HEADER_NBYTES + nbytes)).from_address(block.data_ptr() - HEADER_NBYTES)


def put_framed(txn, key: bytes, framed: ctypes.Array, header: Callable[[np.ndarray], bytes | None]) -> None:
    """Put ``framed`` (:func:`framed_block`) under ``key``, then write ``header(value)``
    (:func:`put_record`'s callback, called after the put: a caller may hash the block on
    another thread while LMDB copies it, py-lmdb releasing the GIL in ``mdb_put``) over the
    value's first bytes: a value put in this transaction lies in its own dirty pages until
    commit (LMDB's ``MDB_RESERVE`` contract: mdb_put(3)), which ``txn.get`` with
    ``buffers=True`` points at. The borrowed bytes before the block are never stored: all of
    them are overwritten before the commit.

    Raises:
        lmdb.Error: the put failed (map full, ...) or reads back short.
    """
    txn.put(key, framed)
    value = _stored_value(txn, key, len(framed))
    record = header(value)
    if record is not None:
        write_header(value, record)


def _stored_value(txn, key: bytes, nbytes: int) -> np.ndarray:
    """The value of ``key`` put in the write transaction ``txn``, where LMDB holds it now (a
    read-only ``uint8`` array over the transaction's pages). Raises ``lmdb.Error`` unless it is
    ``nbytes`` long."""
    stored = txn.get(key)
    if stored is None or len(stored) != nbytes:
        raise lmdb.Error(f"a record just put reads back as {None if stored is None else len(stored)} bytes")
    return np.frombuffer(stored, dtype=np.uint8)


def write_header(value: np.ndarray, header: bytes) -> None:
    """``header`` (:data:`HEADER_NBYTES`) over the first bytes of ``value``, a value LMDB
    stored in the current write transaction (:func:`put_framed`): a plain store, holding the
    GIL (a ``ctypes.memmove`` would release and take it again, a wait behind the writer
    thread's Python on every block)."""
    (ctypes.c_char * HEADER_NBYTES).from_address(value.ctypes.data)[:] = header


def record_footprint(payload_nbytes: int, page_nbytes: int = 4096) -> int:
    """Bytes a record of ``payload_nbytes`` occupies: header + payload + LMDB's overflow
    page header, rounded up to whole pages (LMDB stores large values on overflow pages)."""
    return _page_round(HEADER_NBYTES + payload_nbytes + _OVERFLOW_PAGE_HEADER, page_nbytes)


def _page_round(nbytes: int, page_nbytes: int) -> int:
    return -(-nbytes // page_nbytes) * page_nbytes
