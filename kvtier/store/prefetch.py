"""Prefetch: pull a request's cached prefix up into the top pool while the engine does other
work, then hand it over as a :class:`~kvtier.store.results.LoadResult`.

Steps (all index changes under the store's lock; the copies outside it):

1. :meth:`Prefetcher.plan` takes the chain the lookup walked (:mod:`kvtier.store.lookup`),
   checks the token fingerprint each local tier keeps with a block against the request's
   (a block of other tokens ends the chain: a miss counted as ``token_mismatch``), pins it
   (a lease), reserves a top-pool slot for every block not already there (pending:
   invisible to lookups, never evicted) and, for a DISK or REMOTE block when the top pool is
   on CUDA, a CPU slot to stage it in; then submits DISK and REMOTE reads, split over the I/O
   threads (each read checks its record's fingerprint again), and one CPU->GPU copy job for
   blocks already in the CPU slab.
2. :meth:`PrefetchHandle.wait` waits for the reads, sends the staged blocks CPU->GPU, waits
   for the copies, then publishes every block that arrived and frees the slots of those that
   did not (a corrupt DISK record is dropped and counted). The result is the prefix up to the
   first failed block: a failure is a miss for that block and everything after it.
3. A handle dropped without ``wait()`` (a cancelled request) waits for its jobs and frees its
   slots from its finalizer (deferred if the lock is busy: see :mod:`kvtier.store.residency`).

A handle of an older generation of the store's contents (a reset came in between) publishes
nothing: ``wait()`` waits for its reads (they write into slots the reset left held for
them), sends nothing on, frees its slots and returns an empty result. A handle inherited
across ``fork()`` is inert in the child: ``wait()`` returns an empty result at once (its
jobs, and the thread that may hold its lock, exist only in the parent).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Sequence

from kvtier.records import BlockPlaces
from kvtier.store import misses
from kvtier.store.misses import Miss, MissMemory
from kvtier.store.placement import Placement
from kvtier.store.residency import Residency
from kvtier.store.results import Lease, LoadResult, StoreStats
from kvtier.transfer.engine import Delivery, DeliveryGate, JobResult, TransferEngine, TransferJob
from kvtier.types import NO_FINGERPRINT, BlockHash, Fingerprint, Medium


_DISK_JOB_NBYTES = 8 << 20
"""Bytes of a DISK read job at most (a prefix of more is split into jobs of consecutive
blocks): small enough that the connectors gather a prefix's first blocks while the I/O
threads read the rest (:meth:`PrefetchHandle.landed`), large enough that a job's own cost
(a future, a result: tens of microseconds) stays under 1% of its copy."""

_SINK_JOB_NBYTES = 1 << 62
"""Bytes of a DISK read job into the caller's buffer (``sinks``) at most: by default one run of
the prefix per I/O thread. Nothing is gathered as such a job lands, and each job costs the
submitting thread ~65 us of Python before the first read can start (it holds the GIL): a
4k-token SmolLM2-135M hit was 24 jobs; ``before_prefill`` of a DISK hit 1.52-2.35x one copy
vs 1.64-2.73x with 8 MiB jobs over three alternating rounds, 9 of 9 pairs faster
(bench/results/2026-12-03-sink-jobs)."""


@dataclass(slots=True)
class BlockPlan:
    """One block of a prefetch: where it is, where it goes."""

    block_hash: BlockHash
    source: Medium
    top_id: int
    fingerprint: Fingerprint = NO_FINGERPRINT  # kept with its slot (checked, or what the source holds)
    expected: Fingerprint | None = None  # the request's, checked by DISK/REMOTE reads
    staging_id: int | None = None  # CPU slot for DISK/REMOTE -> CPU -> GPU
    ok: bool = True
    reason: str | None = None


@dataclass
class PrefetchHandle:
    """An in-flight load of a cached prefix into the top pool (from :meth:`TieredStore.prefetch`).

    Attributes:
        lease: pins on the prefix until :meth:`wait` hands them over.
        read_jobs: DISK/REMOTE read job ids -> indices of their blocks.
        copy_jobs: pool-to-top copy job ids -> indices of their blocks.
        read_seconds: submit-to-done time of the slowest read job (set once the reads are waited).
        generation: the store's generation when it was planned (see the module doc).
        count: whether the lookup was counted (then so are the blocks it found but does not load).
        unserved: the reason of each walked block that got no plan (gone since the walk,
            beyond the top pool, no free slot), counted with the failures on ``wait``.
        sunk: indices of the blocks whose DISK read goes to the caller's sinks first (the
            ``sinks`` of :meth:`Prefetcher.plan`): once :meth:`landed` yields them, those
            :meth:`delivered_prefix` counts hold their verified bytes there.
        deliveries: read job id -> its :class:`~kvtier.transfer.engine.Delivery` (jobs with sinks).
    """

    prefetcher: "Prefetcher"
    plans: list[BlockPlan]
    lease: Lease
    generation: int = 0
    read_jobs: dict[int, list[int]] = field(default_factory=dict)
    copy_jobs: dict[int, list[int]] = field(default_factory=dict)
    submitted_at: float = field(default_factory=time.perf_counter)
    read_seconds: float = 0.0
    count: bool = False
    unserved: list[Miss] = field(default_factory=list)
    sunk: frozenset[int] = frozenset()
    deliveries: dict[int, Delivery] = field(default_factory=dict)
    _result: LoadResult | None = None
    _staged: bool = False
    _abandon: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def num_blocks(self) -> int:
        """Blocks being loaded (the hit prefix, as far as top-pool slots allowed)."""
        return len(self.plans)

    @property
    def block_ids(self) -> list[int]:
        """``[num_blocks]`` slots in ``store.top.tensor`` the prefix is loaded into, in
        request order. Read a layer of them only after :meth:`wait_layer` (or :meth:`wait`);
        :meth:`wait`'s ``LoadResult.block_ids`` is the leading part that arrived."""
        return [b.top_id for b in self.plans]

    def done(self) -> bool:
        """True when the transfers submitted so far finished (``wait`` then only has to
        send DISK blocks staged in the CPU slab on to the GPU)."""
        if self._result is not None or self.prefetcher.residency.inherited(self.generation):
            return True
        return self.prefetcher.engine.done([*self.read_jobs, *self.copy_jobs])

    def wait(self) -> LoadResult:
        """Block until the prefix is in the top pool; returns it (idempotent). Empty when a
        reset came in between (or the handle was inherited across ``fork()``)."""
        if self._result is None and self.prefetcher.residency.inherited(self.generation):
            self._result = self.prefetcher.discard(self)
            return self._result
        with self._lock:
            if self._result is None:
                self._stage()
                self._apply(self.prefetcher.engine.wait(self.copy_jobs), self.copy_jobs)
                self._result = self.prefetcher.publish(self)
            return self._result

    def wait_layer(self, layer: int) -> None:
        """Make ``layer`` of every block usable before the whole prefix is in. On CUDA the
        current stream waits for that layer's copy event (no host sync: SGLang HiCache's
        per-layer readiness); elsewhere copies are synchronous and this is :meth:`wait`.
        Call :meth:`wait` afterwards for the result and the lease."""
        if self._result is not None:  # waited: every copy is done
            return
        if self.prefetcher.residency.inherited(self.generation):
            self.wait()
            return
        with self._lock:
            if self._result is None:
                self._stage()
        engine = self.prefetcher.engine
        per_layer = [engine.events(job_id) for job_id in self.copy_jobs]
        if not per_layer or any(events is None or len(events) <= layer for events in per_layer):
            self.wait()
            return
        import torch

        stream = torch.cuda.current_stream(self.prefetcher.placement.top.tensor.device)
        for events in per_layer:
            stream.wait_event(events[layer])

    def landed(self) -> Iterator[list[int]]:
        """Indices into the prefix (request order) as their bytes land in the top pool, for
        a consumer that gathers them while later reads still run: first the blocks that
        need no read (already in the top pool), then each DISK/REMOTE read job's blocks when
        it has finished, in submission order (:meth:`Prefetcher._submit` splits DISK reads
        into chunks of consecutive blocks). A block yielded may still fail its check:
        :meth:`wait` afterwards says which leading part arrived, and only that part may be
        used. A prefix that needs copies between pools or staging (a top pool on CUDA)
        yields everything once, after :meth:`wait`."""
        staged = any(b.staging_id is not None for b in self.plans)
        if self._result is not None or self._staged or self.copy_jobs or staged:
            self.wait()
            yield list(range(len(self.plans)))
            return
        read = {i for indices in self.read_jobs.values() for i in indices}
        if len(read) < len(self.plans):
            yield [i for i in range(len(self.plans)) if i not in read]
        engine = self.prefetcher.engine
        for job_id, indices in list(self.read_jobs.items()):
            delivery = self.deliveries.get(job_id)
            if delivery is not None:
                delivery.wait()  # in the sinks: the copies into the top pool may still run
            else:
                engine.join([job_id])
            yield indices

    @property
    def served_from_sinks(self) -> bool:
        """Every block is either in the top pool already or read into the caller's sinks
        (:attr:`sunk`): then :meth:`delivered_prefix` says, before :meth:`wait`, which
        leading blocks the caller may use."""
        top = self.prefetcher.placement.top.medium
        return bool(self.sunk) and not self.copy_jobs and all(
            i in self.sunk or b.source is top for i, b in enumerate(self.plans))

    def delivered_prefix(self) -> int:
        """Leading blocks usable now (:attr:`served_from_sinks` handles only: waits for the
        deliveries): those in the top pool from the start (pinned by the lease) and those
        whose sink holds their verified bytes, up to the first that failed. :meth:`wait`
        later publishes them into the top pool; it may still find one of them failed (its
        second read into the pool: a record that changed on disk in between), and then
        that block and the rest are not published, but the sink's bytes were verified.

        Raises:
            RuntimeError: not :attr:`served_from_sinks`.
        """
        if not self.served_from_sinks:
            raise RuntimeError("delivered_prefix needs a handle served from sinks")
        ok = [True] * len(self.plans)
        if self.prefetcher.residency.inherited(self.generation):
            return 0
        for job_id, indices in self.read_jobs.items():
            for index, good in zip(indices, self.deliveries[job_id].wait()):
                ok[index] = good
        return next((i for i, good in enumerate(ok) if not good), len(ok))

    def _stage(self) -> None:
        """Wait for the DISK reads, then send blocks staged in the CPU slab on to the GPU."""
        if self._staged:
            return
        self._staged = True
        engine = self.prefetcher.engine
        reads = engine.wait(self.read_jobs)
        self.read_seconds = max((r.seconds for r in reads.values()), default=0.0)
        self._apply(reads, self.read_jobs)
        staged = [i for i, b in enumerate(self.plans) if b.staging_id is not None and b.ok]
        if staged and self.prefetcher.residency.is_current(self.generation):  # after a reset: nothing to send on
            placement = self.prefetcher.placement
            cpu, top = placement.pool(Medium.CPU), placement.top
            job = TransferJob(
                cpu.medium, top.medium, [self.plans[i].block_hash for i in staged],
                src_ids=[self.plans[i].staging_id for i in staged], dst_ids=[self.plans[i].top_id for i in staged],
            )
            self.copy_jobs[engine.submit(job)] = staged

    def _apply(self, results: dict[int, JobResult], jobs: dict[int, list[int]]) -> None:
        """Mark failed blocks; a job with no result (the store closed under it) fails whole."""
        for job_id, indices in jobs.items():
            result = results.get(job_id)
            for k, index in enumerate(indices):
                if (result is None or not result.ok[k]) and self.plans[index].ok:
                    self.plans[index].ok = False
                    self.plans[index].reason = "cancelled" if result is None else result.reasons.get(k, "error")


