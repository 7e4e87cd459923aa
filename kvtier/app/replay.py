"""Replaying a block-request trace (kvtier.app.traces) to size the tiers: miss-ratio curves.

Two policies:

- ``kvtier``: the store's own code. The local tiers are kvtier's
  :class:`~kvtier.store.placement.Placement` over real :class:`~kvtier.tiers.pool.BlockPool`
  indexes (their SLRU, :mod:`kvtier.tiers.lru`) and an in-memory stand-in for DISK's index
  (the same SLRU class, one block per record), with pins from the store's own
  :class:`~kvtier.store.residency.Residency`. :class:`KvtierReplay` makes the calls the store
  makes for a load (walk, pin the chain, make room, reserve top-pool slots, publish, touch tail
  first) and a store (``store_with``'s chunks: make room, allocate, touch tail first), with
  no bytes moved. One pass per capacity point (an SLRU has no stack property).
- ``lru``: plain LRU over the tiers as one exclusive hierarchy (a block is stored at the
  front, tail of the request first; victims move down a tier; lookups do not reorder), in
  one pass for every capacity at once: Mattson's stack distances (Mattson et al., IBM
  Systems Journal 1970), computed with a Fenwick tree over access times (O(log n) each). A
  hit is a prefix, so block ``i`` hits at total capacity ``c`` when the largest stack
  distance of blocks ``0..i`` is at most ``c``; it hits in the tier its own distance falls in.

Hit rates are per block requested (a block is ``block_size`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from kvtier.app.traces import Trace

TIERS = ("GPU", "CPU", "DISK")


# -- kvtier's policy -------------------------------------------------------------------------------
class _NullTensor:
    """A pool tensor that holds no bytes: indexing and copies do nothing (replays move none)."""

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")

    def __getitem__(self, index: Any) -> "_NullTensor":
        return self

    def copy_(self, other: Any) -> None:
        return None


class MemoryDiskIndex:
    """The DISK tier's index without LMDB: what :class:`Placement` asks of a DiskTier, one
    block per record (capacity and footprints in blocks), SLRU order from the same class."""

    def __init__(self, num_blocks: int) -> None:
        from kvtier.tiers.lru import SegmentedLRU

        self.capacity_bytes = num_blocks
        self._lru: SegmentedLRU = SegmentedLRU(max_ghosts=1 << 16)

    def __contains__(self, block_hash: Any) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def used_bytes(self) -> int:
        return len(self._lru)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - len(self._lru)

    def free_bytes_after(self, pending: Iterable[Any], payload_nbytes: int) -> int:
        """DiskTier's: free blocks once ``pending`` writes land (none are pending here: the
        replay's writes are synchronous)."""
        return self.free_bytes - sum(1 for h in pending if h not in self._lru)

    def footprint(self, payload_nbytes: int) -> int:
        return 1

    def footprint_of(self, block_hash: Any) -> int:
        return 1

    def lru_order(self) -> Iterator[Any]:
        """Lazy (Placement collects victims before deleting any); DiskTier's is a snapshot."""
        return self._lru.eviction_order()

    def touch(self, block_hash: Any) -> None:
        if block_hash in self._lru:
            self._lru.touch(block_hash)

    def touch_many(self, block_hashes: Sequence[Any]) -> None:
        """:meth:`touch` of each of ``block_hashes`` held here, in order (as DiskTier's)."""
        self._lru.touch_many(block_hashes)

    def refresh(self, block_hash: Any) -> None:
        if block_hash in self._lru:
            self._lru.refresh(block_hash)

    def was_evicted(self, block_hash: Any) -> bool:
        return self._lru.was_evicted(block_hash)

    def write_batch(
        self, puts: Sequence = (), deletes: Sequence = (), evicted: bool = True,
        after_put: Callable[[int], None] | None = None,
    ) -> list[bool]:
        """As :meth:`kvtier.tiers.disk.DiskTier.write_batch` (``after_put(i)`` once
        ``puts[i]`` is newly written), without bytes."""
        for h in deletes:
            if h in self._lru:
                self._lru.pop(h, evicted=evicted)
        ok = []
        for i, (h, *_) in enumerate(puts):
            fits = h in self._lru or len(self._lru) < self.capacity_bytes
            if fits and h not in self._lru:
                self._lru.add(h, 1)
                if after_put is not None:
                    after_put(i)
            ok.append(fits)
        return ok

    def remove(self, block_hashes: Sequence) -> None:
        self.write_batch((), [h for h in block_hashes if h in self._lru], False)


