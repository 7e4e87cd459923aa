"""The one lookup path: how much of a chain the tiers hold, counted once.

``TieredStore.lookup`` and ``TieredStore.prefetch`` (so ``load`` and the daemon's get) both
walk the chain here, so the hit rate users see is the same whichever they call:

1. under the store's lock: the local prefix (memory pools, then DISK; a slot with a transfer
   in flight does not count in its tier), pinned when asked;
2. outside the lock: the REMOTE tier for the rest of the chain (one round trip);
3. under the lock: the local tiers again after the REMOTE run (the prefix is whatever every
   tier holds together), then 2 again, until a tier misses.

Counting (``stats``): ``lookup_blocks`` (blocks asked), ``hit_blocks`` by medium,
``remote_lookup_blocks`` (blocks asked of REMOTE). A repeated ``request_id`` (a retried
schedule) counts once (case M1); ``count=False`` counts nothing (the daemon's get, whose
lookup was counted already).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvtier.store.placement import Placement
from kvtier.store.residency import Residency
from kvtier.store.results import Lease, StoreStats
from kvtier.tiers.backend import RemoteBackend
from kvtier.types import BlockHash, Medium

logger = logging.getLogger(__name__)

COUNTED_REQUESTS = 4096
"""Request ids remembered so that a lookup repeated for the same request (an engine retrying
a schedule) is counted once (case M1)."""


class ChainLookup:
    """Walks a block hash chain through every tier and counts the lookup.

    Args:
        placement: the local tiers.
        residency: the store's lock and pins.
        stats: where lookups and hits are counted.
        remote: the REMOTE tier, or ``None``.
        namespace: the store's namespace (REMOTE keys).
        check_open: raises ``RuntimeError`` when the store is closed (called under the lock).
    """

    def __init__(
        self, placement: Placement, residency: Residency, stats: StoreStats, remote: RemoteBackend | None,
        namespace: bytes, check_open: Callable[[], None],
    ) -> None:
        self._placement, self._residency, self._stats = placement, residency, stats
        self._remote, self._namespace, self._check_open = remote, namespace, check_open
        self._counted_requests: dict[str, None] = {}  # insertion-ordered, bounded

    def walk(
        self, block_hashes: Sequence[BlockHash], request_id: str | None = None, count: bool = True,
        pin: bool = False, blocking: bool = True,
    ) -> tuple[list[Medium], Lease | None] | None:
        """The medium of each leading block some tier holds, and a lease on the local prefix
        when ``pin``. ``blocking=False``: ``None`` at once if another thread holds the lock,
        and REMOTE is not asked (an event loop calls it inline: the daemon)."""
        lock, stats = self._residency.lock, self._stats
        if not lock.acquire(blocking=blocking):
            return None
        try:
            self._check_open()
            media = self._placement.local_prefix(block_hashes)
            lease = self._residency.lease(block_hashes[: len(media)]) if pin and media else None
            count = count and self._first_count(request_id)
            if count:
                stats.lookup_blocks += len(block_hashes)
                stats.hit_blocks.update(media)
        finally:
            lock.release()
        while blocking and self._remote is not None and len(media) < len(block_hashes):
            rest = block_hashes[len(media) :]
            num_remote = self._remote_lookup(rest)
            with lock:
                if count:
                    stats.remote_lookup_blocks += len(rest)
                    stats.hit_blocks[Medium.REMOTE] += num_remote
                if not num_remote:
                    break
                media += [Medium.REMOTE] * num_remote
                more = self._placement.local_prefix(block_hashes[len(media) :])
                if count:
                    stats.hit_blocks.update(more)
            if not more:
                break
            media += more
        return media, lease

    def _first_count(self, request_id: str | None) -> bool:
        """Whether this lookup's events are counted (the caller holds the lock)."""
        if request_id is None:
            return True
        if request_id in self._counted_requests:
            return False
        self._counted_requests[request_id] = None
        if len(self._counted_requests) > COUNTED_REQUESTS:
            del self._counted_requests[next(iter(self._counted_requests))]
        return True

    def _remote_lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading ``block_hashes`` held by the REMOTE tier (0 when it is unreachable: the
        backend never raises for that). Called without the store's lock."""
        remote = self._remote
        try:
            num_hit = int(remote.lookup(self._namespace, block_hashes))
        except Exception as exc:  # a backend bug or a reply it did not expect: a miss, not an error
            logger.warning("REMOTE lookup failed: %r", exc)
            remote.errors["lookup_error"] += 1
            return 0
        return min(max(num_hit, 0), len(block_hashes))