class Prefetcher:
    """Plans, submits and publishes prefetches for one store.

    Args:
        placement: the local tiers (slots, room, DISK records to drop).
        residency: the store's lock, pins and pending slots.
        engine: runs the reads and copies.
        stats: counts loads and load failures.
        num_io_threads: DISK/REMOTE reads are split into this many jobs.
        observe: ``observe(op, t0)``: the store's latency hook, called with ``"load"``.
        memory: where blocks that fail verification are remembered (:mod:`kvtier.store.misses`).
    """

    def __init__(
        self, placement: Placement, residency: Residency, engine: TransferEngine, stats: StoreStats,
        num_io_threads: int, observe: Callable[[str, float], None], memory: MissMemory,
    ) -> None:
        self.placement, self.engine = placement, engine
        self.residency = self._residency = residency  # (handles ask it for the generation)
        self._stats, self._memory = stats, memory
        self._num_io_threads, self._observe = num_io_threads, observe

    def plan(
        self, block_hashes: Sequence[BlockHash], media: Sequence[Medium],
        fingerprints: Sequence[Fingerprint] | None = None, count: bool = False, namespace: bytes = b"",
        walked_generation: int | None = None, sinks: Callable[[int], Sequence[Any] | None] | None = None,
    ) -> PrefetchHandle:
        """Step 1 (the caller holds the store's lock). ``media``: what the lookup walk found
        for the leading blocks (a REMOTE block was found outside the lock); each block's
        medium is looked up again here, since the lock was let go in between.
        ``fingerprints``: the request's (``None``: not checked). ``count``: the walk was
        counted, so the blocks it found that will not load are counted as misses (with
        ``namespace``, the store's, for their reasons; a block of other tokens as
        ``token_mismatch``). REMOTE blocks found by a walk of an older generation
        (``walked_generation``: a reset came in between, and may be emptying REMOTE) are not
        trusted. ``sinks``: called (under the lock: keep it short) with the number of blocks
        planned when some come from DISK straight into a host-memory top pool; returns a
        second destination per block (tensors of the block's shape, any strides, or a
        :class:`~kvtier.records.BlockPlaces`) or ``None``: the DISK reads then write each
        block's verified bytes there too, from cache (``handle.sunk``; the HF connector's hit
        buffer, so a DISK hit is not gathered again from the pool)."""
        remote_ok = walked_generation is None or self._residency.is_current(walked_generation)
        walked = self._chain(block_hashes, media, fingerprints, remote_ok)
        unserved: list[Miss] = []
        if count and len(walked) < len(media):  # gone, in flight elsewhere or of other tokens
            unserved += misses.classify(self.placement, self._memory, block_hashes[: len(media)], len(walked),
                                        False, None, namespace)
        # A load never holds more than the top pool: pin only the head that fits, so that the
        # chain's own tail (resident in the top pool after a long store) can make room for it.
        top = self.placement.top
        chain = walked[: top.num_blocks]
        lease = self._residency.lease([b.block_hash for b in chain])
        self.placement.make_room(0, sum(1 for b in chain if b.source is not top.medium))
        plans = self._reserve(chain)
        if len(plans) < len(chain):
            shorter = self._residency.lease([b.block_hash for b in plans])
            lease.release()
            lease = shorter
        if count:
            unserved = [(misses.NO_FREE_SLOT, str(b.source), "") for b in chain[len(plans) :]] + [
                (misses.BEYOND_TOP_CAPACITY, str(b.source), "") for b in walked[top.num_blocks :]] + unserved
        handle = PrefetchHandle(self, plans, lease, self._residency.generation, count=count, unserved=unserved)
        try:
            self._submit(handle, sinks)
        except BaseException:  # a job not made or not taken: wait the submitted ones, free every slot and pin
            self._cancel(plans, [*handle.read_jobs, *handle.copy_jobs], lease, handle.generation)
            raise
        # Dropped without wait() (the request was cancelled): wait its jobs and free its slots.
        handle._abandon = weakref.finalize(
            handle, self._residency.defer_or_run,
            partial(self._cancel, plans, [*handle.read_jobs, *handle.copy_jobs], lease, handle.generation),
        )
        return handle

    def _chain(
        self, block_hashes: Sequence[BlockHash], media: Sequence[Medium], fingerprints: Sequence[Fingerprint] | None,
        remote_ok: bool = True,
    ) -> list[BlockPlan]:
        """The walked prefix as it stands now: ends at a block gone since the walk, at one
        another request is bringing into the top pool, at a repeat, or at a block a local
        tier keeps with another fingerprint than the request's (counted ``token_mismatch``).
        A block in the top pool carries its slot there; the others' slots are not reserved
        yet (``top_id`` -1)."""
        top, placement = self.placement.top, self.placement
        chain: list[BlockPlan] = []
        seen: set[BlockHash] = set()
        expected_all = fingerprints if fingerprints is not None else [None] * len(block_hashes)
        # one pass with the indexes at hand (placement.medium_of and fingerprint_of per block
        # were 4 method calls a block: ~40% of a CPU hit's planning, bench/results/2026-12-02-hit-4)
        pending = self._residency.pending_slots()
        pools = [(pool, pool.medium, *pool.index_segments()) for pool in placement.pools]
        disk, top_medium = placement.disk, top.medium
        for h, walked, expected in zip(block_hashes, media, expected_all):
            if h in seen or (top_medium, h) in pending:
                break
            for pool, medium, probation, protected in pools:
                block_id = probation.get(h)
                if block_id is None:
                    block_id = protected.get(h)
                if block_id is not None and (medium, h) not in pending:
                    stored = pool.fingerprint_at(block_id)
                    break
            else:
                if disk is not None and h in disk:
                    medium, stored = Medium.DISK, disk.fingerprint_of(h)
                elif walked is Medium.REMOTE and remote_ok:
                    # checked by the read; an unchecked one is of unknown tokens
                    medium, stored = Medium.REMOTE, expected if expected is not None else NO_FINGERPRINT
                else:
                    break
            if medium is not Medium.REMOTE and expected is not None and stored != expected:
                self._stats.load_failures[misses.TOKEN_MISMATCH] += 1
                self._stats.load_failures_by_tier[(str(medium), misses.TOKEN_MISMATCH)] += 1
                self._memory.note_failed(h, str(medium), misses.TOKEN_MISMATCH)  # its miss reason
                break
            seen.add(h)
            chain.append(BlockPlan(h, medium, block_id if medium is top_medium else -1, stored, expected))
        return chain

    def _reserve(self, chain: list[BlockPlan]) -> list[BlockPlan]:
        """Top-pool slots (and CPU staging slots) for ``chain``, pending; stops at the first
        block that gets none."""
        placement, residency = self.placement, self._residency
        top, cpu = placement.top, placement.pool(Medium.CPU)
        stage_on_cpu = top.tensor.device.type != "cpu"
        plans: list[BlockPlan] = []
        for b in chain:
            h, medium = b.block_hash, b.source
            if medium is top.medium:  # its slot: found by _chain
                plans.append(b)
                continue
            if medium in (Medium.DISK, Medium.REMOTE) and stage_on_cpu:
                if cpu is None:
                    break  # DISK and REMOTE reads land in host memory; without a CPU slab, stop here
                placement.make_room(placement.pools.index(cpu), 1)
                b.staging_id = cpu.allocate(h, b.fingerprint)
                if b.staging_id is None:
                    break
                residency.add_pending(Medium.CPU, h)
            top_id = top.allocate(h, b.fingerprint)
            if top_id is None:
                if b.staging_id is not None:
                    residency.free_pending(cpu, [h])
                break
            residency.add_pending(top.medium, h)
            b.top_id = top_id
            plans.append(b)
        return plans

    def _submit(self, handle: PrefetchHandle, sinks: Callable[[int], Sequence[Any] | None] | None = None) -> None:
        top, plans = self.placement.top, handle.plans
        dst = Medium.CPU if top.tensor.device.type != "cpu" else top.medium
        views = None
        if sinks is not None and dst is top.medium and any(b.source is Medium.DISK for b in plans):
            views = sinks(len(plans))
        for source in (Medium.DISK, Medium.REMOTE):
            reads = [i for i, b in enumerate(plans) if b.source is source]
            if not reads:
                continue
            num_jobs = min(len(reads), self._num_io_threads)
            if source is Medium.DISK:  # runs of consecutive blocks, in order: gathered as they land
                job_nbytes = _DISK_JOB_NBYTES if views is None else _SINK_JOB_NBYTES  # sinks: nothing gathers
                size = max(1, min(-(-len(reads) // num_jobs), job_nbytes // self.placement.spec.block_nbytes))
                parts = [reads[k : k + size] for k in range(0, len(reads), size)]
            else:  # REMOTE: one batch request per I/O thread
                parts = [reads[k::num_jobs] for k in range(num_jobs)]
            # the reads into the top pool behind the sinks start after the last delivery
            gate = DeliveryGate(len(parts)) if views is not None and source is Medium.DISK else None
            # Every job is made before the first starts: a started job's thread takes the GIL
            # for its headers, and making the next job's sinks then waited for it (~0.2 ms of
            # a 1k-token DISK hit, issue 17; bench/results/2026-12-03-hit-overhead).
            jobs = []
            for part in parts:
                ids = [plans[i].staging_id if dst is not top.medium else plans[i].top_id for i in part]
                job = TransferJob(source, dst, [plans[i].block_hash for i in part], dst_ids=ids,
                                  fingerprints=[plans[i].expected for i in part])
                if gate is not None:
                    sinks = views.subset(part) if isinstance(views, BlockPlaces) else [views[i] for i in part]
                    job.sinks, job.delivery, job.gate = sinks, Delivery(), gate
                jobs.append(job)
            if gate is not None:
                handle.sunk = handle.sunk | frozenset(i for part in parts for i in part)
            for k, (part, job) in enumerate(zip(parts, jobs)):
                try:
                    job_id = self.engine.submit(job)
                except BaseException:
                    if gate is not None:  # the jobs not submitted never arrive: open the gate for the others
                        for _ in parts[k:]:
                            gate.arrive()
                    raise
                handle.read_jobs[job_id] = part
                if job.delivery is not None:
                    handle.deliveries[job_id] = job.delivery
        copies = [i for i, b in enumerate(plans) if b.source not in (top.medium, Medium.DISK, Medium.REMOTE)]
        if copies:
            src = self.placement.pool(plans[copies[0]].source)
            job = TransferJob(
                src.medium, top.medium, [plans[i].block_hash for i in copies],
                src_ids=[src.block_id(plans[i].block_hash) for i in copies],
                dst_ids=[plans[i].top_id for i in copies],
            )
            handle.copy_jobs[self.engine.submit(job)] = copies

    def publish(self, handle: PrefetchHandle) -> LoadResult:
        """Step 2's bookkeeping, under the store's lock: the prefix up to the first failure."""
        with self._residency.lock:
            if handle._abandon is not None:
                handle._abandon.detach()
            if not self._residency.is_current(handle.generation):
                return self.discard(handle)
            top, placement, stats = self.placement.top, self.placement, self._stats
            top_medium = top.medium
            # the usual hit: every block was in the top pool already, or arrived: one pass of
            # set and Counter operations, no per-block method calls
            settled = all(b.ok and b.staging_id is None for b in handle.plans)
            if settled:
                self._residency.end_pending_many(
                    top_medium, [b.block_hash for b in handle.plans if b.source is not top_medium])
            for b in () if settled else handle.plans:
                moved = b.source is not top_medium
                for medium, in_flight in ((top_medium, moved), (Medium.CPU, b.staging_id is not None)):
                    if in_flight:
                        if b.ok:
                            self._residency.end_pending(medium, b.block_hash)
                        else:
                            self._residency.free_pending(placement.pool(medium), [b.block_hash])
                if not b.ok:
                    reason = b.reason or "error"
                    stats.load_failures[reason] += 1
                    stats.load_failures_by_tier[(str(b.source), reason)] += 1
                    self._memory.note_failed(b.block_hash, str(b.source), reason)
                    if b.source is Medium.DISK and b.reason in ("corrupt", "missing") and placement.disk is not None:
                        placement.disk.remove([b.block_hash])  # never claim it again
                        placement.events.removed(Medium.DISK, [b.block_hash])
            num_ok = next((i for i, b in enumerate(handle.plans) if not b.ok), len(handle.plans))
            if handle.count:
                self._count_unserved(handle, num_ok)
            self._publish_events(handle)
            loaded = handle.plans[:num_ok]
            sources = [b.source for b in loaded]
            stats.loaded_blocks.update(sources)
            hashes = [b.block_hash for b in loaded]
            placement.touch_tail_first(hashes)
            if num_ok == len(handle.plans):
                lease = handle.lease  # the pins of the whole plan are those of the result
            else:
                lease = self._residency.lease(hashes)
                handle.lease.release()
            self._observe("load", handle.submitted_at)
            return LoadResult([b.top_id for b in loaded], sources, lease, [b.fingerprint for b in loaded])

    def discard(self, handle: PrefetchHandle) -> LoadResult:
        """A handle of an older generation (a reset came in between, or a ``fork()``): free
        its slots (its jobs are done or do not exist here), publish nothing."""
        with self._residency.lock:
            if handle._abandon is not None:
                handle._abandon.detach()
            self._free_slots(handle.plans, handle.generation)
            handle.lease.release()
            return LoadResult([], [], self._residency.lease([]))

    def _publish_events(self, handle: PrefetchHandle) -> None:
        """KV events of the copies this load published: the top pool (and the CPU staging
        slab) now hold the blocks that arrived."""
        events, top = self.placement.events, self.placement.top
        if not events.active:
            return
        chain = [b.block_hash for b in handle.plans]
        events.stored_runs(top.medium, chain, [b.block_hash for b in handle.plans if b.ok and b.source is not top.medium])
        events.stored(Medium.CPU, [b.block_hash for b in handle.plans if b.ok and b.staging_id is not None])

    def _count_unserved(self, handle: PrefetchHandle, num_ok: int) -> None:
        """Misses of a counted load: the blocks after the first failure (a failed one by its
        load-failure reason, a loaded one as after_gap) and those planned out."""
        unserved = list(handle.unserved)
        for b in handle.plans[num_ok:]:
            tier = str(b.source)
            if b.ok:
                unserved.append((misses.AFTER_GAP, tier, ""))
            else:
                reason = b.reason or "error"
                unserved.append((misses.load_failure_reason(tier, reason), tier, reason))
        misses.count(self._stats.miss_tokens, unserved, self.placement.spec.block_size)

    def _cancel(self, plans: list[BlockPlan], job_ids: list[int], lease: Lease, generation: int) -> None:
        """Clean up an abandoned prefetch (the caller holds the store's lock)."""
        self.engine.wait(job_ids)
        self._free_slots(plans, generation)
        lease.release()

    def _free_slots(self, plans: list[BlockPlan], generation: int) -> None:
        top, cpu = self.placement.top, self.placement.pool(Medium.CPU)
        for b in plans:
            if b.source is not top.medium:
                self._residency.free_pending(top, [b.block_hash], generation)
            if b.staging_id is not None and cpu is not None:
                self._residency.free_pending(cpu, [b.block_hash], generation)
