"""TieredStore: one index over the GPU pool, the CPU slab and the DISK tier.

Protocol (the order every caller follows; vLLM kv_offload/abstract.py names the same steps):

    lookup(block_hashes, pin=?)        -> LookupResult   longest cached prefix; no side effects
                                                          beyond an optional pin (a Lease)
    load(block_hashes)                 -> LoadResult      brings the hit prefix into the top
                                                          pool (promotion), pins it; the caller
                                                          gathers from pool.tensor[block_ids],
                                                          then releases the lease
    prepare_store(block_hashes)        -> StoreHandle     slots in the top pool for new blocks,
                                                          pinned and invisible to lookups
    (caller writes pool.tensor[handle.block_ids])
    complete_store(handle, success)                       publishes (or frees) them; under
                                                          write_through also writes them down
    store(block_hashes, blocks)                           the two store steps in one call

Pins: a pinned block is never evicted from any tier. Every pin is owned by exactly one
:class:`Lease`, released by ``lease.release()``, by ``with lease:``, or, as the last resort,
when the lease object is garbage collected (case O1: lookups that are never followed by a
load or an explicit release must not leak pins).

Eviction: LRU per tier, skipping pinned blocks. Blocks of one request are touched tail first,
so within a request the tail is evicted before the head and a shared prefix goes last (vLLM's
free-block queue; LMCache issue 1116). A store counts as a use (case E1). Under
``write_back`` a victim spills one tier down (GPU -> CPU -> DISK) unless that tier already
holds it; DISK victims are dropped.

Single-threaded: callers serialise access (the transfer engine of a later slice owns its own
threads and talks to the store through these calls).
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvtier.config import StoreConfig
from kvtier.tiers.disk import DiskTier, ReadStatus
from kvtier.tiers.pool import BlockPool
from kvtier.types import BlockHash, KVSpec, Medium

logger = logging.getLogger(__name__)


class Lease:
    """Pins on a set of block hashes; :meth:`release` drops them exactly once."""

    __slots__ = ("block_hashes", "_finalizer", "__weakref__")

    def __init__(self, store: "TieredStore", block_hashes: Sequence[BlockHash]) -> None:
        self.block_hashes = tuple(block_hashes)
        store._pin(self.block_hashes)
        self._finalizer = weakref.finalize(self, store._unpin, self.block_hashes)

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
        lease: pins on the hit blocks when looked up with ``pin=True``, else ``None``.
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
    """

    block_ids: list[int]
    sources: list[Medium]
    lease: Lease


@dataclass(slots=True)
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


@dataclass
class StoreStats:
    """Event counters (each event counted once); rates are left to the reader."""

    lookup_blocks: int = 0
    hit_blocks: Counter = field(default_factory=Counter)  # by medium
    stored_blocks: Counter = field(default_factory=Counter)  # by medium
    evicted_blocks: Counter = field(default_factory=Counter)  # by medium
    spilled_blocks: Counter = field(default_factory=Counter)  # by destination medium
    load_failures: Counter = field(default_factory=Counter)  # by reason
    loaded_blocks: Counter = field(default_factory=Counter)  # by source medium


