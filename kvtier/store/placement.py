"""Placement: where a block lives in the local tiers, and making room (eviction and spill).

Tiers, top first: the memory pools (``pools[0]`` is the top pool: loads land there and stores
start there), then DISK. Eviction is segmented LRU per tier (:mod:`kvtier.tiers.lru`),
skipping pinned and pending blocks (:mod:`kvtier.store.residency`). Blocks of one request are
touched tail first, so a request's tail is evicted before its head and a shared prefix goes
last (vLLM's free-block queue; LMCache issue 1116). Under ``write_back`` victims spill one
tier down (pool -> next pool -> DISK, batched into LMDB transactions of ~64 MiB) unless that
tier already holds them; DISK victims are dropped. A store into the last pool may write each
new block into a victim's slot as soon as LMDB has copied the victim (``make_room``'s
``refill``: the slot is still in cache, so the copy-in does not read it from DRAM again; for
blocks of >= 640 KiB on the DISK tier's writer thread, beside LMDB's next copy:
kvtier.tiers.disk._WriteOverlap).
Every method expects the store's lock held.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Sequence

import torch

from kvtier.config import StoreConfig
from kvtier.store.events import KVEventPublisher
from kvtier.store.residency import Residency
from kvtier.store.results import StoreStats
from kvtier.tiers.disk import DiskTier, txn_blocks
from kvtier.tiers.pool import BlockPool
from kvtier.types import BlockHash, Fingerprint, KVSpec, Medium

logger = logging.getLogger(__name__)


class Placement:
    """The local tiers of one store and the policy that moves blocks between them.

    Args:
        spec: block shape and dtype.
        namespace: written into every DISK record.
        write_policy: ``"write_back"`` or ``"write_through"`` (see kvtier.config).
        pools: memory pools, top first.
        disk: the DISK tier, or ``None``.
        residency: pins and pending slots (never evicted).
        stats: counters of evictions, spills and failed spills.
        events: where blocks stored in and removed from a tier are published (kvtier.store.events).
    """

    def __init__(
        self, spec: KVSpec, namespace: bytes, write_policy: str, pools: list[BlockPool], disk: DiskTier | None,
        residency: Residency, stats: StoreStats, events: KVEventPublisher | None = None,
    ) -> None:
        self.spec, self.namespace, self.write_policy = spec, namespace, write_policy
        self.pools, self.disk = pools, disk
        self._residency, self._stats = residency, stats
        self.events = events if events is not None else KVEventPublisher(spec.block_size)
        self.wait_for_writes: Callable[[], bool] = lambda: False
        """Set by the store: wait for background writes (whose pins may stand in the way of
        an eviction) and return whether there were any."""
        self.disk_in_flight: Counter[BlockHash] = Counter()
        """Blocks of background DISK writes submitted but not yet reaped
        (kvtier.store.writes): room they will take, so no other write may count on it."""

    # -- where blocks are --------------------------------------------------------------------
    @property
    def top(self) -> BlockPool:
        """The pool loads land in and stores start from."""
        if not self.pools:
            raise RuntimeError("store has no memory pool; loads need one")
        return self.pools[0]

    def pool(self, medium: Medium) -> BlockPool | None:
        return next((p for p in self.pools if p.medium is medium), None)

    def medium_of(self, block_hash: BlockHash) -> Medium | None:
        """Fastest medium holding a published copy of ``block_hash``, else ``None``."""
        for pool in self.pools:
            if block_hash in pool and not self._residency.is_pending(pool.medium, block_hash):
                return pool.medium
        if self.disk is not None and block_hash in self.disk:
            return Medium.DISK
        return None

    def fingerprint_of(self, block_hash: BlockHash, medium: Medium) -> Fingerprint | None:
        """The token fingerprint ``medium`` (a pool or DISK) keeps with ``block_hash``."""
        if medium is Medium.DISK:
            return self.disk.fingerprint_of(block_hash) if self.disk is not None else None
        pool = self.pool(medium)
        return pool.fingerprint(block_hash) if pool is not None else None

    def local_prefix(self, block_hashes: Sequence[BlockHash]) -> list[Medium]:
        """Medium of each leading block held by some local tier (what :meth:`medium_of`
        says for each, in one pass: three calls per block hash were ~10% of the daemon's
        lookup, bench/results/2026-12-01-perf)."""
        media: list[Medium] = []
        pending = self._residency.pending_slots()
        tiers = [(pool.medium, *pool.index_segments()) for pool in self.pools]
        disk = self.disk
        if len(tiers) == 1 and not pending:  # one memory pool, nothing in flight (the daemon's usual lookup)
            medium, probation, protected = tiers[0]
            n = 0
            for h in block_hashes:
                if h not in probation and h not in protected:
                    break
                n += 1
            media = [medium] * n
            block_hashes = block_hashes[n:]
            if not block_hashes or disk is None:
                return media
        for h in block_hashes:
            for medium, probation, protected in tiers:
                if (h in probation or h in protected) and (medium, h) not in pending:
                    media.append(medium)
                    break
            else:
                if disk is not None and h in disk:
                    media.append(Medium.DISK)
                else:
                    break
        return media

    def free_top_slots(self, keep: Sequence[BlockHash]) -> int:
        """Top-pool slots a load could take now: free ones, and blocks that could be evicted
        (neither pinned nor pending) other than ``keep``."""
        top, keep = self.top, set(keep)
        evictable = sum(1 for h in top.lru_order() if h not in keep and self._residency.evictable(top.medium, h))
        return top.num_free + evictable

    def held_blocks(self) -> dict[Medium, list[BlockHash]]:
        """Every published block of each local tier (in eviction order; a block loaded or
        being written is not held yet): a snapshot for KV-event subscribers."""
        held = {p.medium: [h for h in p.lru_order() if not self._residency.is_pending(p.medium, h)] for p in self.pools}
        if self.disk is not None:
            held[Medium.DISK] = list(self.disk.lru_order())
        return held

    def touch_tail_first(self, block_hashes: Sequence[BlockHash], new: frozenset = frozenset()) -> None:
        """A use of ``block_hashes`` (``new`` ones only move to the recent end of probation),
        in reverse order, so the head of a request is the last of it to be evicted."""
        tiers = [*self.pools, *([self.disk] if self.disk is not None else [])]
        if not new:  # a load: one pass per tier (each tier's order is its own)
            tail_first = block_hashes[::-1]
            for tier in tiers:
                tier.touch_many(tail_first)
            return
        for h in reversed(block_hashes):
            for tier in tiers:
                if h in tier:
                    tier.refresh(h) if h in new else tier.touch(h)

    def below_has(self, index: int, block_hash: BlockHash) -> bool:
        """Whether a tier below ``pools[index]`` holds ``block_hash``."""
        return any(block_hash in p for p in self.pools[index + 1 :]) or (
            self.disk is not None and block_hash in self.disk
        )

    # -- eviction ----------------------------------------------------------------------------
    def make_room(self, index: int, num_blocks: int, refill: Callable[[int, int], None] | None = None) -> None:
        """Evict from ``pools[index]`` until ``num_blocks`` slots are free (or nothing more
        is evictable); victims spill down in one batch.

        ``refill(j, slot)``: when the victims spill from the last pool to DISK, called for
        each victim's ``slot`` right after LMDB copied it, while its memory is in cache:
        ``slot`` is the one the ``j``-th allocation after this call gets (victims are freed
        in order and :meth:`BlockPool.allocate` hands out the last freed slot first), so the
        caller may write that block's bytes there now instead of after the whole spill. Every
        victim is freed on return, spilled or not; none is offered when a victim is protected
        (it might be kept). The caller must check that allocation ``j`` did get ``slot``
        (kvtier.store.stores)."""
        self._residency.drain()
        pool = self.pools[index]
        missing = num_blocks - pool.num_free
        if missing <= 0:
            return
        # With nothing below this pool a protected victim could not be freed (it is kept:
        # below), so it is passed over, not chosen in place of one that can go.
        skip_protected = index + 1 == len(self.pools) and self.disk is None
        victims = self._victims(pool, missing, skip_protected)
        # Background writes (REMOTE puts, write-through) pin their sources: wait for them
        # (each bounded by its tier's timeout) rather than refuse the store.
        if len(victims) < missing and self.wait_for_writes():
            victims = self._victims(pool, missing, skip_protected)
        if self.write_policy == "write_back":
            spill = victims
        else:
            spill = [h for h in victims if not self.below_has(index, h)]
        after_put = None
        if refill is not None and index + 1 == len(self.pools) and not any(map(self._residency.is_protected, victims)):
            order = {h: len(victims) - 1 - p for p, h in enumerate(victims)}
            after_put = lambda h: refill(order[h], pool.block_id(h))  # noqa: E731
        try:
            self.write_down(index, spill, after_put)
        finally:
            # The head of a request being stored is never dropped to make room for its own
            # tail (a request larger than every tier keeps its head: the part a later prompt
            # can hit). Freed even when the spill raised: a refilled slot holds other bytes.
            victims = [h for h in victims if not self._residency.is_protected(h) or self.below_has(index, h)]
            for h in victims:
                pool.free(h, evicted=True)
            self._stats.evicted_blocks[pool.medium] += len(victims)
            self.events.removed(pool.medium, victims)

    def _victims(self, pool: BlockPool, num_blocks: int, skip_protected: bool = False) -> list[BlockHash]:
        victims = []
        residency = self._residency
        for h in pool.lru_order():
            if len(victims) >= num_blocks:
                break
            if residency.evictable(pool.medium, h) and not (skip_protected and residency.is_protected(h)):
                victims.append(h)
        return victims

    def disk_room(self, num_blocks: int) -> list[BlockHash] | None:
        """DISK victims whose eviction makes room for ``num_blocks`` more records, or
        ``None`` when not even evicting everything unpinned would do. Room that background
        writes in flight will take is not free: when it stands in the way, those writes are
        waited for first (else two writes sized against the same free bytes, and the second
        fails "full" after its blocks were reported stored)."""
        assert self.disk is not None
        room = self._disk_room(num_blocks)
        if room is None and self.disk_in_flight and self.wait_for_writes():
            room = self._disk_room(num_blocks)  # the writes in flight are reaped: evictable now
        return room

    def _disk_room(self, num_blocks: int) -> list[BlockHash] | None:
        assert self.disk is not None
        size = self.disk.footprint(self.spec.block_nbytes)
        need, free = size * num_blocks, self.disk.free_bytes_after(self.disk_in_flight, self.spec.block_nbytes)
        victims: list[BlockHash] = []
        for h in self.disk.lru_order():
            if free >= need:
                break
            if self._residency.evictable(Medium.DISK, h) and not self._residency.is_protected(h):
                victims.append(h)
                free += self.disk.footprint_of(h)
        return victims if free >= need else None

    def evict_from_disk(self, victims: list[BlockHash]) -> None:
        """Delete ``victims`` (from :meth:`disk_room`) now, while they are known unpinned."""
        assert self.disk is not None
        if victims:
            self.disk.write_batch([], deletes=victims)
            self._stats.evicted_blocks[Medium.DISK] += len(victims)
            self.events.removed(Medium.DISK, victims)

    # -- spills ------------------------------------------------------------------------------
    def write_down(
        self, index: int, block_hashes: list[BlockHash], after_put: Callable[[BlockHash], None] | None = None
    ) -> None:
        """Copy blocks of ``pools[index]`` into the next tier down (the next pool, else
        DISK), skipping those it already holds; blocks that find no room there are dropped.
        ``after_put``: see :meth:`spill_to_disk` (DISK only)."""
        pool = self.pools[index]
        if index + 1 == len(self.pools):
            if self.disk is not None:
                self.spill_to_disk(pool, [h for h in block_hashes if h not in self.disk], after_put)
            return
        below = self.pools[index + 1]
        todo = [h for h in block_hashes if h not in below]
        self._residency.pin(todo)  # the sources must survive the evictions below
        try:
            self.make_room(index + 1, len(todo))
        finally:
            self._residency.unpin(todo)
        copied = []
        for h in todo:
            below_id = below.allocate(h, pool.fingerprint(h))
            if below_id is None:
                break
            block_id = pool.block_id(h)
            below.tensor[below_id].copy_(pool.tensor[block_id])
            below.set_payload_digest(below_id, pool.payload_digest_at(block_id))  # the same bytes
            copied.append(h)
        self._stats.spilled_blocks[below.medium] += len(copied)
        self.events.stored(below.medium, copied)

    def spill_to_disk(
        self, pool: BlockPool, block_hashes: list[BlockHash], after_put: Callable[[BlockHash], None] | None = None
    ) -> None:
        """Write blocks of ``pool`` to DISK, batched into LMDB transactions of ~64 MiB
        (evicting DISK victims in the first); keeps the newest that fit. ``after_put(h)``:
        called once LMDB has copied ``h``'s slot (``DiskTier.write_batch``'s ``after_put``)."""
        if not block_hashes or self.disk is None:
            return
        if any(h in self.disk_in_flight for h in block_hashes):
            # a background write of these blocks is under way: let it land rather than write
            # them twice (and count their room twice)
            self.wait_for_writes()
            block_hashes = [h for h in block_hashes if h not in self.disk]
            if not block_hashes:
                return
        victims = self.disk_room(len(block_hashes))
        while victims is None and block_hashes:
            block_hashes = block_hashes[1:]
            victims = self.disk_room(len(block_hashes))
        if not block_hashes:
            return
        batch = txn_blocks(self.spec.block_nbytes)
        for start in range(0, len(block_hashes), batch):
            puts = []
            for h in block_hashes[start : start + batch]:
                block_id = pool.block_id(h)
                block = pool.tensor[block_id]
                block = block if block.device.type == "cpu" else block.cpu()
                puts.append((h, self.namespace, block, pool.fingerprint_at(block_id), pool.payload_digest_at(block_id)))
            try:
                hook = None if after_put is None else (lambda i, puts=puts: after_put(puts[i][0]))
                ok = self.disk.write_batch(puts, deletes=victims if start == 0 else (), after_put=hook)
            except Exception as exc:  # never into the inference loop: the blocks are just not on DISK
                logger.warning("DISK spill of %d blocks failed: %s", len(puts), repr(exc))  # text: see lookup.py
                ok, reason = [False] * len(puts), "error"
            else:
                reason = "full"
            self._stats.spilled_blocks[Medium.DISK] += sum(ok)
            self._stats.store_failures[reason] += len(ok) - sum(ok)
            if start == 0:
                self.events.removed(Medium.DISK, [h for h in victims if h not in self.disk])
            self.events.stored(Medium.DISK, [put[0] for put, done in zip(puts, ok) if done])
        self._stats.evicted_blocks[Medium.DISK] += len(victims)

    def flush_to_disk(self) -> None:
        """Write every published block held only in memory down to DISK, oldest first."""
        if self.disk is None:
            return
        for pool in reversed(self.pools):
            only_here = [
                h for h in pool.lru_order()
                if not self._residency.is_pending(pool.medium, h) and h not in self.disk
            ]
            self.spill_to_disk(pool, only_here)


def make_pools(
    spec: KVSpec, config: StoreConfig, device: torch.device | str | None, emulate_gpu: bool = False
) -> list[BlockPool]:
    """The memory pools, top first, named by where they live.

    A GPU pool (``config.gpu_bytes``) is built only on a non-CPU ``device`` (default: ``cuda``
    when available). On a CPU device its budget joins the CPU pool, which is then the top
    pool: no tier is called GPU where there is no GPU, and the host memory used is the same
    as the config asks for. ``emulate_gpu`` builds the GPU pool on the CPU device anyway (a
    two-pool hierarchy for tests and benchmarks without CUDA; ``pool.device`` says cpu).
    """
    cuda = torch.cuda.is_available()
    device = torch.device(device if device is not None else ("cuda" if cuda else "cpu"))
    gpu_pool = config.gpu_bytes > 0 and (device.type != "cpu" or emulate_gpu)
    cpu_bytes = config.cpu_bytes + (0 if gpu_pool else config.gpu_bytes)
    pools = []
    if gpu_pool:
        pools.append(BlockPool(Medium.GPU, spec, config.gpu_bytes, device))
    if cpu_bytes:
        pools.append(BlockPool(Medium.CPU, spec, cpu_bytes, "cpu", pin_memory=cuda))
    return pools
