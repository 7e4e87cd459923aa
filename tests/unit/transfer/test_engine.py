"""Transfer engine: submit/poll/wait, failures as data, handlers per medium pair."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.transfer.engine import Completed, JobResult, Pending, TransferEngine, TransferHandler, TransferJob
from kvtier.types import Medium


class _Gate(Pending):
    def __init__(self, result: JobResult, gate: threading.Event) -> None:
        self._result, self._gate = result, gate

    def done(self) -> bool:
        return self._gate.is_set()

    def result(self, timeout=None) -> JobResult:
        self._gate.wait(timeout)
        return self._result


class GatedHandler(TransferHandler):
    """Finishes a job only when the test opens its gate."""

    def __init__(self) -> None:
        self.gates: dict[int, threading.Event] = {}

    def start(self, job: TransferJob) -> Pending:
        gate = self.gates.setdefault(job.job_id, threading.Event())
        return _Gate(JobResult(job.job_id, [True] * len(job.block_hashes), nbytes=8), gate)


class BrokenHandler(TransferHandler):
    def start(self, job: TransferJob) -> Pending:
        raise OSError("device went away")


def job(n=2):
    return TransferJob(Medium.CPU, Medium.GPU, [bytes([i]) * 32 for i in range(n)], [0, 1][:n], [0, 1][:n])


def test_submit_poll_wait_each_result_once():
    engine = TransferEngine()
    handler = GatedHandler()
    engine.register(Medium.CPU, Medium.GPU, handler)
    a, b = engine.submit(job()), engine.submit(job())
    assert a != b and engine.poll() == [] and not engine.done([a])
    handler.gates[a].set()
    (ra,) = engine.poll()
    assert ra.job_id == a and ra.success and engine.done([a])
    assert engine.poll() == []  # returned once
    handler.gates[b].set()
    assert list(engine.wait([a, b])) == [b]  # a was already consumed
    assert engine.num_pending == 0


def test_wait_blocks_until_done():
    engine = TransferEngine()
    handler = GatedHandler()
    engine.register(Medium.CPU, Medium.GPU, handler)
    a = engine.submit(job())
    threading.Timer(0.05, handler.gates[a].set).start()
    t0 = time.perf_counter()
    assert engine.wait([a])[a].success
    assert time.perf_counter() - t0 >= 0.04


def test_a_handler_exception_is_a_failed_job_not_an_exception():
    engine = TransferEngine()
    engine.register(Medium.CPU, Medium.GPU, BrokenHandler())
    a = engine.submit(job(2))
    result = engine.wait([a])[a]
    assert result.ok == [False, False] and result.reasons == {0: "error", 1: "error"}


def test_no_handler_for_a_pair_is_a_key_error():
    with pytest.raises(KeyError):
        TransferEngine().submit(job())


def test_completed_pending_is_done():
    r = JobResult(1, [True])
    assert Completed(r).done() and Completed(r).result() is r
