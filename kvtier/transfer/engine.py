"""Transfer engine: asynchronous block copies between media, submitted, polled and waited.

Protocol (vLLM kv_offload's worker has the same shape):

    engine.register(src, dst, handler)      one handler per (source medium, destination medium)
    job_id = engine.submit(job)             starts the copy; never blocks on the data
    engine.poll() -> [JobResult]            jobs finished since the last poll
    engine.wait([job_id]) -> {id: result}   blocks until those jobs are done

The *store* owns pins and slots: it reserves (pins) every block of a job before submitting it
and releases them exactly once when it consumes the job's result (prepare -> transfer ->
complete). Handlers only move bytes. A handler that fails - an exception in an I/O thread, a
corrupt record - reports it in :class:`JobResult` (``ok`` per block, ``reasons``); nothing is
raised into the inference loop (STYLE.md; LMCache's missing version of this made vLLM decode
uninitialised KV, vLLM issue 3388).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Sequence

from kvtier.types import BlockHash, Medium

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferJob:
    """Copy ``block_hashes`` from ``src`` to ``dst``.

    Attributes:
        src, dst: media.
        block_hashes: the blocks, ``[n]``.
        src_ids: slots in the source pool (``None`` when ``src`` is DISK), ``[n]``.
        dst_ids: slots in the destination pool (``None`` when ``dst`` is DISK), ``[n]``.
        fingerprints: for reads from DISK or REMOTE, the token fingerprint each block must
            carry (``None`` entries, or ``None``: not checked against a request's tokens),
            ``[n]``; a block that carries another is failed with reason ``"token_mismatch"``.
        sinks: for a DISK read into a host-memory pool, a first destination per block
            (``None``: none), ``[n]`` tensors of the block's shape, any strides, or a
            :class:`~kvtier.records.BlockPlaces` of ``n`` places: each block
            is read and verified into its sink (``DiskTier.read_into_views``), ``delivery``
            is set and ``sinks`` dropped, then the blocks are read into their slots in a
            second task (``DiskHandler.start``).
        delivery: with ``sinks``: which blocks' sinks hold verified bytes, set before the
            job ends.
        gate: with ``sinks``: shared by the jobs of one prefix; each job's reads into its
            slots start only once every one of them has delivered (:class:`DeliveryGate`).
        job_id: set by :meth:`TransferEngine.submit`.
    """

    src: Medium
    dst: Medium
    block_hashes: list[BlockHash]
    src_ids: list[int] | None = None
    dst_ids: list[int] | None = None
    fingerprints: list[bytes | None] | None = None
    sinks: Sequence[Any] | None = None
    delivery: "Delivery | None" = None
    gate: "DeliveryGate | None" = None
    job_id: int = -1


class Delivery:
    """Which blocks of a job with sinks reached them (:attr:`TransferJob.sinks`), known
    before the job itself ends: set once by the handler (every block failed, if it raised)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.ok: list[bool] = []

    def set(self, ok: list[bool]) -> None:
        if not self._event.is_set():
            self.ok = ok
            self._event.set()

    def wait(self) -> list[bool]:
        """Block until set; per block, whether its sink holds its verified bytes."""
        self._event.wait()
        return self.ok


class DeliveryGate:
    """Holds back the second task of the jobs with sinks of one prefix (their reads into the
    top-pool slots, :class:`TransferJob`) until every one of those jobs has delivered into
    its sinks: a promotion that ran beside the prefix's last deliveries shared the memory bus
    with them and slowed the hit they gate (bench/results/2026-12-02-hit-3: the deliveries
    alone 2.76x one copy of the bytes, with the promotions beside them 3.55-4.23x).

    Args:
        num_jobs: the jobs that will :meth:`arrive` (each exactly once, whether its
            deliveries succeeded, failed or never started).
    """

    def __init__(self, num_jobs: int) -> None:
        self._lock = threading.Lock()
        self._left = num_jobs
        self._held: list[Callable[[], None]] = []

    def arrive(
        self, then: Callable[[], None] | None = None, run: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """One job has delivered: ``then`` (its second task; ``None``: none) runs when the last
        job arrives, with the others held so far, in arrival order, one after another: as one
        call handed to the last arrival's ``run`` (e.g. a submit to the I/O pool, so that it
        queues behind the work already there), or on that job's thread without one; at once
        if every job has arrived already. ``then`` must not raise."""
        with self._lock:
            if then is not None:
                self._held.append(then)
            self._left -= 1
            if self._left > 0:
                return
            held, self._held = self._held, []
        if not held:
            return
        if run is None:
            _run_all(held)
        else:
            run(partial(_run_all, held))


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


@dataclass(slots=True)
class JobResult:
    """Outcome of one job.

    Attributes:
        job_id: the job.
        ok: per block, whether its bytes reached the destination, ``[n]``.
        reasons: per failed block, why (``"corrupt"``, ``"missing"``, ``"error"``, ``"full"``,
            ``"token_mismatch"``, ``"other_version"``).
        nbytes: bytes moved.
        seconds: wall time from submit to completion.
    """

    job_id: int
    ok: list[bool]
    reasons: dict[int, str] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def success(self) -> bool:
        return all(self.ok)


class Pending(ABC):
    """A submitted job: ``done()`` without blocking, ``result()`` blocking."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def result(self, timeout: float | None = None) -> JobResult: ...


class Completed(Pending):
    """A job that finished during submit (synchronous handlers)."""

    def __init__(self, result: JobResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> JobResult:
        return self._result


class TransferHandler(ABC):
    """Moves bytes for one (src, dst) pair. ``start`` must not raise for data errors."""

    @abstractmethod
    def start(self, job: TransferJob) -> Pending: ...

    def close(self) -> None:  # noqa: B027 - optional
        pass


def failed(job: TransferJob, reason: str, started: float) -> JobResult:
    n = len(job.block_hashes)
    return JobResult(job.job_id, [False] * n, {i: reason for i in range(n)}, 0, time.perf_counter() - started)


class TransferEngine:
    """Routes jobs to handlers and tracks them until their results are consumed."""

    def __init__(self) -> None:
        self._handlers: dict[tuple[Medium, Medium], TransferHandler] = {}
        self._pending: dict[int, Pending] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def register(self, src: Medium, dst: Medium, handler: TransferHandler) -> None:
        self._handlers[(src, dst)] = handler

    def handles(self, src: Medium, dst: Medium) -> bool:
        return (src, dst) in self._handlers

    def submit(self, job: TransferJob) -> int:
        """Start ``job``; returns its id. Raises ``KeyError`` when no handler is registered
        for ``(job.src, job.dst)`` (a programming error, not a data error)."""
        handler = self._handlers[(job.src, job.dst)]
        with self._lock:
            job.job_id = next(self._ids)
        started = time.perf_counter()
        try:
            pending = handler.start(job)
        except Exception as exc:  # a handler bug must not reach the inference loop
            # the traceback as text: a record that kept the exception would keep the caller's
            # frames, and the leases in them, for as long as a handler keeps the record
            logger.error("transfer %s->%s failed to start: %s", job.src, job.dst, traceback.format_exc())
            pending = Completed(failed(job, "error", started))
        with self._lock:
            self._pending[job.job_id] = pending
        return job.job_id

    def poll(self, job_ids: Iterable[int] | None = None) -> list[JobResult]:
        """Results of finished jobs among ``job_ids`` (default: all), each returned once."""
        with self._lock:
            candidates = list(self._pending) if job_ids is None else [j for j in job_ids if j in self._pending]
            done = [job_id for job_id in candidates if self._pending[job_id].done()]
        return [self._take(job_id) for job_id in done]

    def events(self, job_id: int) -> list | None:
        """Per-layer CUDA events of a pending job (``None`` when it has none)."""
        with self._lock:
            pending = self._pending.get(job_id)
        return getattr(pending, "events", None)

    def done(self, job_ids: Iterable[int]) -> bool:
        """True when every job of ``job_ids`` finished (or was already consumed)."""
        with self._lock:
            return all(self._pending[j].done() for j in job_ids if j in self._pending)

    def wait(self, job_ids: Iterable[int]) -> dict[int, JobResult]:
        """Block until ``job_ids`` finish; returns their results (each returned once; ids
        already returned by :meth:`poll` are skipped)."""
        results = {}
        for job_id in job_ids:
            with self._lock:
                pending = self._pending.get(job_id)
            if pending is not None:
                pending.result()
                results[job_id] = self._take(job_id)
        return results

    def join(self, job_ids: Iterable[int]) -> None:
        """Block until ``job_ids`` finish, leaving their results to :meth:`wait` or
        :meth:`poll` (ids already returned are skipped): for a consumer that uses a job's
        bytes as soon as they land and takes the results later."""
        for job_id in job_ids:
            with self._lock:
                pending = self._pending.get(job_id)
            if pending is not None:
                pending.result()

    def _take(self, job_id: int) -> JobResult:
        with self._lock:
            pending = self._pending.pop(job_id)
        return pending.result()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        for pending in list(self._pending.values()):
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - closing: report nothing more
                pass
        self._pending.clear()
        for handler in set(self._handlers.values()):
            handler.close()
