"""Prefetch: pull a request's cached prefix up into the top pool while the engine does other
work, then hand it over as a :class:`~kvtier.results.LoadResult`.

Steps (all index changes under the store's lock; the copies outside it):

1. ``plan_prefetch`` walks the hit chain, pins it (a lease), reserves a top-pool slot for
   every block not already there (pending: invisible to lookups, never evicted) and, for a
   DISK block when the top pool is on CUDA, a CPU slot to stage it in; then submits
   DISK and REMOTE reads, split over the I/O threads, and one CPU->GPU copy job for blocks
   already in the CPU slab. (The REMOTE part of the prefix is asked for before the lock is
   taken: ``TieredStore.prefetch``.)
2. ``PrefetchHandle.wait`` waits for the reads, sends the staged blocks CPU->GPU, waits for
   the copies, then publishes every block that arrived and frees the slots of those that did
   not (a corrupt DISK record is dropped and counted). The result is the prefix up to the
   first failed block: a failure is a miss for that block and everything after it.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Sequence

from kvtier.results import Lease, LoadResult
from kvtier.transfer.engine import JobResult, TransferJob
from kvtier.types import BlockHash, Medium

if TYPE_CHECKING:
    from kvtier.store import TieredStore


@dataclass(slots=True)
class BlockPlan:
    """One block of a prefetch: where it is, where it goes."""

    block_hash: BlockHash
    source: Medium
    top_id: int
    staging_id: int | None = None  # CPU slot for DISK -> CPU -> GPU
    ok: bool = True
    reason: str | None = None


@dataclass
class PrefetchHandle:
    """An in-flight load of a cached prefix into the top pool.

    Attributes:
        blocks: per block of the prefix, its plan.
        lease: pins on the prefix until :meth:`wait` hands them over.
    """

    store: "TieredStore"
    blocks: list[BlockPlan]
    lease: Lease
    read_jobs: dict[int, list[int]] = field(default_factory=dict)  # job id -> block indices
    copy_jobs: dict[int, list[int]] = field(default_factory=dict)
    submitted_at: float = field(default_factory=time.perf_counter)
    read_seconds: float = 0.0
    """Submit-to-done time of the slowest DISK read job (set once the reads are waited)."""
    _result: LoadResult | None = None
    _staged: bool = False
    _abandon: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def num_blocks(self) -> int:
        """Blocks being loaded (the hit prefix, as far as top-pool slots allowed)."""
        return len(self.blocks)

    def done(self) -> bool:
        """True when the transfers submitted so far finished (``wait`` then only has to
        send DISK blocks staged in the CPU slab on to the GPU)."""
        return self._result is not None or self.store.engine.done([*self.read_jobs, *self.copy_jobs])

    def wait(self) -> LoadResult:
        """Block until the prefix is in the top pool; returns it (idempotent)."""
        with self._lock:
            if self._result is None:
                self._stage()
                self._apply(self.store.engine.wait(self.copy_jobs), self.copy_jobs)
                with self.store._lock:
                    if self._abandon is not None:
                        self._abandon.detach()
                    self._result = _publish(self.store, self)
                    self.store._observe("load", self.submitted_at)
            return self._result

    def wait_layer(self, layer: int) -> None:
        """Make ``layer`` of every block usable before the whole prefix is in. On CUDA the
        current stream waits for that layer's copy event (no host sync: SGLang HiCache's
        per-layer readiness); elsewhere copies are synchronous and this is :meth:`wait`.
        Call :meth:`wait` afterwards for the result and the lease."""
        with self._lock:
            if self._result is None:
                self._stage()
        per_layer = [self.store.engine.events(job_id) for job_id in self.copy_jobs]
        if not per_layer or any(events is None or len(events) <= layer for events in per_layer):
            self.wait()
            return
        import torch

        stream = torch.cuda.current_stream(self.store.top.tensor.device)
        for events in per_layer:
            stream.wait_event(events[layer])

    def _stage(self) -> None:
        """Wait for the DISK reads, then send blocks staged in the CPU slab on to the GPU."""
        if self._staged:
            return
        self._staged = True
        store = self.store
        reads = store.engine.wait(self.read_jobs)
        self.read_seconds = max((r.seconds for r in reads.values()), default=0.0)
        self._apply(reads, self.read_jobs)
        staged = [i for i, b in enumerate(self.blocks) if b.staging_id is not None and b.ok]
        if staged:
            cpu, top = store.pool(Medium.CPU), store.top
            job = TransferJob(
                cpu.medium, top.medium, [self.blocks[i].block_hash for i in staged],
                src_ids=[self.blocks[i].staging_id for i in staged], dst_ids=[self.blocks[i].top_id for i in staged],
            )
            self.copy_jobs[store.engine.submit(job)] = staged

    def _apply(self, results: dict[int, JobResult], jobs: dict[int, list[int]]) -> None:
        """Mark failed blocks; a job with no result (the store closed under it) fails whole."""
        for job_id, indices in jobs.items():
            result = results.get(job_id)
            for k, index in enumerate(indices):
                if (result is None or not result.ok[k]) and self.blocks[index].ok:
                    self.blocks[index].ok = False
                    self.blocks[index].reason = "cancelled" if result is None else result.reasons.get(k, "error")


def plan_prefetch(
    store: "TieredStore", block_hashes: Sequence[BlockHash], remote_hashes: frozenset = frozenset(), count: bool = True
) -> PrefetchHandle:
    """Step 1 above; the caller holds the store's lock. ``remote_hashes``: blocks the REMOTE
    tier reported (asked before the lock was taken); ``count``: add to the lookup stats."""
    chain: list[tuple[BlockHash, Medium]] = []
    seen: set[BlockHash] = set()
    for h in block_hashes:
        medium = store.medium_of(h)
        if medium is None and h in remote_hashes:
            medium = Medium.REMOTE
        if medium is None or (store.top.medium, h) in store._pending or h in seen:
            break  # the end of the prefix, a block another request is bringing up, or a repeat
        seen.add(h)
        chain.append((h, medium))
    hit_chain = chain
    # A load never holds more than the top pool: pin only the head that fits, so that the
    # chain's own tail (resident in the top pool after a long store) can make room for it.
    chain = chain[: store.top.num_blocks]
    if count:
        store.stats.lookup_blocks += len(block_hashes)
        for _, medium in hit_chain:
            if medium is not Medium.REMOTE:
                store.stats.hit_blocks[medium] += 1
        num_local = next((i for i, (_, m) in enumerate(hit_chain) if m is Medium.REMOTE), len(hit_chain))
        if store.remote is not None and num_local < len(block_hashes):
            store.stats.remote_lookup_blocks += len(block_hashes) - num_local
            store.stats.hit_blocks[Medium.REMOTE] += sum(1 for _, m in hit_chain if m is Medium.REMOTE)
    lease = Lease(store, [h for h, _ in chain])
    top = store.top
    store._make_room(0, sum(1 for _, m in chain if m is not top.medium))
    cpu = store.pool(Medium.CPU)
    stage_on_cpu = top.tensor.device.type != "cpu"
    blocks: list[BlockPlan] = []
    for h, medium in chain:
        if medium is top.medium:
            blocks.append(BlockPlan(h, medium, top.block_id(h)))
            continue
        staging_id = None
        if medium in (Medium.DISK, Medium.REMOTE) and stage_on_cpu:
            if cpu is None:
                break  # DISK and REMOTE reads land in host memory; without a CPU slab, stop here
            store._make_room(store.pools.index(cpu), 1)
            staging_id = cpu.allocate(h)
            if staging_id is None:
                break
            store._pending.add((Medium.CPU, h))
        top_id = top.allocate(h)
        if top_id is None:
            if staging_id is not None:
                store._pending.discard((Medium.CPU, h))
                cpu.free(h)
            break
        store._pending.add((top.medium, h))
        blocks.append(BlockPlan(h, medium, top_id, staging_id))
    if len(blocks) < len(chain):
        shorter = Lease(store, [b.block_hash for b in blocks])
        lease.release()
        lease = shorter
    handle = PrefetchHandle(store, blocks, lease)
    _submit(store, handle)
    # Dropped without wait() (the request was cancelled): wait its jobs and free its slots.
    handle._abandon = weakref.finalize(
        handle, store._defer_or_run,
        partial(_cancel, store, blocks, dict(handle.read_jobs), dict(handle.copy_jobs), lease),
    )
    return handle


def _cancel(store: "TieredStore", blocks, read_jobs, copy_jobs, lease: Lease) -> None:
    """Clean up an abandoned prefetch (the caller holds the store's lock)."""
    store.engine.wait([*read_jobs, *copy_jobs])
    top, cpu = store.top, store.pool(Medium.CPU)
    for b in blocks:
        if b.source is not top.medium:
            store._free_pending(top, [b.block_hash])
        if b.staging_id is not None and cpu is not None:
            store._free_pending(cpu, [b.block_hash])
    lease.release()


def _submit(store: "TieredStore", handle: PrefetchHandle) -> None:
    top = store.top
    dst = Medium.CPU if top.tensor.device.type != "cpu" else top.medium
    for source in (Medium.DISK, Medium.REMOTE):
        reads = [i for i, b in enumerate(handle.blocks) if b.source is source]
        if not reads:
            continue
        num_jobs = min(len(reads), store.config.num_io_threads)
        for part in (reads[k::num_jobs] for k in range(num_jobs)):
            ids = [handle.blocks[i].staging_id if dst is not top.medium else handle.blocks[i].top_id for i in part]
            job = TransferJob(source, dst, [handle.blocks[i].block_hash for i in part], dst_ids=ids)
            handle.read_jobs[store.engine.submit(job)] = part
    copies = [i for i, b in enumerate(handle.blocks) if b.source not in (top.medium, Medium.DISK, Medium.REMOTE)]
    if copies:
        src = store.pool(handle.blocks[copies[0]].source)
        job = TransferJob(
            src.medium, top.medium, [handle.blocks[i].block_hash for i in copies],
            src_ids=[src.block_id(handle.blocks[i].block_hash) for i in copies],
            dst_ids=[handle.blocks[i].top_id for i in copies],
        )
        handle.copy_jobs[store.engine.submit(job)] = copies


def _publish(store: "TieredStore", handle: PrefetchHandle) -> LoadResult:
    """Step 2's bookkeeping; the caller holds the store's lock."""
    top = store.top
    num_ok = next((i for i, b in enumerate(handle.blocks) if not b.ok), len(handle.blocks))
    for b in handle.blocks:
        moved = b.source is not top.medium
        for medium, in_flight in ((top.medium, moved), (Medium.CPU, b.staging_id is not None)):
            if not in_flight:
                continue
            store._pending.discard((medium, b.block_hash))
            if not b.ok:
                store.pool(medium).free(b.block_hash)
        if not b.ok:
            store.stats.load_failures[b.reason or "error"] += 1
            store.stats.load_failures_by_tier[(str(b.source), b.reason or "error")] += 1
            if b.source is Medium.DISK and b.reason in ("corrupt", "missing") and store.disk is not None:
                store.disk.remove([b.block_hash])  # never claim it again
    loaded = handle.blocks[:num_ok]
    for b in loaded:
        store.stats.loaded_blocks[b.source] += 1
    hashes = [b.block_hash for b in loaded]
    store._touch_tail_first(hashes)
    lease = Lease(store, hashes)
    handle.lease.release()
    return LoadResult([b.top_id for b in loaded], [b.source for b in loaded], lease)
