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

import torch

from kvtier.store.misses import MissMemory
from kvtier.store.placement import Placement
from kvtier.store.residency import Residency
from kvtier.store.results import StoreHandle, StoreStats
from kvtier.store.trace import StoreTrace
from kvtier.store.writes import BackgroundWrites
from kvtier.types import NO_FINGERPRINT, BlockHash, Fingerprint

WriteFn = Callable[[list[int], list[int]], "list[int | None] | None"]
"""``write(indices, block_ids)``: copy request blocks ``indices`` into ``top.tensor[block_ids]``
(possibly on the DISK tier's writer thread while the caller holds the store's lock: see
:meth:`kvtier.store.TieredStore.store_with`); may return the xxh3-64 of each block written
(``None`` for one not hashed; :meth:`kvtier.tiers.pool.BlockPool.set_payload_digest`)."""


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
        return self._prepare(block_hashes, fingerprints)[0]

    def _prepare(
        self, block_hashes: Sequence[BlockHash], fingerprints: Sequence[Fingerprint] | None = None,
        write: WriteFn | None = None,
    ) -> tuple[StoreHandle, set[int]]:
        """:meth:`prepare`; given ``write`` (``write(indices, block_ids)``, indices into
        ``block_hashes``), the blocks whose victims spill to DISK are written as each victim
        leaves its slot (:meth:`Placement.make_room`'s ``refill``: the slot is still in cache
        from LMDB's copy, so the new block's copy does not miss cache again: store() into a
        full CPU slab of 128 x 2 MiB, same process, medians, 0.53-0.69x -> 0.62-0.76x of a
        raw write in six of six runs, bench/results/2026-12-02-disk-4/micro/ab3.log). Returns the handle and the indices
        already written that way (each checked to have got the slot it was written into);
        the caller writes the others. Those writes run under the store's lock (and inside
        LMDB's write transaction); not while CUDA is in use (``write`` may copy from a
        device, where a copy per block costs more than it saves)."""
        residency = self._residency
        with residency.lock:
            self._check_open()
            self._writes.reap()
            top = self._placement.top
            present = residency.lease([h for h in block_hashes if h in top])  # not evicted by make_room
            refill, written_at, digests = None, {}, {}
            # measured with host-memory sources only: a write from a device, one block at a
            # time, would be a transfer per block
            if write is not None and not torch.cuda.is_initialized():
                order: list[int] = []  # the indices that will be allocated, in order (as below)
                seen: set[BlockHash] = set()
                for i, h in enumerate(block_hashes):
                    if residency.is_pending(top.medium, h):
                        break
                    if h not in top and h not in seen:
                        order.append(i)
                        seen.add(h)
                failed: list[BaseException] = []

                def refill(j: int, slot: int) -> None:
                    if failed or j >= len(order):
                        return
                    try:
                        digest = write([order[j]], [slot])
                    except Exception as exc:  # under LMDB's transaction: left to the caller's own write
                        failed.append(exc)
                    else:
                        written_at[order[j]] = slot
                        digests[order[j]] = digest[0] if digest else None

            self._placement.make_room(0, sum(1 for h in block_hashes if h not in top), refill)
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
            written = {i for i, b in zip(indices, block_ids) if written_at.get(i) == b}
            for i, b in zip(indices, block_ids):  # allocate() forgot the digest of the bytes refill wrote
                if i in written:
                    top.set_payload_digest(b, digests[i])
            generation = residency.generation
            handle = StoreHandle(new_hashes, block_ids, indices, len(chain), residency.lease(chain), generation=generation)
            handle.abandon = weakref.finalize(
                handle, residency.defer_or_run, partial(residency.free_pending, top, new_hashes, generation)
            )
            present.release()
            return handle, written

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
        ``write`` frees the chunk's slots and propagates)."""
        chunk = max(1, self._placement.top.num_blocks // 2)
        stored = 0
        new: set[BlockHash] = set()
        protected: list[BlockHash] = []
        try:
            stored = self._store_chunks(block_hashes, write, chunk, new, protected, fingerprints)
        finally:
            self._residency.unprotect(protected)
        with self._residency.lock:
            if stored > chunk:  # re-order across chunks: the request's tail goes first
                self._placement.touch_tail_first(block_hashes[:stored], frozenset(new))
            # A request larger than every tier evicts its own head: claim only what a lookup
            # finds (case B2: never claim more than is stored).
            medium_of = self._placement.medium_of
            return next((i for i, h in enumerate(block_hashes[:stored]) if medium_of(h) is None), stored)

    def _store_chunks(
        self, block_hashes: Sequence[BlockHash], write: WriteFn, chunk: int, new: set, protected: list,
        fingerprints: Sequence[Fingerprint] | None,
    ) -> int:
        """store_with's loop: each chunk stored is protected from being dropped while the
        rest of the request goes in."""
        stored = 0
        for start in range(0, len(block_hashes), chunk):
            fps = None if fingerprints is None else fingerprints[start : start + chunk]
            handle, written = self._prepare(
                block_hashes[start : start + chunk], fps,
                lambda indices, ids, start=start: write([start + i for i in indices], ids),
            )
            handle.parent = block_hashes[start - 1] if start else None
            ok = False
            try:
                rest = [(start + i, b) for i, b in zip(handle.indices, handle.block_ids) if i not in written]
                if rest:
                    digests = write([i for i, _ in rest], [b for _, b in rest])
                    if digests:  # the slots are this handle's until complete()
                        top = self._placement.top
                        for (_, b), digest in zip(rest, digests):
                            top.set_payload_digest(b, digest)
                ok = True
            finally:
                self.complete(handle, success=ok)
            stored = start + handle.num_blocks
            new.update(handle.block_hashes)
            part = block_hashes[start:stored]
            self._residency.protect(part)
            protected.extend(part)
            if stored < min(start + chunk, len(block_hashes)):
                break
        return stored
