"""The one lookup path: how much of a chain the tiers hold, counted once.

``TieredStore.lookup`` and ``TieredStore.prefetch`` (so ``load`` and the daemon's get) both
walk the chain here, so the hit rate users see is the same whichever they call:

1. under the store's lock: the local prefix (memory pools, then DISK; a slot with a transfer
   in flight does not count in its tier), pinned when asked;
2. outside the lock: the REMOTE tier for the rest of the chain (one round trip);
3. under the lock: the local tiers again after the REMOTE run (the prefix is whatever every
   tier holds together), then 2 again, until a tier misses.

A walk that a reset overtakes (``TieredStore.reset``: a new generation, see
:mod:`kvtier.store.residency`) stops at its REMOTE part, and no walk asks REMOTE while a reset
empties the REMOTE namespace (``remote_clearing``): a block from before the reset is never
found there.

Counting (``stats``): ``lookup_blocks`` (blocks asked), ``hit_blocks`` by medium,
``remote_lookup_blocks`` (blocks asked of REMOTE), and ``miss_tokens`` by reason and tier for
the blocks after the hit prefix (:mod:`kvtier.store.misses`; with a ``PromptInfo``, also the
prompt's tokens after the blocks asked). A repeated ``request_id`` (a retried schedule) counts
once (case M1); ``count=False`` counts nothing (the daemon's get, whose lookup was counted
already; an explanation).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, NamedTuple, Sequence

from kvtier.store import misses
from kvtier.store.misses import MissMemory
from kvtier.store.placement import Placement
from kvtier.store.residency import Residency
from kvtier.store.results import Lease, PromptInfo, StoreStats
from kvtier.store.trace import StoreTrace
from kvtier.tiers.backend import RemoteBackend
from kvtier.types import BlockHash, Medium

logger = logging.getLogger(__name__)

COUNTED_REQUESTS = 4096
"""Request ids remembered so that a lookup repeated for the same request (an engine retrying
a schedule) is counted once (case M1)."""


class Walk(NamedTuple):
    """What :meth:`ChainLookup.walk` found."""

    media: list[Medium]
    """The medium of each leading block some tier holds."""
    lease: Lease | None
    """Pins on the local part of that prefix (``pin=True``), else ``None``."""
    remote_down: bool
    """The REMOTE tier failed to answer (down, timed out, paused after a failure)."""
    counted: bool
    """This walk was counted in ``stats`` (not a repeat of a counted request id)."""
    generation: int = 0
    """The store's generation the walk saw (:meth:`TieredStore.reset` starts a new one)."""


