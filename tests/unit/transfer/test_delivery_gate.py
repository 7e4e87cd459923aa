"""DeliveryGate: the second tasks of a prefix's DISK jobs start only after every job of it
delivered; a job that never delivers still arrives."""

from __future__ import annotations

import threading

from kvtier.transfer.engine import DeliveryGate


def test_held_until_the_last_arrival_then_run_in_arrival_order():
    gate, ran = DeliveryGate(3), []
    gate.arrive(lambda: ran.append("a"))
    gate.arrive()  # a job that never delivered: nothing to start, but it counts
    assert ran == []
    gate.arrive(lambda: ran.append("c"))
    assert ran == ["a", "c"]
    gate.arrive(lambda: ran.append("late"))  # past the count: runs at once
    assert ran == ["a", "c", "late"]


def test_arrivals_from_many_threads_run_every_held_start_once():
    n = 16
    gate, ran, lock = DeliveryGate(n), [], threading.Lock()

    def start(i):
        with lock:
            ran.append(i)

    threads = [threading.Thread(target=gate.arrive, args=(lambda i=i: start(i),)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ran) == list(range(n))


def test_the_last_arrivals_run_gets_every_held_start_as_one_call():
    """With ``run`` (the handler passes a submit to its I/O pool) the held starts go to it as
    one call that runs them in arrival order, not one by one on the arriving thread."""
    gate, ran, handed = DeliveryGate(3), [], []
    gate.arrive(lambda: ran.append("a"), run=handed.append)
    gate.arrive(lambda: ran.append("b"), run=handed.append)
    assert handed == [] and ran == []
    gate.arrive(None, run=handed.append)  # the last arrival delivered nothing itself
    assert len(handed) == 1 and ran == []  # nothing ran on the arriving thread
    handed[0]()
    assert ran == ["a", "b"]
    empty = DeliveryGate(1)
    empty.arrive(None, run=handed.append)  # nothing held: nothing handed over
    assert len(handed) == 1
