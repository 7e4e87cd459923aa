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


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What a connector knows of a prompt beyond its block hashes; given with a lookup or a
    store, it lets the store say why tokens missed (:mod:`kvtier.store.misses`).

    Attributes:
        num_tokens: prompt tokens; those after the blocks looked up (the partial tail block,
            and the last token a connector always leaves to prefill) count as ``partial_tail``.
        content_keys: :func:`kvtier.hashing.content_keys` of the prompt, aligned with the
            block hashes (index ``i`` for block ``i``; may be longer); ``None``: unknown.
        root: the chain's namespace (``KeyContext.namespace()``); ``None``: the store's.
    """

    num_tokens: int | None = None
    content_keys: Sequence[bytes] | None = None
    root: bytes | None = None


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
    generation: int = 0
    """The store's generation when the slots were reserved: completed after a reset (a newer
    generation), the handle publishes nothing."""
    parent: BlockHash | None = None
    """The request's block before ``block_hashes[0]`` when known (a later chunk of a
    ``store_with``): the parent of its KV event (kvtier.store.events)."""


@dataclass(slots=True)
class ResetResult:
    """What :meth:`TieredStore.reset` emptied.

    Attributes:
        dropped_blocks: blocks dropped per tier (``"GPU"``, ``"CPU"``, ``"DISK"``, and
            ``"REMOTE"`` when the REMOTE namespace was emptied: blocks the backend deleted).
        remote_cleared: ``True`` when the REMOTE namespace was emptied; ``False`` when the
            backend cannot empty a namespace or could not be reached (the blocks there stay
            until they are evicted; call reset again); ``None``: no REMOTE tier, or
            ``reset(remote=False)``.
    """

    dropped_blocks: dict[str, int]
    remote_cleared: bool | None


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
    miss_tokens: Counter = field(default_factory=Counter)
    """Prompt tokens a counted lookup or load did not serve, by ``(reason, tier)``
    (:mod:`kvtier.store.misses`; tier ``""`` where none applies)."""
    computed_tokens: int = 0  # prompt tokens the engine prefilled after the cached prefix (set by connectors)
    ttft_saved_s: float | None = None
    """Prefill seconds the cache saved, as a connector estimates them (cached tokens times
    the engine's measured prefill seconds per token, minus the load time spent; a request
    whose load cost more than it saved adds 0 here and the difference to ``ttft_lost_s``);
    ``None`` until a connector reports. Both connector counts go through
    ``TieredStore.record_computed_tokens`` (under the store's lock)."""
    ttft_lost_s: float = 0.0
    """Seconds by which loads took longer than recomputing would have (per request)."""


def check_connector_counts(num_tokens: int, ttft_saved_s: float | None, ttft_lost_s: float) -> None:
    """What ``TieredStore.record_computed_tokens`` accepts. Raises ``ValueError`` for a
    negative or non-integer token count, a negative or non-finite time."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"expected a token count >= 0, got {num_tokens!r}")
    for name, value in (("ttft_saved_s", ttft_saved_s), ("ttft_lost_s", ttft_lost_s)):
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
            raise ValueError(f"expected {name} >= 0 seconds, got {value!r}")
