"""Prefetch tickets: a request's cached prefix on its way into the store's top pool.

A ticket is started when a request is added (before transformers schedules it): on one of the
connector's threads it runs ``store.prefetch(block_hashes)`` (the lookup walk, REMOTE included,
then DISK and REMOTE reads on the store's I/O threads) and ``handle.wait()``, so the reads
overlap the batch the engine is running. The scheduler holds a request back while its ticket
is in flight, up to ``deadline_s``; at admission a finished ticket hands over its
:class:`~kvtier.store.LoadResult` (pinned blocks in the top pool), a late one is abandoned (its
pins are released when its reads end) and the request computes those tokens instead.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from kvtier.store import LoadResult, TieredStore
from kvtier.types import BlockHash, Fingerprint

logger = logging.getLogger(__name__)


@dataclass
class Ticket:
    """One request's prefetch.

    Attributes:
        block_hashes: the prompt's full blocks that may be loaded (at most ``(len - 1) // block_size``).
        fingerprints: their token fingerprints (a load serves only blocks of these tokens).
        future: resolves to the :class:`LoadResult` (``None`` if nothing was asked).
        started_s: ``time.monotonic()`` at submission.
    """

    block_hashes: list[BlockHash]
    fingerprints: list[Fingerprint]
    future: Future
    started_s: float = field(default_factory=time.monotonic)

    def ready(self, deadline_s: float) -> bool:
        """Finished, or waited longer than ``deadline_s`` (then admission goes on without it)."""
        return self.future.done() or time.monotonic() - self.started_s >= deadline_s

    def take(self) -> LoadResult | None:
        """The load if it finished without error, else ``None`` (a late ticket is abandoned)."""
        if not self.future.done():
            self.abandon()
            return None
        try:
            return self.future.result()
        except Exception as exc:  # the store closed or failed under it: a miss
            logger.warning("kvtier prefetch failed, computing instead: %r", exc)
            return None

    def abandon(self) -> None:
        """Release the pins whenever the load ends (never blocks)."""
        self.future.add_done_callback(_release)


def _release(future: Future) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    result = future.result()
    if result is not None:
        result.lease.release()


class Tickets:
    """Tickets by request id, started on ``num_threads`` threads; thread-safe.

    Args:
        store: where the prefix is loaded from.
        deadline_s: how long the scheduler holds a request back for its load.
        on_done: called (on a connector thread) when a load finishes: wakes the engine's loop.
    """

    def __init__(self, store: TieredStore, deadline_s: float, on_done: Callable[[], None], num_threads: int = 4):
        self.store, self.deadline_s, self.on_done = store, deadline_s, on_done
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="kvtier-prefetch")
        self._tickets: dict[str, Ticket] = {}
        self._lock = threading.Lock()

    def start(self, request_id: str, block_hashes: list[BlockHash], fingerprints: list[Fingerprint]) -> None:
        """Start (or restart, for new tokens under the same id) the prefetch of a request."""
        future = self._executor.submit(self._load, request_id, block_hashes, fingerprints)
        future.add_done_callback(lambda _: self.on_done())
        with self._lock:
            old = self._tickets.pop(request_id, None)
            self._tickets[request_id] = Ticket(block_hashes, fingerprints, future)
        if old is not None:
            old.abandon()

    def _load(self, request_id: str, block_hashes: list[BlockHash], fingerprints: list[Fingerprint]) -> LoadResult | None:
        """Prefetch and wait. A chain is cut where another request is bringing the same block
        into the top pool (the store never loads a block twice at once): concurrent requests
        with one shared prefix (N users, one system prompt) then wait for that load and try
        again, until the deadline, while a lookup shows the chain goes further."""
        if not block_hashes:
            return None
        deadline = time.monotonic() + self.deadline_s
        pause_s = 0.002
        while True:
            result = self.store.prefetch(block_hashes, request_id=request_id, fingerprints=fingerprints).wait()
            got = len(result.block_ids)
            if got == len(block_hashes) or time.monotonic() + pause_s > deadline:
                return result
            if self.store.lookup(block_hashes, request_id=request_id).num_hit_blocks <= got:
                return result
            result.lease.release()
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 0.05)

    def has(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._tickets

    def ready(self, request_id: str) -> bool:
        """No ticket, a finished one, or one past the deadline."""
        with self._lock:
            ticket = self._tickets.get(request_id)
        return ticket is None or ticket.ready(self.deadline_s)

    def pop(self, request_id: str) -> Ticket | None:
        with self._lock:
            return self._tickets.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        ticket = self.pop(request_id)
        if ticket is not None:
            ticket.abandon()

    def close(self) -> None:
        """Abandon every ticket and wait for the loads in flight (their pins are released)."""
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
        for ticket in tickets:
            ticket.abandon()
        self._executor.shutdown(wait=True)
