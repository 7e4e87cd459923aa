"""Background writes: write-through to the lower tiers and puts to the REMOTE tier.

Both run as transfer jobs on I/O threads while the store goes on; their source blocks stay
pinned (a lease) until the store *reaps* the finished job (:meth:`BackgroundWrites.reap`, at
the start of store operations, or waiting when an eviction needs those blocks). REMOTE calls
are never made under the store's lock. Every method expects the store's lock held.
"""

from __future__ import annotations

from collections import Counter

from kvtier.store.placement import Placement
from kvtier.store.residency import Residency
from kvtier.store.results import Lease, StoreStats
from kvtier.tiers.backend import RemoteBackend
from kvtier.transfer.engine import TransferEngine, TransferJob
from kvtier.types import BlockHash, Medium


class BackgroundWrites:
    """Write-through DISK writes and REMOTE puts in flight, by transfer job id.

    Args:
        placement: the local tiers (sources, DISK room).
        residency: pins on the sources.
        engine: runs the jobs (``pool -> DISK`` and ``pool -> REMOTE`` handlers registered).
        stats: counts what was written and what failed.
        remote: the REMOTE tier, or ``None``.
    """

    def __init__(
        self, placement: Placement, residency: Residency, engine: TransferEngine, stats: StoreStats,
        remote: RemoteBackend | None,
    ) -> None:
        self._placement, self._residency, self._stats, self._remote = placement, residency, stats, remote
        self.engine = engine
        self._jobs: dict[int, tuple[Medium, Lease]] = {}  # job id -> (destination, pins on its sources)

    def __bool__(self) -> bool:
        """Whether any write is in flight or not yet reaped."""
        return bool(self._jobs)

    def after_fork_in_child(self, engine: TransferEngine) -> None:
        """The parent's jobs do not exist in a forked child (their pins were dropped with
        the parent's generation: kvtier.store.residency)."""
        self._jobs.clear()
        self._placement.disk_in_flight.clear()
        self.engine = engine

    def write_through(self, block_hashes: list[BlockHash]) -> None:
        """Copy new blocks into every lower pool now; write them to DISK on an I/O thread."""
        placement = self._placement
        pools, disk = placement.pools, placement.disk
        for index in range(len(pools) - 1):
            placement.write_down(index, [h for h in block_hashes if h in pools[index]])
        if disk is None:
            return
        host = next((p for p in reversed(pools) if p.tensor.device.type == "cpu"), None)
        todo = [h for h in block_hashes if host is not None and h in host and h not in disk]
        victims = placement.disk_room(len(todo)) if todo else None
        if victims is None:
            placement.spill_to_disk(pools[-1], [h for h in block_hashes if h in pools[-1] and h not in disk])
            return
        lease = self._residency.lease(todo)  # the host copies stay until the write is done
        # Evict now, under the lock, while the victims are known to be unpinned: a job that
        # deleted them later could evict a block pinned in between (guarantee 4).
        placement.evict_from_disk(victims)
        job = TransferJob(host.medium, Medium.DISK, todo, src_ids=[host.block_id(h) for h in todo])
        placement.disk_in_flight.update(todo)
        self._jobs[self.engine.submit(job)] = (Medium.DISK, lease)

    def put_remote(self, block_hashes: list[BlockHash]) -> None:
        """Send newly stored blocks to the REMOTE tier (so that other processes hit them at
        once), from the top pool; they stay pinned until the put is done."""
        top = self._placement.top
        todo = [h for h in block_hashes if h in top and not self._residency.is_pending(top.medium, h)]
        if self._remote is None or not todo:
            return
        lease = self._residency.lease(todo)
        job = TransferJob(top.medium, Medium.REMOTE, todo, src_ids=[top.block_id(h) for h in todo])
        self._jobs[self.engine.submit(job)] = (Medium.REMOTE, lease)

    def reap(self, wait: bool = False) -> bool:
        """Consume finished jobs (``wait``: every job, waiting for it), release their pins,
        count their outcome. Returns whether any job was in flight."""
        if not self._jobs:
            return False
        ids = list(self._jobs)
        results = self.engine.wait(ids).values() if wait else self.engine.poll(ids)
        for result in results:
            medium, lease = self._jobs.pop(result.job_id)
            lease.release()
            if medium is Medium.DISK:
                self._placement.disk_in_flight.subtract(lease.block_hashes)
                self._placement.disk_in_flight += Counter()  # drop zero counts
            if medium is Medium.REMOTE:
                self._stats.stored_blocks[Medium.REMOTE] += sum(result.ok)
            else:
                self._stats.spilled_blocks[medium] += sum(result.ok)
                self._placement.events.stored(medium, [h for h, ok in zip(lease.block_hashes, result.ok) if ok])
            for reason in result.reasons.values():
                self._stats.store_failures[reason] += 1
        return True
