"""KV events: which blocks a store now holds, and no longer holds, per tier (for cache-aware
routers that send a request to the engine holding its longest cached prefix).

The schema is vLLM's KV events (``vllm/distributed/kv_events.py``, vLLM 0.32), field for
field::

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name)
    BlockRemoved(block_hashes, medium)
    AllBlocksCleared()
    EventBatch(ts, events, data_parallel_rank)

with kvtier's values: ``block_hashes`` are kvtier's chained block hashes (``bytes`` of 16 or
32; a router hashes its prompts the same way, :func:`kvtier.hashing.block_hashes_for`, with
the engine's key context); ``medium`` is the tier (``GPU``, ``CPU``, ``DISK``; vLLM says
``GPU``, ``CPU``, ``STORAGE``); ``token_ids`` is empty, ``lora_id`` and ``lora_name`` are
``None`` (a store sees hashes only: the LoRA is in the chain's root); ``parent_block_hash`` is
the block before the first one in the request's chain when the store knows it (a store, a
load), else ``None`` (spills, evictions). One event per tier and operation, so a block that
spills from GPU to CPU is a ``BlockRemoved(GPU)`` and a ``BlockStored(CPU)``. REMOTE puts are
not published: the REMOTE tier (a ``kvtier serve`` daemon) publishes its own.

Publishing (:class:`KVEventPublisher`, ``store.events``) costs nothing until someone listens:
``subscribe(callback)`` (called under the store's lock, on the thread that changed the store:
it must be quick and must not call the store), ``queue()`` (a thread-safe queue for another
thread), and ``keep_history(n)`` (the last ``n`` batches, each with a sequence number, so a
stream can resume from a cursor: the daemon's ``/v1/events``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

from kvtier.types import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now held in ``medium`` (vLLM ``BlockStored``)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer held in ``medium`` (vLLM ``BlockRemoved``)."""

    block_hashes: list[BlockHash]
    medium: str | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the store is gone (vLLM ``AllBlocksCleared``)."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one store operation (vLLM ``EventBatch``), numbered by ``seq`` (1, 2, ...:
    a stream's resume cursor)."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None
    seq: int = 0


