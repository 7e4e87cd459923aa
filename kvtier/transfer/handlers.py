"""Transfer handlers: pool<->pool copies (CUDA side streams), DISK and REMOTE I/O (a thread
pool).

GPU<->CPU ordering on CUDA (cases G1, G2). Submit jobs from the thread that runs the model:
the side stream is ordered after *that thread's* current stream.
- a job first makes its side stream wait for the submitting thread's current (compute)
  stream, so a store copies bytes only after the kernels that produced them, and a load
  overwrites a slot only after the kernels reading its old occupant;
- it records one event per layer (per-layer jobs) or one at the end; the consumer makes its
  compute stream wait on that event (no host sync), and the store frees or reuses the source
  slots (pinned host memory used as staging) only once the job is reported done, i.e. after
  its event completed.
On a machine without CUDA the same code runs the copies synchronously.

DISK reads go straight into preallocated pool slots (``DiskTier.read_into``: one copy from
LMDB's memory map, no intermediate ``bytes``); writes are one LMDB write transaction per job.
LMDB's MVCC makes a concurrent read of a block being rewritten see the whole old or new
record, or a miss.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable

import torch

from kvtier.records import BlockPlaces, ReadStatus
from kvtier.tiers.backend import RemoteBackend
from kvtier.tiers.disk import DiskTier, txn_blocks
from kvtier.tiers.pool import BlockPool
from kvtier.transfer.engine import Completed, JobResult, Pending, TransferEngine, TransferHandler, TransferJob, failed
from kvtier.types import Medium

logger = logging.getLogger(__name__)


class _EventPending(Pending):
    """A CUDA job: done when its last event completed."""

    def __init__(self, result: JobResult, events: list, started: float) -> None:
        self._result, self.events, self._started = result, events, started

    def done(self) -> bool:
        return self.events[-1].query()

    def result(self, timeout: float | None = None) -> JobResult:
        self.events[-1].synchronize()
        self._result.seconds = time.perf_counter() - self._started
        return self._result


class _FuturePending(Pending):
    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> JobResult:
        return self._future.result(timeout)


class PoolCopyHandler(TransferHandler):
    """Copies whole blocks ``src.tensor[src_ids[i]] -> dst.tensor[dst_ids[i]]``.

    Args:
        src, dst: the pools (``[num_blocks, num_layers, 2, block_size, num_kv_heads,
            head_dim]`` each, same spec).
        per_layer: copy layer by layer and record one event per layer (``Pending.events``),
            so a consumer can start on layer ``l`` once it is in (CUDA only).
    """

    def __init__(self, src: BlockPool, dst: BlockPool, per_layer: bool = False) -> None:
        self.src, self.dst, self.per_layer = src, dst, per_layer
        cuda = [t.device for t in (src.tensor, dst.tensor) if t.device.type == "cuda"]
        self.device = cuda[0] if cuda else None
        self.stream = torch.cuda.Stream(self.device) if self.device is not None else None

    def start(self, job: TransferJob) -> Pending:
        started = time.perf_counter()
        assert job.src_ids is not None and job.dst_ids is not None
        pairs = list(zip(job.src_ids, job.dst_ids))
        nbytes = len(pairs) * self.src.spec.block_nbytes
        result = JobResult(job.job_id, [True] * len(pairs), nbytes=nbytes)
        if self.stream is None:
            for s, d, n in slot_runs(pairs):
                self.dst.tensor[d : d + n].copy_(self.src.tensor[s : s + n])
            result.seconds = time.perf_counter() - started
            return Completed(result)
        events = []
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the compute (G1)
        with torch.cuda.stream(self.stream):
            if self.per_layer:
                # One block's layer is one contiguous slab: a strided multi-block slice would
                # make copy_ stage it through pageable memory (a blocking copy).
                for start, stop in self.src.spec.layer_ranges():
                    for s, d in pairs:
                        dst, src = self.dst.tensor[d].view(-1), self.src.tensor[s].view(-1)
                        dst[start:stop].copy_(src[start:stop], non_blocking=True)
                    events.append(torch.cuda.Event())
                    events[-1].record(self.stream)
            else:
                for s, d, n in slot_runs(pairs):
                    self.dst.tensor[d : d + n].copy_(self.src.tensor[s : s + n], non_blocking=True)
                events.append(torch.cuda.Event())
                events[-1].record(self.stream)
        return _EventPending(result, events, started)


class _IOHandler(TransferHandler):
    """A handler whose jobs run on the shared I/O thread pool: ``_read`` when the job has
    destination slots, else ``_write``; an exception fails the job, never the caller."""

    executor: ThreadPoolExecutor

    def start(self, job: TransferJob) -> Pending:
        started = time.perf_counter()
        run = self._read if job.dst_ids is not None else self._write
        return _FuturePending(self.executor.submit(self._guarded, run, job, started))

    def _guarded(self, run, job: TransferJob, started: float) -> JobResult:
        try:
            result = run(job)
        except Exception as exc:  # an I/O thread never raises into the engine's caller
            logger.exception("%s job %d failed: %s", type(self).__name__, job.job_id, exc)
            result = failed(job, "error", started)
        result.seconds = time.perf_counter() - started
        return result


class DiskHandler(_IOHandler):
    """DISK <-> a host-memory pool, on ``num_threads`` I/O threads.

    Args:
        disk: the DISK tier.
        pool: a pool whose tensor is in host memory (the CPU slab, or the top pool on a
            machine without CUDA).
        namespace: written into records and checked on reads.
        executor: the shared I/O thread pool.
    """

    def __init__(self, disk: DiskTier, pool: BlockPool, namespace: bytes, executor: ThreadPoolExecutor) -> None:
        assert pool.tensor.device.type == "cpu", "DISK I/O needs a host-memory pool"
        self.disk, self.pool, self.namespace, self.executor = disk, pool, namespace, executor

    def _read(self, job: TransferJob) -> JobResult:
        return self._read_slots(job, [ReadStatus.OK.value] * len(job.block_hashes))

    def start(self, job: TransferJob) -> Pending:
        """A read with sinks (``job.sinks``) runs in two tasks: the reads into the sinks,
        which set ``job.delivery``, then the reads into the slots, queued behind the jobs
        submitted meanwhile (the rest of the same prefix's reads into its sinks go first) or,
        with ``job.gate``, once every job of the gate has delivered, all of the gate's jobs as
        one task of the I/O pool, one after another (queued behind the work already there,
        such as another request's reads): the other I/O threads, and a core, stay free for
        the caller finishing the hit meanwhile (``before_prefill`` of a SmolLM2-135M DISK hit
        over one copy, medians of 20 interleaved pairs on the 2-core test VM against each
        promotion submitted on its own: 1k tokens 1.54 -> 1.52x, 2k 1.45 -> 1.40x, 4k 1.62 ->
        1.46x, of the order of that host's run-to-run spread; the promotions' end 2.9-3.3x ->
        3.0-3.3x, off the request's path: bench/results/2026-12-02-overlap/micro/promote_ab.log).
        The job is done when both tasks are; anything else runs as one task."""
        if job.sinks is None or job.dst_ids is None:
            return super().start(job)
        started, n = time.perf_counter(), len(job.block_hashes)
        done: Future = Future()

        def finish(statuses: list[str]) -> None:
            try:
                result = self._read_slots(job, statuses)
            except Exception as exc:  # an I/O thread never raises into the engine's caller
                logger.exception("DISK read job %d failed: %s", job.job_id, exc)
                result = failed(job, "error", started)
            result.seconds = time.perf_counter() - started
            done.set_result(result)

        def deliver() -> None:
            statuses = ["error"] * n
            try:
                expected = job.fingerprints or [None] * n
                statuses = [s.value for s in self.disk.read_into_views(job.block_hashes, self.namespace, job.sinks, expected)]
            except Exception as exc:
                logger.warning("DISK read of %d blocks failed: %s", n, exc)
            finally:
                if job.delivery is not None:  # first: dropping the sinks' views takes ~3 us each, with the GIL
                    job.delivery.set([status == ReadStatus.OK.value for status in statuses])
                job.sinks = None  # the caller's buffer is its own again (it reuses it when no one else holds it)

            if job.gate is not None:  # after the prefix's last delivery: all of its promotions as one task
                job.gate.arrive(partial(finish, statuses), run=self._in_pool)
            else:
                self._in_pool(partial(finish, statuses))

        try:
            self.executor.submit(deliver)
        except BaseException:
            if job.delivery is not None:
                job.delivery.set([False] * n)
            if job.gate is not None:
                job.gate.arrive()  # never delivers: the prefix's other jobs must not wait for it
            raise
        return _FuturePending(done)

    def _in_pool(self, task: Callable[[], None]) -> None:
        try:
            self.executor.submit(task)
        except RuntimeError:  # the executor is shutting down: run it here
            task()

    def _read_slots(self, job: TransferJob, statuses: list[str]) -> JobResult:
        """Each block whose status is still ``ok`` is read into its slot and verified there;
        the others keep their status. A plain read starts with every block ``ok``; a read with
        sinks (its second task) passes what the reads into its sinks found. The blocks go in
        one :meth:`DiskTier.read_into_views` (the slots as :class:`BlockPlaces`: one read
        transaction, one kernel call, the GIL released once); if that raises, one
        :meth:`DiskTier.read_into` each, so that one bad read fails one block, not the job."""
        statuses = list(statuses)
        expected = job.fingerprints or [None] * len(job.block_hashes)
        todo = [i for i, status in enumerate(statuses) if status == ReadStatus.OK.value]
        tensor = self.pool.tensor
        if len(todo) > 1:
            try:
                places = BlockPlaces(tensor[0], tensor.stride(0), [job.dst_ids[i] for i in todo])
                read = self.disk.read_into_views([job.block_hashes[i] for i in todo], self.namespace, places,
                                                 [expected[i] for i in todo])
                for i, status in zip(todo, read):
                    statuses[i] = status.value
                todo = []
            except Exception as exc:
                logger.warning("DISK read of %d blocks failed (%s): reading them one by one", len(todo), exc)
        for i in todo:
            h = job.block_hashes[i]
            try:
                statuses[i] = self.disk.read_into(h, self.namespace, tensor[job.dst_ids[i]], expected[i]).value
            except Exception as exc:  # one bad read fails one block, not the job
                logger.warning("DISK read of block %s failed: %s", h.hex()[:16], exc)
                statuses[i] = "error"
        ok = [status == ReadStatus.OK.value for status in statuses]
        reasons = {i: status for i, status in enumerate(statuses) if status != ReadStatus.OK.value}
        return JobResult(job.job_id, ok, reasons, sum(ok) * self.pool.spec.block_nbytes)

    def _write(self, job: TransferJob) -> JobResult:
        pool = self.pool
        puts = [(h, self.namespace, pool.tensor[s], pool.fingerprint_at(s)) for h, s in zip(job.block_hashes, job.src_ids)]
        # room was made when the job was submitted (under the store's lock, victims unpinned);
        # one transaction per DISK_TXN_BYTES, the most the map's slack allows for (kvtier.tiers.disk)
        step = txn_blocks(pool.spec.block_nbytes)
        ok = [done for start in range(0, len(puts), step) for done in self.disk.write_batch(puts[start : start + step])]
        reasons = {i: "full" for i, good in enumerate(ok) if not good}
        return JobResult(job.job_id, ok, reasons, sum(ok) * self.pool.spec.block_nbytes)


class RemoteHandler(_IOHandler):
    """A pool <-> the REMOTE tier (kvtier.tiers.backend.RemoteBackend), on the I/O threads.

    Reads (``REMOTE -> pool``) land straight in host-memory pool slots, verified by the
    backend (against the job's fingerprints too); writes (``pool -> REMOTE``) send blocks from any pool (a GPU block is first
    copied to host memory on the I/O thread). One backend call per job: the daemon streams
    the whole batch over one connection, Redis pipelines it.

    Args:
        remote: the backend; it never raises for remote-side failures (statuses instead).
        pool: the pool this handler reads into / writes from.
        namespace: the store's 32-byte namespace.
        executor: the shared I/O thread pool.
    """

    def __init__(self, remote, pool: BlockPool, namespace: bytes, executor: ThreadPoolExecutor) -> None:
        self.remote, self.pool, self.namespace, self.executor = remote, pool, namespace, executor

    def _read(self, job: TransferJob) -> JobResult:
        outs = [self.pool.tensor[slot] for slot in job.dst_ids]
        statuses = self.remote.get_into(self.namespace, job.block_hashes, outs, job.fingerprints)
        ok = [status is ReadStatus.OK for status in statuses]
        reasons = {i: status.value for i, status in enumerate(statuses) if status is not ReadStatus.OK}
        return JobResult(job.job_id, ok, reasons, sum(ok) * self.pool.spec.block_nbytes)

    def _write(self, job: TransferJob) -> JobResult:
        blocks = [self.pool.tensor[s] for s in job.src_ids]
        if self.pool.tensor.device.type != "cpu":
            blocks = [b.to("cpu") for b in blocks]
        fingerprints = [self.pool.fingerprint_at(s) for s in job.src_ids]
        ok = list(self.remote.put(self.namespace, job.block_hashes, blocks, fingerprints))
        reasons = {i: "remote_put" for i, good in enumerate(ok) if not good}
        return JobResult(job.job_id, ok, reasons, sum(ok) * self.pool.spec.block_nbytes)


def slot_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(src, dst, length)`` runs where both slot ids advance by one: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def register_handlers(
    engine: TransferEngine, pools: list[BlockPool], disk: DiskTier | None, remote: RemoteBackend | None,
    namespace: bytes, executor: ThreadPoolExecutor,
) -> TransferEngine:
    """Register a handler for every (source, destination) medium pair a store uses (the
    memory pools, top first; DISK and REMOTE when present)."""
    for upper, lower in zip(pools, pools[1:]):
        # loads record one event per layer, so layer i can be used before layer i+1 lands
        engine.register(lower.medium, upper.medium, PoolCopyHandler(lower, upper, per_layer=True))
        engine.register(upper.medium, lower.medium, PoolCopyHandler(upper, lower))
    host_pools = [p for p in pools if p.tensor.device.type == "cpu"]
    if disk is not None:
        for pool in host_pools:
            handler = DiskHandler(disk, pool, namespace, executor)
            engine.register(Medium.DISK, pool.medium, handler)
            engine.register(pool.medium, Medium.DISK, handler)
    if remote is not None:
        for pool in pools:
            handler = RemoteHandler(remote, pool, namespace, executor)
            engine.register(pool.medium, Medium.REMOTE, handler)
            if pool in host_pools:
                engine.register(Medium.REMOTE, pool.medium, handler)
    return engine
