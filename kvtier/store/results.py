"""Result and ownership types of the store protocol (see :mod:`kvtier.store`).

The bottom of the store package: imports nothing from it. A :class:`Lease` pins through any
object with ``pin(block_hashes)`` and ``release_pins(block_hashes)``
(:class:`kvtier.store.residency.Residency`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from kvtier.types import BlockHash, Fingerprint, Medium


class Pins(Protocol):
    """What a lease needs from the store: pin now, release later (never blocking)."""

    def pin(self, block_hashes: Sequence[BlockHash]) -> None: ...

    def release_pins(self, block_hashes: Sequence[BlockHash]) -> None: ...


class Lease:
    """Pins on a set of block hashes; :meth:`release` drops them exactly once."""

    __slots__ = ("block_hashes", "_finalizer", "__weakref__")

    def __init__(self, pins: Pins, block_hashes: Sequence[BlockHash]) -> None:
        self.block_hashes = tuple(block_hashes)
        pins.pin(self.block_hashes)
        # Runs on release() or when the lease is collected, possibly on another thread in the
        # middle of a GC pass: it must never wait for the store's lock (see release_pins).
        self._finalizer = weakref.finalize(self, pins.release_pins, self.block_hashes)

    def release(self) -> None:
        """Unpin; calling it again does nothing."""
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class LookupResult:
    """Longest cached prefix of a block hash chain.

    Attributes:
        num_hit_blocks: leading blocks present in some tier.
        media: the fastest medium holding each hit block, ``[num_hit_blocks]``.
        lease: pins on the hit blocks when looked up with ``pin=True``, else ``None``
            (REMOTE blocks are never pinned: another process owns them).
    """

    num_hit_blocks: int
    media: list[Medium]
    lease: Lease | None = None


@dataclass(slots=True)
class LoadResult:
    """Blocks brought into the top pool (the GPU pool, or the CPU slab when there is none).

    Attributes:
        block_ids: slots in ``store.top.tensor`` holding blocks ``0..len(block_ids)-1`` of the
            request, in order; may be shorter than asked (a miss, a corrupt DISK record, or no
            evictable slot ends the prefix).
        sources: the medium each block came from (``GPU`` when it was already there).
        lease: pins on those blocks; release it once they are copied out.
        fingerprints: the token fingerprint each block carries (the caller's, when it passed
            fingerprints: every block was checked against them; else what the tiers hold,
            ``NO_FINGERPRINT`` for a block read from REMOTE unchecked).
    """

    block_ids: list[int]
    sources: list[Medium]
    lease: Lease
    fingerprints: list[Fingerprint] = field(default_factory=list)


@dataclass
class StoreHandle:
    """Slots reserved by :meth:`TieredStore.prepare_store`.

    Attributes:
        block_hashes: the new blocks to write, in request order.
        block_ids: their slots in ``store.top.tensor`` (write ``tensor[block_ids[i]]``).
        indices: position of each new block in the ``block_hashes`` passed to prepare_store.
        num_blocks: leading blocks of the request that are (or will be) stored.
    """

    block_hashes: list[BlockHash]
    block_ids: list[int]
    indices: list[int]
    num_blocks: int
    lease: Lease
    abandon: Any = None
    """Finalizer that frees the slots if the handle is dropped without ``complete_store``."""


@dataclass
class StoreStats:
    """Event counters (each event counted once); rates are left to the reader."""

    lookup_blocks: int = 0
    remote_lookup_blocks: int = 0  # blocks asked of the REMOTE tier (after the local tiers missed)
    hit_blocks: Counter = field(default_factory=Counter)  # by medium
    stored_blocks: Counter = field(default_factory=Counter)  # by medium
    evicted_blocks: Counter = field(default_factory=Counter)  # by medium
    spilled_blocks: Counter = field(default_factory=Counter)  # by destination medium
    load_failures: Counter = field(default_factory=Counter)  # by reason ("token_mismatch": a block of other tokens)
    load_failures_by_tier: Counter = field(default_factory=Counter)  # the same events by (source medium, reason)
    store_failures: Counter = field(default_factory=Counter)  # by reason (DISK full, I/O error)
    loaded_blocks: Counter = field(default_factory=Counter)  # by source medium
    computed_tokens: int = 0  # prompt tokens the engine prefilled after the cached prefix (set by connectors)
    ttft_saved_s: float | None = None
    """Prefill seconds the cache saved, as a connector estimates them; ``None`` until one
    does. A hook: no kvtier connector estimates it yet (metrics, the dashboard and ``kvtier
    stats`` show it when set). Both connector counts go through
    ``TieredStore.record_computed_tokens`` (under the store's lock)."""
