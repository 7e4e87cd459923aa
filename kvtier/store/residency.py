"""Residency: what keeps a block where it is. The only code that changes pins, pending slots,
protected blocks and deferred cleanups; the other store modules go through these methods.

- **pin / ref_cnt**: a pinned block is never evicted from any tier. Every pin is owned by
  exactly one :class:`~kvtier.store.results.Lease` (:meth:`Residency.lease`), released by
  ``lease.release()``, ``with lease:``, or its finalizer when the lease is collected (case O1).
- **pending**: ``(medium, block_hash)`` of a slot with a transfer or a store in flight:
  invisible to lookups in that tier and never evicted; published or freed when it completes.
- **protected**: blocks of a request inside ``store_with``: spilled, never dropped, so that a
  request larger than every tier keeps its head.
- **deferred cleanups**: lease finalizers and abandoned handles that found the store's lock
  held by another thread; :meth:`Residency.drain` runs them at the start of the next
  operation (a GC pass on an I/O thread must never wait for the lock: the thread holding it
  may be waiting for that I/O thread, a deadlock).

- **generations**: pins and pending slots belong to the generation of the store's contents
  they were taken in. :meth:`Residency.retire` (``TieredStore.reset``) starts a new one: the
  blocks pinned or pending in the old one leave the pools' indexes but keep their slots
  (*held*) until their pins are released and their transfers end, so nobody still reading or
  writing a slot sees it handed to another block; a handle of an old generation publishes
  nothing (:meth:`Residency.is_current`). After ``fork()`` the child starts a new generation
  too, but frees the old one's slots at once: the threads that held them do not exist there
  (:meth:`Residency.after_fork_in_child`).

``lock`` is the store's one ``RLock``: every public store method holds it, and every method
here except :meth:`release_pins` and :meth:`defer_or_run` expects the caller to hold it (or
takes it).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from functools import partial
from typing import Callable, Sequence

from kvtier.store.results import Lease
from kvtier.tiers.pool import BlockPool
from kvtier.types import BlockHash, Medium


class _Generation:
    """The pins and pending slots taken in one generation of a store's contents, and (once
    retired) the pool slots they keep: ``held[(medium, block_hash)] = (pool, block_id)``.
    Leases pin through it (the :class:`~kvtier.store.results.Pins` protocol), so a lease
    taken before a reset releases into its own generation."""

    __slots__ = ("residency", "number", "ref_cnt", "pending", "held")

    def __init__(self, residency: "Residency", number: int) -> None:
        self.residency, self.number = residency, number
        self.ref_cnt: Counter = Counter()
        self.pending: set[tuple[Medium, BlockHash]] = set()
        self.held: dict[tuple[Medium, BlockHash], tuple[BlockPool, int]] = {}

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        self.residency.pin(block_hashes)  # only the current generation hands out leases

    def release_pins(self, block_hashes: Sequence[BlockHash]) -> None:
        self.residency.defer_or_run(partial(self.residency._unpin_in, self, block_hashes))

    def empty(self) -> bool:
        return not (self.ref_cnt or self.pending or self.held)


class Residency:
    """Pins (``ref_cnt``), pending slots, protected blocks and deferred cleanups of one store."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._protected: Counter = Counter()
        self._deferred: deque[Callable[[], None]] = deque()
        self._retired: dict[int, _Generation] = {}  # older generations that still hold slots or pins
        self.forked_at = 0
        """Number of the first generation of this process (after ``fork()``: the child's);
        a handle of an older one was inherited from the parent and is inert."""
        self._start_generation(0)

    def _start_generation(self, number: int) -> None:
        self._gen = _Generation(self, number)
        self._ref_cnt, self._pending = self._gen.ref_cnt, self._gen.pending  # the hot paths' names

    @property
    def generation(self) -> int:
        """Number of the current generation of the store's contents (see the module doc)."""
        return self._gen.number

    def is_current(self, generation: int) -> bool:
        return generation == self._gen.number

    def inherited(self, generation: int) -> bool:
        """Whether a handle of ``generation`` was inherited from the parent across ``fork()``."""
        return generation < self.forked_at

    def retire(self, pools: Sequence[BlockPool]) -> None:
        """Empty ``pools`` and start a new generation (the caller holds the lock). Slots of
        blocks pinned or pending now stay held until those pins are released and those
        transfers end (their owners call :meth:`free_pending` with their generation)."""
        old = self._gen
        for pool in pools:
            busy = [h for h in pool.lru_order() if h in old.ref_cnt or (pool.medium, h) in old.pending]
            for h, block_id in pool.clear(hold=busy).items():
                old.held[(pool.medium, h)] = (pool, block_id)
        if not old.empty():
            self._retired[old.number] = old
        self._start_generation(old.number + 1)

    def after_fork_in_child(self, pools: Sequence[BlockPool]) -> None:
        """In a forked child: a new lock (the parent's may have been held by another thread),
        and a new generation that drops every pin and pending slot inherited from the parent.
        The threads and transfers that held them do not exist here, so their slots are freed
        now (published blocks stay: their bytes are in this process's copy of the pools)."""
        self.lock = threading.RLock()
        by_medium = {pool.medium: pool for pool in pools}
        for medium, h in self._pending:
            pool = by_medium.get(medium)
            if pool is not None and h in pool:
                pool.free(h)
        for old in self._retired.values():
            for pool, block_id in old.held.values():
                pool.release_slot(block_id)
        self._retired.clear()
        self._deferred.clear()  # cleanups of the parent's handles: nothing of theirs is left here
        self._protected.clear()
        self.forked_at = self._gen.number + 1
        self._start_generation(self.forked_at)

    # -- pins --------------------------------------------------------------------------------
    def lease(self, block_hashes: Sequence[BlockHash]) -> Lease:
        """Pin ``block_hashes`` (repeats pin twice) until the returned lease is released."""
        return Lease(self._gen, block_hashes)

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        with self.lock:
            for h in block_hashes:
                self._ref_cnt[h] += 1

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        with self.lock:
            for h in block_hashes:
                n = self._ref_cnt[h] - 1
                assert n >= 0, "unpinned more often than pinned"
                if n:
                    self._ref_cnt[h] = n
                else:
                    del self._ref_cnt[h]

    def release_pins(self, block_hashes: Sequence[BlockHash]) -> None:
        """Unpin now if the lock is free (or ours), else at the next :meth:`drain` (a lease
        finalizer may run in a GC pass on any thread: it must not wait for the lock)."""
        self._gen.release_pins(block_hashes)

    def _unpin_in(self, generation: _Generation, block_hashes: Sequence[BlockHash]) -> None:
        """Unpin in ``generation`` (under the lock); in a retired one, a block whose last pin
        goes gives back the slots it held."""
        if generation is self._gen:
            self.unpin(block_hashes)
            return
        if self._retired.get(generation.number) is not generation:
            return  # dropped at a fork: nothing of it is left to release
        for h in block_hashes:
            n = generation.ref_cnt[h] - 1
            if n > 0:
                generation.ref_cnt[h] = n
                continue
            generation.ref_cnt.pop(h, None)
            for medium in Medium:
                self._release_held(generation, medium, h)
        self._forget_if_empty(generation)

    def _release_held(self, generation: _Generation, medium: Medium, block_hash: BlockHash) -> None:
        key = (medium, block_hash)
        if key in generation.held and key not in generation.pending and block_hash not in generation.ref_cnt:
            pool, block_id = generation.held.pop(key)
            pool.release_slot(block_id)

    def _forget_if_empty(self, generation: _Generation) -> None:
        if generation.empty():
            self._retired.pop(generation.number, None)

    def ref_cnt(self, block_hash: BlockHash) -> int:
        """Live pins on ``block_hash`` (deferred releases applied first)."""
        with self.lock:
            self.drain()
            return self._ref_cnt[block_hash]

    def pinned(self) -> dict[BlockHash, int]:
        """A copy of every live pin count (deferred releases applied first)."""
        with self.lock:
            self.drain()
            return dict(self._ref_cnt)

    # -- pending slots -----------------------------------------------------------------------
    def is_pending(self, medium: Medium, block_hash: BlockHash) -> bool:
        return (medium, block_hash) in self._pending

    def pending_slots(self) -> frozenset[tuple[Medium, BlockHash]] | set[tuple[Medium, BlockHash]]:
        """The current generation's pending ``(medium, block_hash)`` pairs, to test many
        blocks in one pass (:meth:`~kvtier.store.placement.Placement.local_prefix`); the
        live set, valid while the caller holds the lock: read it, never change it."""
        return self._pending

    def add_pending(self, medium: Medium, block_hash: BlockHash) -> None:
        """``block_hash``'s slot in ``medium`` has a transfer or store in flight."""
        self._pending.add((medium, block_hash))

    def end_pending(self, medium: Medium, block_hash: BlockHash) -> None:
        """The transfer into that slot is over (the caller publishes or frees the slot)."""
        self._pending.discard((medium, block_hash))

    def end_pending_many(self, medium: Medium, block_hashes: Sequence[BlockHash]) -> None:
        """:meth:`end_pending` of every block of ``block_hashes`` in ``medium``, one set operation."""
        self._pending.difference_update([(medium, h) for h in block_hashes])

    def free_pending(self, pool: BlockPool, block_hashes: Sequence[BlockHash], generation: int | None = None) -> None:
        """Free slots of ``pool`` reserved for a transfer or store that will never complete
        (or, for a handle of an older ``generation``, whose result is not wanted any more:
        the slots it held are given back once no pin of that generation needs them)."""
        if generation is None or generation == self._gen.number:
            for h in block_hashes:
                if (pool.medium, h) in self._pending:
                    self._pending.discard((pool.medium, h))
                    pool.free(h)
            return
        old = self._retired.get(generation)
        if old is None:
            return  # nothing held (a fork freed it, or nothing was pinned or pending)
        for h in block_hashes:
            old.pending.discard((pool.medium, h))
            self._release_held(old, pool.medium, h)
        self._forget_if_empty(old)

    def pending(self, medium: Medium | None = None) -> set[BlockHash] | set[tuple[Medium, BlockHash]]:
        """A copy of the pending slots: block hashes in ``medium``, or every ``(medium, hash)``."""
        with self.lock:
            if medium is None:
                return set(self._pending)
            return {h for m, h in self._pending if m is medium}

    # -- protected blocks and eviction -------------------------------------------------------
    def protect(self, block_hashes: Sequence[BlockHash]) -> None:
        with self.lock:
            self._protected.update(block_hashes)

    def unprotect(self, block_hashes: Sequence[BlockHash]) -> None:
        with self.lock:
            self._protected.subtract(block_hashes)
            self._protected += Counter()  # drop zero counts

    def is_protected(self, block_hash: BlockHash) -> bool:
        return block_hash in self._protected

    def evictable(self, medium: Medium, block_hash: BlockHash) -> bool:
        """Neither pinned nor pending in ``medium``."""
        return block_hash not in self._ref_cnt and (medium, block_hash) not in self._pending

    # -- deferred cleanups -------------------------------------------------------------------
    def defer_or_run(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` under the lock now if it is free (or ours), else queue it."""
        if self.lock.acquire(blocking=False):
            try:
                cleanup()
            finally:
                self.lock.release()
        else:
            self._deferred.append(cleanup)

    def drain(self) -> None:
        """Run the queued cleanups (the caller holds the lock)."""
        while self._deferred:
            self._deferred.popleft()()

    def check(self) -> None:
        """For tests (the caller holds the lock, drained): pin counts are positive, no
        transfer or store was left incomplete, and no retired generation holds a slot that
        nothing pins."""
        assert all(n > 0 for n in self._ref_cnt.values()), "a ref_cnt went to zero or below but stayed"
        assert not self._pending, "a transfer or store was started but never completed"
        for old in self._retired.values():
            assert not old.pending, "a transfer or store from before a reset never completed"
            assert all(h in old.ref_cnt for _, h in old.held), "a slot held across a reset outlived its pins"