class TieredStore:
    """GPU pool -> CPU slab -> DISK, with one LRU index per tier and pins across tiers.

    Args:
        spec: block shape and dtype.
        config: capacities (bytes), policies, data directory.
        namespace: 32-byte ``KeyContext.namespace()``; written into every DISK record and
            checked on every DISK read.
        device: device of the GPU pool; default ``cuda`` when available, else ``cpu``.

    Raises:
        ValueError: a capacity smaller than one block, a namespace that is not 32 bytes.
    """

    def __init__(
        self,
        spec: KVSpec,
        config: StoreConfig,
        namespace: bytes,
        device: torch.device | str | None = None,
    ) -> None:
        if len(namespace) != 32:
            raise ValueError(f"expected a 32-byte namespace, got {len(namespace)} bytes")
        if spec.block_size != config.block_size:
            raise ValueError(f"expected spec.block_size == config.block_size, got {spec.block_size}, {config.block_size}")
        self.spec, self.config, self.namespace = spec, config, namespace
        cuda = torch.cuda.is_available()
        device = torch.device(device if device is not None else ("cuda" if cuda else "cpu"))
        self.pools: list[BlockPool] = []
        if config.gpu_bytes:
            self.pools.append(BlockPool(Medium.GPU, spec, config.gpu_bytes, device))
        if config.cpu_bytes:
            self.pools.append(BlockPool(Medium.CPU, spec, config.cpu_bytes, "cpu", pin_memory=cuda))
        self.disk = DiskTier(config.data_dir / "disk", config.disk_bytes) if config.disk_bytes else None
        self.stats = StoreStats()
        self._ref_cnt: Counter = Counter()
        self._pending: set[BlockHash] = set()
        self._closed = False
        # Host staging for DISK reads when the top pool is on CUDA and there is no CPU slab.
        self._staging = torch.empty(spec.block_shape, dtype=spec.dtype)

    # -- public API --------------------------------------------------------------------------
    @property
    def top(self) -> BlockPool:
        """The pool loads land in and stores start from (GPU, else CPU)."""
        if not self.pools:
            raise RuntimeError("store has no GPU or CPU pool; loads need one")
        return self.pools[0]

    def medium_of(self, block_hash: BlockHash) -> Medium | None:
        """Fastest medium holding ``block_hash`` (pending stores excluded), else ``None``."""
        if block_hash in self._pending:
            return None
        for pool in self.pools:
            if block_hash in pool:
                return pool.medium
        if self.disk is not None and block_hash in self.disk:
            return Medium.DISK
        return None

    def lookup(self, block_hashes: Sequence[BlockHash], pin: bool = False) -> LookupResult:
        """Longest prefix of ``block_hashes`` present in any tier. Touches no LRU order."""
        self._check_open()
        media: list[Medium] = []
        for h in block_hashes:
            medium = self.medium_of(h)
            if medium is None:
                break
            media.append(medium)
        self.stats.lookup_blocks += len(block_hashes)
        for medium in media:
            self.stats.hit_blocks[medium] += 1
        lease = Lease(self, block_hashes[: len(media)]) if pin and media else None
        return LookupResult(len(media), media, lease)

    def load(self, block_hashes: Sequence[BlockHash]) -> LoadResult:
        """Bring the leading present blocks of ``block_hashes`` into the top pool, pinned."""
        self._check_open()
        loaded: list[BlockHash] = []
        block_ids: list[int] = []
        sources: list[Medium] = []
        for h in block_hashes:
            source = self.medium_of(h)
            if source is None:
                break  # end of the cached prefix
            self._pin([h])
            block_id = self._promote(h, source)
            if block_id is None:
                self._unpin([h])
                break
            loaded.append(h)
            block_ids.append(block_id)
            sources.append(source)
            self.stats.loaded_blocks[source] += 1
        self._touch_tail_first(loaded)
        lease = Lease(self, loaded)
        self._unpin(loaded)  # the lease now holds the only pin taken here
        return LoadResult(block_ids, sources, lease)

    def prepare_store(self, block_hashes: Sequence[BlockHash]) -> StoreHandle:
        """Reserve top-pool slots for the blocks of ``block_hashes`` not stored yet.

        Stops at the first block that gets no slot (every candidate victim pinned): blocks
        after a gap could never be hit through the chain.
        """
        self._check_open()
        top = self.top
        new_hashes: list[BlockHash] = []
        block_ids: list[int] = []
        indices: list[int] = []
        num_blocks = 0
        chain: list[BlockHash] = []  # pinned blocks of this request, in request order
        for i, h in enumerate(block_hashes):
            if h in self._pending:
                break  # another request is writing it; stop rather than race
            self._pin([h])
            if h not in top:
                block_id = self._allocate(0, h)
                if block_id is None:
                    self._unpin([h])
                    break
                self._pending.add(h)
                new_hashes.append(h)
                block_ids.append(block_id)
                indices.append(i)
            chain.append(h)
            num_blocks = i + 1
        lease = Lease(self, chain)
        self._unpin(chain)
        return StoreHandle(new_hashes, block_ids, indices, num_blocks, lease)

    def complete_store(self, handle: StoreHandle, success: bool = True) -> None:
        """Publish the written blocks (or free their slots when ``success`` is False)."""
        top = self.top
        for h in handle.block_hashes:
            self._pending.discard(h)
            if not success:
                top.free(h)
        if success:
            self.stats.stored_blocks[top.medium] += len(handle.block_hashes)
            self._touch_tail_first(handle.lease.block_hashes, frozenset(handle.block_hashes))
            if self.config.write_policy == "write_through":
                for h in handle.block_hashes:
                    self._write_through(h)
        handle.lease.release()

    def store(self, block_hashes: Sequence[BlockHash], blocks: torch.Tensor) -> int:
        """Store ``blocks`` (``[len(block_hashes), *spec.block_shape]``, spec dtype, any
        device) under ``block_hashes``. Returns the number of leading blocks now stored."""
        self._check_block_tensor(blocks, len(block_hashes))
        device = self.top.tensor.device

        def write(indices: list[int], block_ids: list[int]) -> None:
            if indices == list(range(indices[0], indices[-1] + 1)):
                src = blocks[indices[0] : indices[-1] + 1]  # a view: one copy in all
            else:
                src = blocks.index_select(0, torch.tensor(indices, device=blocks.device))
            ids = torch.tensor(block_ids, device=device)
            self.top.tensor.index_copy_(0, ids, src.to(device, non_blocking=True))

        return self.store_with(block_hashes, write)

    def store_with(self, block_hashes: Sequence[BlockHash], write: Callable[[list[int], list[int]], None]) -> int:
        """Store a request's blocks in chunks of at most half the top pool, so that a request
        larger than the top pool still goes through it (earlier chunks spill down, tail
        first) instead of being cut short.

        Args:
            block_hashes: the request's full blocks, in order.
            write: ``write(indices, block_ids)`` copies request blocks ``indices`` into
                ``top.tensor[block_ids]``; an exception frees the chunk's slots and propagates.

        Returns:
            leading blocks of the request now stored.
        """
        chunk = max(1, self.top.num_blocks // 2)
        stored = 0
        new: set[BlockHash] = set()
        for start in range(0, len(block_hashes), chunk):
            handle = self.prepare_store(block_hashes[start : start + chunk])
            ok = False
            try:
                if handle.block_ids:
                    write([start + i for i in handle.indices], handle.block_ids)
                ok = True
            finally:
                self.complete_store(handle, success=ok)
            stored = start + handle.num_blocks
            new.update(handle.block_hashes if ok else ())
            if stored < min(start + chunk, len(block_hashes)):
                break
        if stored > chunk:  # re-order across chunks: the request's tail goes first
            self._touch_tail_first(block_hashes[:stored], frozenset(new))
        return stored

    def flush(self) -> None:
        """Write every block held only in memory down to DISK (oldest first), then fsync."""
        if self.disk is None:
            return
        for index in reversed(range(len(self.pools))):
            for h in self.pools[index].lru_order():
                if h not in self._pending and h not in self.disk:
                    self._spill_to_disk(self.pools[index], h)
        self.disk.flush()

    def close(self) -> None:
        """Flush (if ``config.flush_on_close``) and close the DISK environment. Idempotent."""
        if self._closed:
            return
        if self.config.flush_on_close:
            self.flush()
        if self.disk is not None:
            self.disk.close()
        self._closed = True

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: ``blocks``, ``used_bytes``, ``capacity_bytes``."""
        tiers = [(p.medium, len(p), p.used_bytes, p.capacity_bytes) for p in self.pools]
        if self.disk is not None:
            tiers.append((Medium.DISK, len(self.disk), self.disk.used_bytes, self.disk.capacity_bytes))
        return {str(m): {"blocks": n, "used_bytes": u, "capacity_bytes": c} for m, n, u, c in tiers}

    def ref_cnt(self, block_hash: BlockHash) -> int:
        return self._ref_cnt[block_hash]

    def check_invariants(self) -> None:
        """For tests: pools and DISK agree with their indexes, caps hold, pins are sane."""
        for pool in self.pools:
            pool.check()
            assert pool.used_bytes <= pool.capacity_bytes
        if self.disk is not None:
            self.disk.check()
        assert all(n > 0 for n in self._ref_cnt.values()), "a ref_cnt went to zero or below but stayed"
        assert not self._pending, "a store was prepared but never completed"

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("store is closed")

    def _check_block_tensor(self, blocks: torch.Tensor, n: int) -> None:
        expected = (n, *self.spec.block_shape)
        if not isinstance(blocks, torch.Tensor) or tuple(blocks.shape) != expected:
            got = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise ValueError(f"expected blocks of shape {expected}, got {got}")
        if blocks.dtype != self.spec.dtype:
            raise ValueError(f"expected blocks of dtype {self.spec.dtype}, got {blocks.dtype}")

    def _pin(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            self._ref_cnt[h] += 1

    def _unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            n = self._ref_cnt[h] - 1
            assert n >= 0, "unpinned more often than pinned"
            if n:
                self._ref_cnt[h] = n
            else:
                del self._ref_cnt[h]

    def _evictable(self, block_hash: BlockHash) -> bool:
        return block_hash not in self._ref_cnt and block_hash not in self._pending

    def _touch_tail_first(self, block_hashes: Sequence[BlockHash], new: frozenset = frozenset()) -> None:
        """A use of ``block_hashes`` (``new`` ones only move to the recent end of probation),
        in reverse order, so the head of a request is the last of it to be evicted."""
        tiers = [*self.pools, *([self.disk] if self.disk is not None else [])]
        for h in reversed(block_hashes):
            for tier in tiers:
                if h in tier:
                    tier.refresh(h) if h in new else tier.touch(h)

    def _allocate(self, index: int, block_hash: BlockHash) -> int | None:
        """A slot in ``pools[index]`` for ``block_hash``, evicting LRU victims as needed."""
        pool = self.pools[index]
        block_id = pool.allocate(block_hash)
        while block_id is None:
            victim = next((h for h in pool.lru_order() if self._evictable(h)), None)
            if victim is None:
                return None
            self._evict(index, victim)
            block_id = pool.allocate(block_hash)
        return block_id

    def _evict(self, index: int, block_hash: BlockHash) -> None:
        pool = self.pools[index]
        if self.config.write_policy == "write_back" or not self._below_has(index, block_hash):
            self._write_down(index, block_hash)
        pool.free(block_hash, evicted=True)
        self.stats.evicted_blocks[pool.medium] += 1

    def _write_through(self, block_hash: BlockHash) -> None:
        """Copy a new block into every lower tier (each copy from the one above it)."""
        for index, pool in enumerate(self.pools):
            if block_hash in pool:
                self._write_down(index, block_hash)

    def _below_has(self, index: int, block_hash: BlockHash) -> bool:
        below = self.pools[index + 1 :]
        return any(block_hash in p for p in below) or (self.disk is not None and block_hash in self.disk)

    def _write_down(self, index: int, block_hash: BlockHash) -> None:
        """Copy a block from ``pools[index]`` to the next tier down, unless it holds it."""
        pool = self.pools[index]
        if index + 1 < len(self.pools):
            below = self.pools[index + 1]
            if block_hash in below:
                return
            self._pin([block_hash])  # the source copy must survive evictions below
            try:
                below_id = self._allocate(index + 1, block_hash)
            finally:
                self._unpin([block_hash])
            if below_id is not None:
                below.tensor[below_id].copy_(pool.tensor[pool.block_id(block_hash)])
                self.stats.spilled_blocks[below.medium] += 1
        elif self.disk is not None and block_hash not in self.disk:
            self._spill_to_disk(pool, block_hash)

    def _spill_to_disk(self, pool: BlockPool, block_hash: BlockHash) -> bool:
        disk = self.disk
        assert disk is not None
        need = disk.footprint(self.spec.block_nbytes)
        victims: list[BlockHash] = []
        free = disk.free_bytes
        for h in disk.lru_order():
            if free >= need:
                break
            if self._evictable(h):
                victims.append(h)
                free += disk.footprint_of(h)
        if free < need:
            return False
        block = pool.tensor[pool.block_id(block_hash)]
        if block.device.type != "cpu":
            block = block.cpu()
        (ok,) = disk.write_batch([(block_hash, self.namespace, block)], deletes=victims)
        self.stats.evicted_blocks[Medium.DISK] += len(victims)
        if ok:
            self.stats.spilled_blocks[Medium.DISK] += 1
        return ok

    def _promote(self, block_hash: BlockHash, source: Medium) -> int | None:
        """Slot of ``block_hash`` in the top pool, copying it up from ``source`` if needed."""
        top = self.top
        if source is top.medium:
            return top.block_id(block_hash)
        block_id = self._allocate(0, block_hash)
        if block_id is None:
            return None
        if source is Medium.DISK:
            ok = self._read_from_disk(block_hash, top.tensor[block_id])
        else:  # CPU slab under a GPU pool
            top.tensor[block_id].copy_(self.pools[1].tensor[self.pools[1].block_id(block_hash)])
            ok = True
        if not ok:
            top.free(block_hash)
            return None
        return block_id

    def _read_from_disk(self, block_hash: BlockHash, out: torch.Tensor) -> bool:
        assert self.disk is not None
        host = out if out.device.type == "cpu" else self._staging
        status = self.disk.read_into(block_hash, self.namespace, host)
        if status is not ReadStatus.OK:
            self.stats.load_failures[status.value] += 1
            return False
        if host is not out:
            out.copy_(host)
        return True