class KvtierReplay:
    """kvtier's local tiers at the given capacities (blocks), driven as the store drives them.

    Args:
        tiers: blocks per tier, top first, from ``GPU``, ``CPU``, ``DISK`` (a tier of 0 or
            absent is not built; the top pool must have >= 1 block).
        stage_on_cpu: DISK loads also take a CPU slot (the store does when the top pool is on
            a CUDA device).
    """

    def __init__(self, tiers: dict[str, int], stage_on_cpu: bool = False) -> None:
        import torch

        from kvtier.store.placement import Placement
        from kvtier.store.residency import Residency
        from kvtier.store.results import StoreStats
        from kvtier.tiers.pool import BlockPool
        from kvtier.types import KVSpec, Medium

        spec = KVSpec(1, 1, 1, 1, torch.uint8)  # 2 bytes a block: indexes only
        self.pools = []
        for name in ("GPU", "CPU"):
            if tiers.get(name, 0) > 0:
                pool = BlockPool(Medium(name), spec, tiers[name] * spec.block_nbytes)
                pool.tensor = _NullTensor()
                self.pools.append(pool)
        if not self.pools:
            raise ValueError(f"expected a GPU or CPU tier of >= 1 block, got {tiers}")
        self.disk = MemoryDiskIndex(tiers["DISK"]) if tiers.get("DISK", 0) > 0 else None
        self.residency, self.stats = Residency(), StoreStats()
        self.placement = Placement(spec, bytes(32), "write_back", self.pools, self.disk, self.residency, self.stats)
        self.top = self.pools[0]
        self.cpu = next((p for p in self.pools if p.medium is Medium.CPU), None)
        self.stage_on_cpu = stage_on_cpu and self.top is not self.cpu
        self.lookups = 0
        self.hits: dict[str, int] = {}

    def lookup(self, hashes: Sequence[int]) -> list:
        """Count a lookup; the media of the hit prefix."""
        media = self.placement.local_prefix(hashes)
        self.lookups += len(hashes)
        for m in media:
            self.hits[m.value] = self.hits.get(m.value, 0) + 1
        return media

    def load(self, hashes: Sequence[int]) -> None:
        """A prefetch and its wait (kvtier.store.prefetch), then the lease released."""
        media = self.lookup(hashes)
        top, placement, residency = self.top, self.placement, self.residency
        chain, seen = [], set()
        for h, m in zip(hashes, media):
            if h in seen:
                break
            seen.add(h)
            chain.append((h, m))
        chain = chain[: top.num_blocks]
        lease = residency.lease([h for h, _ in chain])
        placement.make_room(0, sum(1 for _, m in chain if m is not top.medium))
        loaded = []
        for h, m in chain:
            if m is not top.medium:
                if self.stage_on_cpu and m.value == "DISK":
                    placement.make_room(placement.pools.index(self.cpu), 1)
                    if self.cpu.allocate(h) is None:
                        break
                if top.allocate(h) is None:
                    break
            loaded.append(h)
        placement.touch_tail_first(loaded)
        lease.release()

    def store(self, hashes: Sequence[int]) -> None:
        """``store_with`` (kvtier.store.stores): chunks of half the top pool."""
        placement, residency, top = self.placement, self.residency, self.top
        chunk = max(1, top.num_blocks // 2)
        stored, new, protected = 0, set(), []
        for start in range(0, len(hashes), chunk):
            part = hashes[start : start + chunk]
            present = residency.lease([h for h in part if h in top])
            placement.make_room(0, sum(1 for h in part if h not in top))
            chain, fresh = [], []
            for h in part:
                if h not in top:
                    if top.allocate(h) is None:
                        break
                    fresh.append(h)
                chain.append(h)
            present.release()
            placement.touch_tail_first(chain, frozenset(fresh))
            stored = start + len(chain)
            new.update(fresh)
            residency.protect(chain)
            protected += chain
            if stored < min(start + chunk, len(hashes)):
                break
        residency.unprotect(protected)
        if stored > chunk:
            placement.touch_tail_first(hashes[:stored], frozenset(new))

    def run(self, trace: Trace) -> "ReplayResult":
        for op, ids, _ in trace.requests:
            if op == "load":
                self.load(ids)
            elif op == "lookup":
                self.lookup(ids)
            else:
                self.store(ids)
        return ReplayResult(self.lookups, dict(self.hits))


@dataclass
class ReplayResult:
    """Blocks looked up and hits by tier of one replay."""

    lookups: int
    hits: dict[str, int]

    def hit_rate(self, tiers: Sequence[str] | None = None) -> float:
        """Hits in ``tiers`` (default: all) per block looked up."""
        n = sum(v for k, v in self.hits.items() if tiers is None or k in tiers)
        return n / self.lookups if self.lookups else 0.0


def replay_kvtier(trace: Trace, tiers: dict[str, int]) -> ReplayResult:
    """One pass of kvtier's policy at ``tiers`` (blocks per tier)."""
    return KvtierReplay(tiers, trace.stage_on_cpu).run(trace)


# -- plain LRU, every capacity in one pass -----------------------------------------------------------
@dataclass
class StackDistances:
    """Per block looked up: its LRU stack distance (``inf``: never stored before) and the
    largest distance of its prefix (``prefix``), as float arrays."""

    own: np.ndarray
    prefix: np.ndarray

    def hits(self, tiers: dict[str, int]) -> dict[str, int]:
        """Hits per tier of an exclusive LRU hierarchy with these capacities (blocks)."""
        names = [t for t in TIERS if tiers.get(t, 0) > 0]
        bounds = np.cumsum([tiers[t] for t in names])
        total = bounds[-1] if len(bounds) else 0
        hit = self.prefix <= total
        where = np.searchsorted(bounds, self.own[hit], side="left")
        counts = np.bincount(where, minlength=len(names))
        return {name: int(counts[i]) for i, name in enumerate(names)}


def stack_distances(trace: Trace) -> StackDistances:
    """One pass over ``trace`` (see the module docstring); O(accesses * log accesses)."""
    num_stores = sum(len(ids) for op, ids, _ in trace.requests if op == "store")
    tree = [0] * (num_stores + 2)  # Fenwick tree over access times: 1 where a key was last accessed
    size = len(tree) - 1
    last: dict[int, int] = {}
    own: list[float] = []
    prefix: list[float] = []
    now = 0
    inf = float("inf")
    live = 0  # keys accessed so far (marks in the tree)
    for op, ids, _ in trace.requests:
        if op != "store":
            worst = 0.0
            for key in ids:
                t = last.get(key)
                if t is None:
                    d = inf
                else:
                    s, i = 0, t  # marks at times <= t
                    while i > 0:
                        s += tree[i]
                        i -= i & -i
                    d = float(live - s + 1)
                worst = d if d > worst else worst
                own.append(d)
                prefix.append(worst)
            continue
        for key in reversed(ids):  # tail first: the head ends most recent
            now += 1
            t = last.get(key)
            if t is not None:
                i = t
                while i <= size:
                    tree[i] -= 1
                    i += i & -i
            else:
                live += 1
            i = now
            while i <= size:
                tree[i] += 1
                i += i & -i
            last[key] = now
    return StackDistances(np.asarray(own, dtype=float), np.asarray(prefix, dtype=float))


# -- a real store over a trace, and a plain baseline ----------------------------------------------------
def block_hash_of(block_id: int) -> bytes:
    """A 16-byte block hash whose trace id (kvtier.store.trace.hash_id) is ``block_id``."""
    return block_id.to_bytes(8, "little") + bytes(8)


def run_store(trace: Trace, store: Any) -> ReplayResult:
    """Drive a real :class:`~kvtier.store.TieredStore` with ``trace`` as the transformers
    connector would (a load: ``prefetch(...).wait()`` then the lease released; a store:
    ``store_with`` writing no bytes); the hits are the store's own counters (``stats``)."""
    from kvtier.store.results import PromptInfo

    before_lookups, before_hits = store.stats.lookup_blocks, dict(store.stats.hit_blocks)
    for op, ids, num_tokens in trace.requests:
        hashes = [block_hash_of(i) for i in ids]
        if op == "load":
            store.prefetch(hashes, prompt=PromptInfo(num_tokens)).wait().lease.release()
        elif op == "lookup":
            store.lookup(hashes, prompt=PromptInfo(num_tokens))
        else:
            store.store_with(hashes, lambda indices, block_ids: None)
    hits = {str(m): n - before_hits.get(m, 0) for m, n in store.stats.hit_blocks.items()}
    return ReplayResult(store.stats.lookup_blocks - before_lookups, {k: v for k, v in hits.items() if v})


def replay_ordered_dict_lru(trace: Trace, capacity: int) -> ReplayResult:
    """The baseline: one LRU of ``capacity`` blocks in a plain ``OrderedDict`` (the same model
    as :func:`stack_distances`: stores move blocks to the front tail first, evicting the
    least recent; a lookup counts the prefix present). One capacity per pass."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    lookups = hits = 0
    for op, ids, _ in trace.requests:
        if op != "store":
            lookups += len(ids)
            for key in ids:
                if key not in cache:
                    break
                hits += 1
            continue
        for key in reversed(ids):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return ReplayResult(lookups, {"LRU": hits})
