"""The store path: new blocks into the top pool (prepare -> the caller writes -> complete).

``prepare`` reserves top-pool slots (pending: pinned, invisible to lookups); the caller
writes ``top.tensor[handle.block_ids]``; ``complete`` publishes them (a store counts as a use,
tail first: case E1), starts the background writes (write-through, REMOTE put), or frees the
slots when the write failed. A handle dropped without ``complete`` frees its slots from its
finalizer. A handle completed after a reset (an older generation: see
:mod:`kvtier.store.residency`) publishes nothing and writes nothing down. ``store_with`` runs both steps in chunks of half the top pool, so that a request
longer than the top pool still goes through (earlier chunks spill down); the chunks already
stored are protected from being dropped, so a request larger than every tier keeps its head
(what a later prompt can hit), not its tail.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Callable, Sequence

from kvtier.store.misses import MissMemory
from kvtier.store.placement import Placement
from kvtier.store.residency import Residency
from kvtier.store.results import StoreHandle, StoreStats
from kvtier.store.trace import StoreTrace
from kvtier.store.writes import BackgroundWrites
from kvtier.types import NO_FINGERPRINT, BlockHash, Fingerprint

SPILL_AHEAD_PART_BYTES = 16 << 20
"""Part of a pipelined store (:meth:`StorePath.store_with`): the copy-in of one part overlaps
the DISK write of the next part's victims. Measured on 2 MiB blocks, 2 cores
(bench/results/2026-12-02-disk-4/README.md)."""

WriteFn = Callable[[list[int], list[int]], None]
"""``write(indices, block_ids)``: copy request blocks ``indices`` into ``top.tensor[block_ids]``."""


class StorePath:
    """Prepares, completes and chunks the stores of one store.

    Args:
        placement: the local tiers (top-pool slots, room).
        residency: the store's lock, pins, pending slots, protected blocks.
        writes: write-through and REMOTE puts started on completion.
        stats: counts stored blocks.
        check_open: raises ``RuntimeError`` when the store is closed (called under the lock).
    """

    def __init__(
        self, placement: Placement, residency: Residency, writes: BackgroundWrites, stats: StoreStats,
        check_open: Callable[[], None],
    ) -> None:
        self._placement, self._residency, self._writes = placement, residency, writes
        self._stats, self._check_open = stats, check_open
        self.trace: StoreTrace | None = None
        """Where completed stores are recorded (``config.trace_path``), if anywhere."""
        self.memory: MissMemory | None = None
        """Forgets the failed verification of blocks stored again (kvtier.store.misses)."""

    def prepare(
        self, block_hashes: Sequence[BlockHash], fingerprints: Sequence[Fingerprint] | None = None
    ) -> StoreHandle:
        """Top-pool slots for the blocks of ``block_hashes`` not stored yet, kept with their
        ``fingerprints`` (default ``NO_FINGERPRINT``); stops at the first block that gets no
        slot or that another request is writing. A block already stored keeps the
        fingerprint it has (a load of other tokens misses it, and it ages out)."""
        residency = self._residency
        with residency.lock:
            self._check_open()
            self._writes.reap()
            top = self._placement.top
            present = residency.lease([h for h in block_hashes if h in top])  # not evicted by make_room
            self._placement.make_room(0, sum(1 for h in block_hashes if h not in top))
            new_hashes: list[BlockHash] = []
            block_ids: list[int] = []
            indices: list[int] = []
            chain: list[BlockHash] = []  # pinned blocks of this request, in request order
            for i, h in enumerate(block_hashes):
                if residency.is_pending(top.medium, h):
                    break
                if h not in top:
                    block_id = top.allocate(h, fingerprints[i] if fingerprints is not None else NO_FINGERPRINT)
                    if block_id is None:
                        break
                    residency.add_pending(top.medium, h)
                    new_hashes.append(h)
                    block_ids.append(block_id)
                    indices.append(i)
                chain.append(h)
            generation = residency.generation
            handle = StoreHandle(new_hashes, block_ids, indices, len(chain), residency.lease(chain), generation=generation)
            handle.abandon = weakref.finalize(
                handle, residency.defer_or_run, partial(residency.free_pending, top, new_hashes, generation)
            )
            present.release()
            return handle

    def complete(self, handle: StoreHandle, success: bool = True) -> None:
        """Publish the written blocks (or free their slots when ``success`` is False)."""
        residency, placement = self._residency, self._placement
        with residency.lock:
            top = placement.top
            if handle.abandon is not None:
                handle.abandon.detach()
            if not success or not residency.is_current(handle.generation):
                residency.free_pending(top, handle.block_hashes, handle.generation)
                handle.lease.release()
                return
            for h in handle.block_hashes:
                residency.end_pending(top.medium, h)
            self._stats.stored_blocks[top.medium] += len(handle.block_hashes)
            chain = handle.lease.block_hashes
            placement.events.stored_runs(top.medium, (handle.parent, *chain) if handle.parent else chain,
                                         handle.block_hashes)
            if self.memory is not None:
                self.memory.note_stored(handle.block_hashes, None, placement.namespace)
            if self.trace is not None:
                self.trace.record("store", handle.lease.block_hashes)
            placement.touch_tail_first(handle.lease.block_hashes, frozenset(handle.block_hashes))
            if placement.write_policy == "write_through":
                self._writes.write_through(handle.block_hashes)
            self._writes.put_remote(handle.block_hashes)
            handle.lease.release()

    def store_with(
        self, block_hashes: Sequence[BlockHash], write: WriteFn, fingerprints: Sequence[Fingerprint] | None = None
    ) -> int:
        """Store a request's blocks (with their ``fingerprints``) in chunks of at most half
        the top pool; returns the leading blocks of the request now stored (an exception in
        ``write`` frees the chunk's slots and propagates).

        When the chunk's victims spill to DISK (:meth:`Placement.spill_ahead_candidates`),
        it goes in parts of :data:`SPILL_AHEAD_PART_BYTES`, pipelined: while the caller's
        ``write`` copies part ``k`` into slots already free, the victims that part ``k + 1``
        will evict are written to DISK on an I/O thread (a ``host -> DISK`` transfer job, the
        victims pinned until it is reaped); part ``k + 1``'s ``prepare`` then finds them on
        DISK and only frees their slots. Every spill is done (or has failed and been
        counted) before this returns. A victim pinned or used meanwhile is just not evicted
        (it stays in memory and on DISK); a write that failed leaves its victims to the
        synchronous spill in ``prepare``."""
        chunk = max(1, self._placement.top.num_blocks // 2)
        stored = 0
        new: set[BlockHash] = set()
        protected: list[BlockHash] = []
        parts: list[int] = []
        try:
            stored = self._store_chunks(block_hashes, write, chunk, new, protected, fingerprints, parts)
        finally:
            self._residency.unprotect(protected)
        with self._residency.lock:
            if len(parts) > 1:  # re-order across parts: the request's tail goes first
                self._placement.touch_tail_first(block_hashes[:stored], frozenset(new))
            # A request larger than every tier evicts its own head: claim only what a lookup
            # finds (case B2: never claim more than is stored).
            medium_of = self._placement.medium_of
            return next((i for i, h in enumerate(block_hashes[:stored]) if medium_of(h) is None), stored)

    def _store_chunks(
        self, block_hashes: Sequence[BlockHash], write: WriteFn, chunk: int, new: set, protected: list,
        fingerprints: Sequence[Fingerprint] | None, parts: list[int],
    ) -> int:
        """store_with's loop: each part stored is protected from being dropped while the
        rest of the request goes in; ``parts`` gets the size of each part prepared."""
        part = min(chunk, max(1, SPILL_AHEAD_PART_BYTES // self._placement.spec.block_nbytes))
        stored, start, job = 0, 0, None
        try:
            while start < len(block_hashes):
                if job is not None:  # the victims of this part were written ahead
                    self._finish_spill_ahead(job)
                    job, size = None, part
                else:
                    size = part if part < chunk and self._spills(block_hashes[start : start + chunk]) else chunk
                end = min(start + size, len(block_hashes))
                fps = None if fingerprints is None else fingerprints[start:end]
                handle = self.prepare(block_hashes[start:end], fps)
                handle.parent = block_hashes[start - 1] if start else None
                parts.append(end - start)
                if size < chunk and end < len(block_hashes) and handle.num_blocks == end - start:
                    job = self._spill_ahead(block_hashes[end : end + part])
                ok = False
                try:
                    if handle.block_ids:
                        write([start + i for i in handle.indices], handle.block_ids)
                    ok = True
                finally:
                    self.complete(handle, success=ok)
                stored = start + handle.num_blocks
                new.update(handle.block_hashes)
                done = block_hashes[start:stored]
                self._residency.protect(done)
                protected.extend(done)
                if stored < end:
                    break
                start = end
        finally:
            if job is not None:
                self._finish_spill_ahead(job)
        return stored

    def _spills(self, block_hashes: Sequence[BlockHash]) -> bool:
        """Whether storing ``block_hashes`` now would spill blocks to DISK that could be
        written ahead."""
        with self._residency.lock:
            return bool(self._placement.spill_ahead_candidates(block_hashes))

    def _spill_ahead(self, upcoming: Sequence[BlockHash]) -> int | None:
        """Start writing to DISK the blocks that storing ``upcoming`` will evict; the job's
        id, or ``None`` when there is none to write (or no DISK room: ``prepare`` spills)."""
        residency, placement = self._residency, self._placement
        with residency.lock:
            self._check_open()
            todo = placement.spill_ahead_candidates(upcoming)
            return self._writes.write_to_disk(placement.top, todo) if todo else None

    def _finish_spill_ahead(self, job_id: int) -> None:
        """Wait for a spill-ahead job (outside the lock: lookups go on meanwhile), then reap
        it: its pins are released, its blocks published on DISK, its failures counted."""
        self._writes.engine.join([job_id])
        with self._residency.lock:
            self._writes.reap()
