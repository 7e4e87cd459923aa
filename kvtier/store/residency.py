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


class Residency:
    """Pins (``ref_cnt``), pending slots, protected blocks and deferred cleanups of one store."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._ref_cnt: Counter = Counter()
        self._pending: set[tuple[Medium, BlockHash]] = set()
        self._protected: Counter = Counter()
        self._deferred: deque[Callable[[], None]] = deque()

    def after_fork_in_child(self) -> None:
        """A forked child gets a new lock (the parent's may have been held by another thread)."""
        self.lock = threading.RLock()

    # -- pins --------------------------------------------------------------------------------
    def lease(self, block_hashes: Sequence[BlockHash]) -> Lease:
        """Pin ``block_hashes`` (repeats pin twice) until the returned lease is released."""
        return Lease(self, block_hashes)

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
        self.defer_or_run(partial(self.unpin, block_hashes))

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

    def add_pending(self, medium: Medium, block_hash: BlockHash) -> None:
        """``block_hash``'s slot in ``medium`` has a transfer or store in flight."""
        self._pending.add((medium, block_hash))

    def end_pending(self, medium: Medium, block_hash: BlockHash) -> None:
        """The transfer into that slot is over (the caller publishes or frees the slot)."""
        self._pending.discard((medium, block_hash))

    def free_pending(self, pool: BlockPool, block_hashes: Sequence[BlockHash]) -> None:
        """Free slots of ``pool`` reserved for a transfer or store that will never complete."""
        for h in block_hashes:
            if (pool.medium, h) in self._pending:
                self._pending.discard((pool.medium, h))
                pool.free(h)

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
        """For tests (the caller holds the lock, drained): pin counts are positive and no
        transfer or store was left incomplete."""
        assert all(n > 0 for n in self._ref_cnt.values()), "a ref_cnt went to zero or below but stayed"
        assert not self._pending, "a transfer or store was started but never completed"