def event_to_dict(event: KVCacheEvent) -> dict[str, Any]:
    """JSON form: ``{"type": "BlockStored", ...}`` with hashes as hex strings."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": [h.hex() for h in event.block_hashes],
                "parent_block_hash": None if event.parent_block_hash is None else event.parent_block_hash.hex(),
                "token_ids": list(event.token_ids), "block_size": event.block_size, "lora_id": event.lora_id,
                "medium": event.medium, "lora_name": event.lora_name}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [h.hex() for h in event.block_hashes], "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def event_from_dict(doc: dict[str, Any]) -> KVCacheEvent:
    """Parse :func:`event_to_dict`'s form. Raises ``ValueError`` on anything else."""
    try:
        kind = doc["type"]
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        hashes = [BlockHash(bytes.fromhex(h)) for h in doc["block_hashes"]]
        if kind == "BlockRemoved":
            return BlockRemoved(hashes, doc.get("medium"))
        if kind == "BlockStored":
            parent = doc.get("parent_block_hash")
            return BlockStored(hashes, None if parent is None else BlockHash(bytes.fromhex(parent)),
                               list(doc.get("token_ids") or []), int(doc["block_size"]), doc.get("lora_id"),
                               doc.get("medium"), doc.get("lora_name"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"expected a KV event, got {exc!r}") from None
    raise ValueError(f"expected a KV event type, got {kind!r}")


def batch_to_dict(batch: EventBatch) -> dict[str, Any]:
    return {"seq": batch.seq, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
            "events": [event_to_dict(e) for e in batch.events]}


class EventQueue:
    """A subscriber that keeps batches for another thread (``get``); when ``maxsize`` batches
    wait unread, newer ones are dropped and ``lost`` counts them (the reader must then
    rebuild its view, e.g. from a snapshot)."""

    def __init__(self, maxsize: int) -> None:
        self._queue: queue.Queue[EventBatch] = queue.Queue(maxsize)
        self.lost = 0
        self.unsubscribe: Callable[[], None] = lambda: None

    def __call__(self, batch: EventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.lost += 1

    def get(self, timeout: float | None = None) -> EventBatch | None:
        """The next batch, or ``None`` after ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> list[EventBatch]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out


@dataclass
class KVEventPublisher:
    """A store's event source (``store.events``); see the module docstring.

    Attributes:
        block_size: tokens per block (every ``BlockStored`` carries it).
        data_parallel_rank: stamped on every batch (``None``: not data parallel).
    """

    block_size: int
    data_parallel_rank: int | None = None
    _subscribers: list[Callable[[EventBatch], None]] = field(default_factory=list)
    _history: deque | None = None
    _seq: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def active(self) -> bool:
        """Whether anything listens (the store builds no event otherwise)."""
        return bool(self._subscribers) or self._history is not None

    @property
    def seq(self) -> int:
        """Sequence number of the latest batch (0 before the first)."""
        return self._seq

    def subscribe(self, callback: Callable[[EventBatch], None]) -> Callable[[], None]:
        """Call ``callback(batch)`` for every batch from now on; returns the unsubscribe."""
        with self._lock:
            self._subscribers = [*self._subscribers, callback]

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = [s for s in self._subscribers if s is not callback]

        return unsubscribe

    def queue(self, maxsize: int = 10_000) -> EventQueue:
        """A new :class:`EventQueue` subscriber (``q.unsubscribe()`` to stop)."""
        q = EventQueue(maxsize)
        q.unsubscribe = self.subscribe(q)
        return q

    def keep_history(self, max_batches: int) -> None:
        """Keep the last ``max_batches`` batches for :meth:`since` (idempotent; a larger
        value grows the buffer)."""
        with self._lock:
            if self._history is None or (self._history.maxlen or 0) < max_batches:
                self._history = deque(self._history or (), maxlen=max_batches)

    def since(self, cursor: int) -> tuple[list[EventBatch], bool]:
        """Batches after sequence number ``cursor`` still in the history, and whether that
        is all of them (``False``: some were dropped, or no history is kept)."""
        with self._lock:
            kept, seq = self._history is not None, self._seq
            history = list(self._history or ())
        batches = [b for b in history if b.seq > cursor]
        # a cursor ahead of this publisher's count is another publisher's (a restarted daemon)
        complete = kept and 0 <= cursor <= seq and (cursor == seq or (bool(batches) and batches[0].seq == cursor + 1))
        return batches, complete

    # -- called by the store, under its lock ----------------------------------------------------
    def stored(self, medium: Any, block_hashes: Sequence[BlockHash], parent: BlockHash | None = None) -> None:
        if block_hashes and self.active:
            self.publish([BlockStored(list(block_hashes), parent, [], self.block_size, None, str(medium))])

    def removed(self, medium: Any, block_hashes: Sequence[BlockHash]) -> None:
        if block_hashes and self.active:
            self.publish([BlockRemoved(list(block_hashes), str(medium))])

    def stored_runs(self, medium: Any, chain: Sequence[BlockHash], new: Sequence[BlockHash]) -> None:
        """``BlockStored`` per run of consecutive ``new`` blocks of ``chain`` (request order),
        each with the chain's block before it as its parent."""
        if not new or not self.active:
            return
        wanted = set(new)
        run: list[BlockHash] = []
        parent: BlockHash | None = None
        for i, h in enumerate(chain):
            if h in wanted:
                if not run:
                    parent = chain[i - 1] if i else None
                run.append(h)
            elif run:
                self.stored(medium, run, parent)
                run = []
        if run:
            self.stored(medium, run, parent)

    def snapshot(self, held: dict[Any, Sequence[BlockHash]]) -> EventBatch:
        """``AllBlocksCleared`` then a ``BlockStored`` per tier of ``held`` (medium -> hashes),
        numbered with the last batch's ``seq`` (call it under the store's lock)."""
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        events += [BlockStored(list(hs), None, [], self.block_size, None, str(m)) for m, hs in held.items() if hs]
        return EventBatch(time.time(), events, self.data_parallel_rank, self._seq)

    def publish(self, events: list[KVCacheEvent]) -> None:
        with self._lock:
            self._seq += 1
            batch = EventBatch(time.time(), events, self.data_parallel_rank, self._seq)
            if self._history is not None:
                self._history.append(batch)
            subscribers = self._subscribers
        for callback in subscribers:
            callback(batch)