class ChainLookup:
    """Walks a block hash chain through every tier and counts the lookup.

    Args:
        placement: the local tiers.
        residency: the store's lock and pins.
        stats: where lookups and hits are counted.
        remote: the REMOTE tier, or ``None``.
        namespace: the store's namespace (REMOTE keys).
        check_open: raises ``RuntimeError`` when the store is closed (called under the lock).
        memory: what explains misses (failed blocks, content keys).
    """

    def __init__(
        self, placement: Placement, residency: Residency, stats: StoreStats, remote: RemoteBackend | None,
        namespace: bytes, check_open: Callable[[], None], memory: MissMemory,
    ) -> None:
        self._placement, self._residency, self._stats = placement, residency, stats
        self._remote, self._namespace, self._check_open = remote, namespace, check_open
        self.memory = memory
        self.trace: StoreTrace | None = None
        """Where counted walks are recorded (``config.trace_path``), if anywhere."""
        self._counted_requests: dict[str, None] = {}  # insertion-ordered, bounded
        self.remote_clearing = 0
        """Resets emptying the REMOTE namespace right now (set by the store under its lock):
        REMOTE is not asked meanwhile."""

    def walk(
        self, block_hashes: Sequence[BlockHash], request_id: str | None = None, count: bool = True,
        pin: bool = False, blocking: bool = True, prompt: PromptInfo | None = None, load: bool = False,
    ) -> Walk | None:
        """The leading blocks some tier holds, and the store's generation the walk saw (see
        :class:`Walk`). ``blocking=False``: ``None`` at once if another thread holds the
        lock, and REMOTE is not asked (an event loop calls it inline: the daemon). ``load``:
        a prefetch (so traced)."""
        lock, stats = self._residency.lock, self._stats
        if not lock.acquire(blocking=blocking):
            return None
        try:
            self._check_open()
            generation = self._residency.generation
            media = self._placement.local_prefix(block_hashes)
            lease = self._residency.lease(block_hashes[: len(media)]) if pin and media else None
            count = count and self._first_count(request_id)
            if count:
                stats.lookup_blocks += len(block_hashes)
                count_media(stats.hit_blocks, media)
                if self.trace is not None:
                    num_tokens = prompt.num_tokens if prompt is not None else None
                    self.trace.record("load" if load else "lookup", block_hashes, num_tokens)
            asks_remote = (
                blocking and self._remote is not None and not self.remote_clearing and len(media) < len(block_hashes)
            )
            if count and not asks_remote and (prompt is not None or len(media) < len(block_hashes)):
                self._count_misses(block_hashes, len(media), False, prompt)  # (a whole hit without a prompt: none)
        finally:
            lock.release()
        remote_down = False
        while asks_remote:
            rest = block_hashes[len(media) :]
            num_remote, remote_down = self._remote_lookup(rest)
            with lock:
                if not self._residency.is_current(generation):
                    break  # a reset came in between: the REMOTE answer may predate it
                if count:
                    stats.remote_lookup_blocks += len(rest)
                    stats.hit_blocks[Medium.REMOTE] += num_remote
                more = self._placement.local_prefix(block_hashes[len(media) + num_remote :]) if num_remote else []
                media += [Medium.REMOTE] * num_remote + more
                if count:
                    count_media(stats.hit_blocks, more)
                    if not more or len(media) == len(block_hashes):
                        self._count_misses(block_hashes, len(media), remote_down, prompt)
            if not more or len(media) == len(block_hashes):
                break
        return Walk(media, lease, remote_down, count, generation)

    def _count_misses(
        self, block_hashes: Sequence[BlockHash], num_hit: int, remote_down: bool, prompt: PromptInfo | None
    ) -> None:
        """Count the blocks after the hit prefix by reason, and the prompt's tail (the caller
        holds the lock)."""
        found = misses.classify(
            self._placement, self.memory, block_hashes, num_hit, remote_down, prompt, self._namespace
        )
        block_size = self._placement.spec.block_size
        misses.count(self._stats.miss_tokens, found, block_size, misses.tail_tokens(prompt, len(block_hashes), block_size))

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

    def _remote_lookup(self, block_hashes: Sequence[BlockHash]) -> tuple[int, bool]:
        """Leading ``block_hashes`` held by the REMOTE tier (0 when it is unreachable: the
        backend never raises for that), and whether it failed to answer (its error count
        went up during the call). Called without the store's lock."""
        remote = self._remote
        errors_before = sum(remote.errors.values())
        try:
            num_hit = int(remote.lookup(self._namespace, block_hashes))
        except Exception as exc:  # a backend bug or a reply it did not expect: a miss, not an error
            # Log its text, not the exception: a handler that keeps records (pytest's does)
            # would keep its traceback, the caller's frame and the lease pinned in it.
            logger.warning("REMOTE lookup failed: %s", repr(exc))
            remote.errors["lookup_error"] += 1
            return 0, True
        return min(max(num_hit, 0), len(block_hashes)), sum(remote.errors.values()) > errors_before


def count_media(counter: Counter[Medium], media: list[Medium]) -> None:
    """``counter.update(media)``: a prefix held by one medium (the usual hit) is one addition
    (``Counter.update`` checks its argument against the ``Mapping`` ABC first: 1.5 vs 0.2 us
    for 32 blocks, on every lookup of the daemon; issue 17)."""
    if media and media.count(media[0]) == len(media):
        counter[media[0]] += len(media)
    else:
        counter.update(media)
