"""TieredStore: one index over the GPU pool, the CPU slab and the DISK tier.

Protocol (the order every caller follows; vLLM kv_offload/abstract.py names the same steps):

    lookup(block_hashes, pin=?)   -> LookupResult     longest cached prefix; no side effects
                                                      beyond an optional pin (a Lease)
    prefetch(block_hashes)        -> PrefetchHandle   pins the hit prefix and starts moving it
                                                      into the top pool (DISK reads on I/O
                                                      threads, CPU->GPU on a CUDA side stream)
    handle.wait() / load(...)     -> LoadResult       the prefix now in top.tensor[block_ids],
                                                      pinned; the caller gathers, then
                                                      releases the lease
    prepare_store(block_hashes)   -> StoreHandle      top-pool slots for new blocks, pinned
                                                      and invisible to lookups
    (caller writes top.tensor[handle.block_ids])
    complete_store(handle, ok)                        publishes (or frees) them
    store(block_hashes, blocks) / store_with(block_hashes, write)   both store steps, chunked

Pins: a pinned block is never evicted from any tier. Every pin is owned by exactly one
:class:`Lease`, released by ``lease.release()``, by ``with lease:``, or, as the last resort,
when the lease object is garbage collected (case O1: lookups that are never followed by a
load or an explicit release must not leak pins). A slot with a transfer in flight is
*pending*: invisible to lookups in that tier and never evicted.

Eviction: segmented LRU per tier (kvtier.tiers.lru), skipping pinned and pending blocks.
Blocks of one request are touched tail first, so the tail of a request is evicted before its
head and a shared prefix goes last (vLLM's free-block queue; LMCache issue 1116). A store
counts as a use (case E1). Under ``write_back`` victims spill one tier down (GPU -> CPU ->
DISK, batched into one LMDB transaction) unless that tier already holds them; DISK victims are
dropped. Under ``write_through`` a new block is copied into every lower pool at once and
written to DISK asynchronously.

Threads: every public method takes the store's lock; transfers run outside it on slots that
are pinned and pending until their results are consumed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import Counter, deque
from functools import partial
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from kvtier.checks import check_block_hashes, check_namespace
from kvtier.config import StoreConfig
from kvtier.results import Lease, LoadResult, LookupResult, StoreHandle, StoreStats
from kvtier.tiers.backend import RemoteBackend, make_remote
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import BlockPool
from kvtier.transfer.engine import TransferEngine, TransferJob
from kvtier.transfer.handlers import DiskHandler, PoolCopyHandler, RemoteHandler, slot_runs
from kvtier.transfer.prefetch import PrefetchHandle, plan_prefetch
from kvtier.types import BlockHash, KVSpec, Medium

logger = logging.getLogger(__name__)

_COUNTED_REQUESTS = 4096
"""Request ids remembered so that a lookup repeated for the same request (an engine retrying
a schedule) is counted once (case M1)."""

_DISK_TXN_BYTES = 64 << 20
"""Blocks per LMDB write transaction when spilling: one transaction per ~64 MiB. Far larger
transactions make LMDB spill its own dirty-page list (about 512 MiB of pages) and slow down."""

__all__ = ["Lease", "LoadResult", "LookupResult", "PrefetchHandle", "StoreHandle", "StoreStats", "TieredStore"]


class TieredStore:
    """GPU pool -> CPU slab -> DISK, with one SLRU index per tier and pins across tiers.

    Args:
        spec: block shape and dtype.
        config: capacities (bytes), policies, data directory, I/O threads.
        namespace: 32-byte ``KeyContext.namespace()``; written into every DISK record and
            checked on every DISK read.
        device: device of the GPU pool; default ``cuda`` when available, else ``cpu``.
        remote: the REMOTE tier (kvtier.tiers.backend); default: built from
            ``config.remote_url`` (and closed with the store), none when that is unset. A
            backend passed in stays the caller's to close.

    Raises:
        ValueError: a capacity smaller than one block, a namespace that is not 32 bytes, a
            REMOTE tier that knows this namespace with another block shape or dtype.
    """

    def __init__(
        self,
        spec: KVSpec,
        config: StoreConfig,
        namespace: bytes,
        device: torch.device | str | None = None,
        remote: RemoteBackend | None = None,
    ) -> None:
        check_namespace(namespace)
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
        self._owns_remote = remote is None and config.remote_url is not None
        if self._owns_remote:
            remote = make_remote(config.remote_url, token=config.remote_token, timeout_s=config.remote_timeout_s)
        self.remote = remote
        if remote is not None:
            try:
                remote.register(namespace, spec)
            except BaseException:
                if self.disk is not None:
                    self.disk.close()
                if self._owns_remote:
                    remote.close()
                raise
        self.stats = StoreStats()
        self._counted_requests: dict[str, None] = {}  # insertion-ordered, bounded
        self._ref_cnt: Counter = Counter()
        self._protected: Counter = Counter()  # blocks of requests inside store_with: never dropped
        self._pending: set[tuple[Medium, BlockHash]] = set()
        # background writes (write-through to DISK, puts to REMOTE): job id -> (destination,
        # pins on their sources)
        self._background: dict[int, tuple[Medium, Lease]] = {}
        self._lock = threading.RLock()
        # Cleanups that arrived while another thread held the lock (GC finalizers of leases
        # and abandoned handles); run under the lock at the start of the next operation.
        self._deferred: deque = deque()
        self._closed = False
        self._executor = ThreadPoolExecutor(config.num_io_threads, thread_name_prefix="kvtier-io")
        self.engine = TransferEngine()
        self._register_handlers()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (store := ref()) is not None and store._after_fork_in_child())
        self.observe: Callable[[str, float], None] | None = None
        """Latency hook: ``observe(op, seconds)`` after each ``lookup``, ``load`` (prefetch
        submit to ``wait`` done) and ``store`` (``store``/``store_with``); kvtier.metrics
        sets it to feed its histograms. Must be cheap and must not raise."""

    def _register_handlers(self) -> None:
        for upper, lower in zip(self.pools, self.pools[1:]):
            # loads record one event per layer, so layer i can be used before layer i+1 lands
            self.engine.register(lower.medium, upper.medium, PoolCopyHandler(lower, upper, per_layer=True))
            self.engine.register(upper.medium, lower.medium, PoolCopyHandler(upper, lower))
        if self.disk is not None:
            for pool in self.pools:
                if pool.tensor.device.type == "cpu":
                    handler = DiskHandler(self.disk, pool, self.namespace, self._executor)
                    self.engine.register(Medium.DISK, pool.medium, handler)
                    self.engine.register(pool.medium, Medium.DISK, handler)
        if self.remote is not None:
            for pool in self.pools:
                handler = RemoteHandler(self.remote, pool, self.namespace, self._executor)
                self.engine.register(pool.medium, Medium.REMOTE, handler)
                if pool.tensor.device.type == "cpu":
                    self.engine.register(Medium.REMOTE, pool.medium, handler)

    # -- lookups and loads -------------------------------------------------------------------
    @property
    def top(self) -> BlockPool:
        """The pool loads land in and stores start from (GPU, else CPU)."""
        if not self.pools:
            raise RuntimeError("store has no GPU or CPU pool; loads need one")
        return self.pools[0]

    def pool(self, medium: Medium) -> BlockPool | None:
        return next((p for p in self.pools if p.medium is medium), None)

    def medium_of(self, block_hash: BlockHash) -> Medium | None:
        """Fastest medium holding a published copy of ``block_hash``, else ``None``."""
        for pool in self.pools:
            if block_hash in pool and (pool.medium, block_hash) not in self._pending:
                return pool.medium
        if self.disk is not None and block_hash in self.disk:
            return Medium.DISK
        return None

    def lookup(
        self, block_hashes: Sequence[BlockHash], pin: bool = False, request_id: str | None = None,
        blocking: bool = True,
    ) -> LookupResult | None:
        """Longest prefix of ``block_hashes`` present in any tier, the REMOTE tier last (asked
        only for the blocks after the local prefix, outside the store's lock). Touches no
        LRU order; pins the local part when ``pin``.

        Args:
            request_id: when given, a repeated lookup for the same request (a retried
                schedule) is not counted again in ``stats`` (case M1).
            blocking: ``False``: return ``None`` at once if another thread holds the store's
                lock, and never ask REMOTE (an event loop can call it inline: the daemon).
        """
        self._check_hashes(block_hashes)
        t0 = time.perf_counter()
        if not self._lock.acquire(blocking=blocking):
            return None
        try:
            self._check_open()
            media = self._local_prefix(block_hashes)
            lease = Lease(self, block_hashes[: len(media)]) if pin and media else None
            count = self._first_count(request_id)
            if count:
                self.stats.lookup_blocks += len(block_hashes)
                for medium in media:
                    self.stats.hit_blocks[medium] += 1
        finally:
            self._lock.release()
        while blocking and len(media) < len(block_hashes):
            # REMOTE for the run after the local prefix, then the local tiers again (a block
            # after a REMOTE run may be local: the prefix is whatever every tier holds together)
            num_remote = self._remote_lookup(block_hashes[len(media) :], count)
            if not num_remote:
                break
            media += [Medium.REMOTE] * num_remote
            with self._lock:
                more = self._local_prefix(block_hashes[len(media) :])
                if count:
                    for medium in more:
                        self.stats.hit_blocks[medium] += 1
            if not more:
                break
            media += more
        self._observe("lookup", t0)
        return LookupResult(len(media), media, lease)

    def on_disk(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each block has a committed DISK record (the daemon's durable puts)."""
        with self._lock:
            return [self.disk is not None and h in self.disk for h in block_hashes]

    def _local_prefix(self, block_hashes: Sequence[BlockHash]) -> list[Medium]:
        media: list[Medium] = []
        for h in block_hashes:
            medium = self.medium_of(h)
            if medium is None:
                break
            media.append(medium)
        return media

    def _first_count(self, request_id: str | None) -> bool:
        """Whether this lookup's events are counted (the caller holds the lock)."""
        if request_id is None:
            return True
        if request_id in self._counted_requests:
            return False
        self._counted_requests[request_id] = None
        if len(self._counted_requests) > _COUNTED_REQUESTS:
            del self._counted_requests[next(iter(self._counted_requests))]
        return True

    def _remote_lookup(self, block_hashes: Sequence[BlockHash], count: bool = True) -> int:
        """Leading ``block_hashes`` held by the REMOTE tier (0 without one, or when it is
        unreachable: the backend never raises for that). Called without the store's lock."""
        if self.remote is None or not block_hashes:
            return 0
        try:
            num_hit = min(max(int(self.remote.lookup(self.namespace, block_hashes)), 0), len(block_hashes))
        except Exception as exc:  # a backend bug or a reply it did not expect: a miss, not an error
            logger.warning("REMOTE lookup failed: %r", exc)
            self.remote.errors["lookup_error"] += 1
            num_hit = 0
        if count:
            with self._lock:
                self.stats.remote_lookup_blocks += len(block_hashes)
                self.stats.hit_blocks[Medium.REMOTE] += num_hit
        return num_hit

    def prefetch(
        self, block_hashes: Sequence[BlockHash], request_id: str | None = None, count: bool = True
    ) -> PrefetchHandle:
        """Pin the cached prefix of ``block_hashes`` and start bringing it into the top pool
        (REMOTE blocks included: asked for first, outside the lock). Returns at once;
        ``handle.wait()`` gives the :class:`LoadResult`. ``request_id``: see :meth:`lookup`;
        ``count=False``: not a lookup (the daemon's get, whose lookup was counted already)."""
        self._check_hashes(block_hashes)
        remote_hashes: frozenset = frozenset()
        if self.remote is not None:
            with self._lock:
                self._check_open()
                num_local = len(self._local_prefix(block_hashes))
            rest = block_hashes[num_local:]
            remote_hashes = frozenset(rest[: self._remote_lookup(rest, count=False)])
        with self._lock:
            self._check_open()
            self._reap()
            return plan_prefetch(self, block_hashes, remote_hashes, count=count and self._first_count(request_id))

    def load(self, block_hashes: Sequence[BlockHash], request_id: str | None = None, count: bool = True) -> LoadResult:
        """``prefetch(block_hashes).wait()``: the leading cached blocks in the top pool,
        pinned. Shorter than asked when a block is missing, corrupt or finds no slot."""
        return self.prefetch(block_hashes, request_id, count).wait()

    # -- stores ------------------------------------------------------------------------------
    def prepare_store(self, block_hashes: Sequence[BlockHash]) -> StoreHandle:
        """Reserve top-pool slots for the blocks of ``block_hashes`` not stored yet.

        Stops at the first block that gets no slot (every candidate victim pinned) or that
        another request is writing: blocks after a gap could never be hit through the chain.
        """
        self._check_hashes(block_hashes)
        with self._lock:
            self._check_open()
            self._reap()
            top = self.top
            present = Lease(self, [h for h in block_hashes if h in top])  # not evicted by make_room
            self._make_room(0, sum(1 for h in block_hashes if h not in top))
            new_hashes: list[BlockHash] = []
            block_ids: list[int] = []
            indices: list[int] = []
            chain: list[BlockHash] = []  # pinned blocks of this request, in request order
            for i, h in enumerate(block_hashes):
                if (top.medium, h) in self._pending:
                    break
                if h not in top:
                    block_id = top.allocate(h)
                    if block_id is None:
                        break
                    self._pending.add((top.medium, h))
                    new_hashes.append(h)
                    block_ids.append(block_id)
                    indices.append(i)
                chain.append(h)
            handle = StoreHandle(new_hashes, block_ids, indices, len(chain), Lease(self, chain))
            handle.abandon = weakref.finalize(handle, self._defer_or_run, partial(self._free_pending, top, new_hashes))
            present.release()
            return handle

    def complete_store(self, handle: StoreHandle, success: bool = True) -> None:
        """Publish the written blocks (or free their slots when ``success`` is False)."""
        with self._lock:
            top = self.top
            if handle.abandon is not None:
                handle.abandon.detach()
            for h in handle.block_hashes:
                self._pending.discard((top.medium, h))
                if not success:
                    top.free(h)
            if success:
                self.stats.stored_blocks[top.medium] += len(handle.block_hashes)
                self._touch_tail_first(handle.lease.block_hashes, frozenset(handle.block_hashes))
                if self.config.write_policy == "write_through":
                    self._write_through(handle.block_hashes)
                self._put_remote(handle.block_hashes)
            handle.lease.release()

    def store(self, block_hashes: Sequence[BlockHash], blocks: torch.Tensor) -> int:
        """Store ``blocks`` (``[len(block_hashes), *spec.block_shape]``, spec dtype, any
        device) under ``block_hashes``. Returns the number of leading blocks now stored.

        Raises:
            ValueError: ``blocks`` has the wrong shape or dtype.
        """
        self._check_block_tensor(blocks, len(block_hashes))
        def write(indices: list[int], block_ids: list[int]) -> None:
            # One copy per run of consecutive slots (index_copy_ runs at half a plain copy's
            # speed on CPU, and a gathered source would be a second copy).
            top = self.top.tensor
            for i0, b0, n in slot_runs(list(zip(indices, block_ids))):
                top[b0 : b0 + n].copy_(blocks[i0 : i0 + n])  # synchronous: the caller may reuse `blocks`

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
        t0 = time.perf_counter()
        chunk = max(1, self.top.num_blocks // 2)
        stored = 0
        new: set[BlockHash] = set()
        protected: list[BlockHash] = []
        try:
            stored = self._store_chunks(block_hashes, write, chunk, new, protected)
        finally:
            with self._lock:
                self._protected.subtract(protected)
                self._protected += Counter()  # drop zero counts
        with self._lock:
            if stored > chunk:  # re-order across chunks: the request's tail goes first
                self._touch_tail_first(block_hashes[:stored], frozenset(new))
            # A request larger than every tier evicts its own head: claim only what a lookup
            # finds (case B2: never claim more than is stored).
            stored = next((i for i, h in enumerate(block_hashes[:stored]) if self.medium_of(h) is None), stored)
        self._observe("store", t0)
        return stored

    def _store_chunks(self, block_hashes, write, chunk: int, new: set, protected: list) -> int:
        """store_with's loop: each chunk stored is protected from being dropped while the
        rest of the request goes in."""
        stored = 0
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
            new.update(handle.block_hashes)
            part = block_hashes[start:stored]
            with self._lock:
                self._protected.update(part)
            protected.extend(part)
            if stored < min(start + chunk, len(block_hashes)):
                break
        return stored

    # -- lifecycle ---------------------------------------------------------------------------
    def wait_for_writes(self) -> None:
        """Block until background writes (write-through to DISK, puts to REMOTE) are done
        and released."""
        with self._lock:
            self._reap(wait=True)

    def flush(self) -> None:
        """Write every block held only in memory down to DISK (oldest first), then fsync."""
        with self._lock:
            self._reap(wait=True)
            if self.disk is None:
                return
            for pool in reversed(self.pools):
                only_here = [
                    h for h in pool.lru_order() if (pool.medium, h) not in self._pending and h not in self.disk
                ]
                self._spill_to_disk(pool, only_here)
            self.disk.flush()

    def close(self) -> None:
        """Flush (if ``config.flush_on_close``), stop the I/O threads, close DISK. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self.config.flush_on_close:
                self.flush()
            self._reap(wait=True)
            self.engine.close()
            self._executor.shutdown(wait=True)
            if self.disk is not None:
                self.disk.close()
            if self._owns_remote:
                self.remote.close()
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
        with self._lock:
            self._drain()
            return self._ref_cnt[block_hash]

    def check_invariants(self) -> None:
        """For tests: pools and DISK agree with their indexes, caps hold, pins are sane."""
        with self._lock:
            self._drain()
            self._reap(wait=True)
            for pool in self.pools:
                pool.check()
                assert pool.used_bytes <= pool.capacity_bytes
            if self.disk is not None:
                self.disk.check()
            assert all(n > 0 for n in self._ref_cnt.values()), "a ref_cnt went to zero or below but stayed"
            assert not self._pending, "a transfer or store was started but never completed"

    # -- pins and order ----------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        """A forked child may read (its own read-only DISK view, new I/O threads: the
        parent's do not exist in the child) and use its copies of the memory tiers; it never
        writes the parent's DISK directory (guarantee 5, docs/reliability.md)."""
        self._lock = threading.RLock()
        self._executor = ThreadPoolExecutor(self.config.num_io_threads, thread_name_prefix="kvtier-io")
        if self.disk is not None and not self._closed:
            self.disk.after_fork_in_child()
        if self._closed:
            return
        self._background.clear()
        self.engine = TransferEngine()  # the parent's jobs and locks are not the child's
        self._register_handlers()

    def _observe(self, op: str, t0: float) -> None:
        if self.observe is not None:
            self.observe(op, time.perf_counter() - t0)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("store is closed")
        self._drain()

    def _drain(self) -> None:
        """Run deferred cleanups (the caller holds the lock)."""
        while self._deferred:
            self._deferred.popleft()()

    def _release_pins(self, block_hashes: Sequence[BlockHash]) -> None:
        """Unpin now if the lock is free (or ours), else defer: a lease collected by a GC pass
        on an I/O thread while the main thread holds the lock and waits for that thread must
        not wait for the lock (a deadlock)."""
        self._defer_or_run(partial(self._unpin, block_hashes))

    def _defer_or_run(self, cleanup) -> None:
        if self._lock.acquire(blocking=False):
            try:
                cleanup()
            finally:
                self._lock.release()
        else:
            self._deferred.append(cleanup)

    @staticmethod
    def _check_hashes(block_hashes: Sequence[BlockHash]) -> None:
        """Block hashes are ``bytes`` of 16 or 32 bytes (kvtier.checks); anything else would
        poison the index and fail later inside other requests' spills."""
        check_block_hashes(block_hashes)

    def _check_block_tensor(self, blocks: torch.Tensor, n: int) -> None:
        expected = (n, *self.spec.block_shape)
        if not isinstance(blocks, torch.Tensor) or tuple(blocks.shape) != expected:
            got = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise ValueError(f"expected blocks of shape {expected}, got {got}")
        if blocks.dtype != self.spec.dtype:
            raise ValueError(f"expected blocks of dtype {self.spec.dtype}, got {blocks.dtype}")

    def _pin(self, block_hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for h in block_hashes:
                self._ref_cnt[h] += 1

    def _unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for h in block_hashes:
                n = self._ref_cnt[h] - 1
                assert n >= 0, "unpinned more often than pinned"
                if n:
                    self._ref_cnt[h] = n
                else:
                    del self._ref_cnt[h]

    def _free_pending(self, pool: BlockPool, block_hashes: Sequence[BlockHash]) -> None:
        """Free slots reserved for a transfer or store that will never complete."""
        for h in block_hashes:
            if (pool.medium, h) in self._pending:
                self._pending.discard((pool.medium, h))
                pool.free(h)

    def _evictable(self, medium: Medium, block_hash: BlockHash) -> bool:
        return block_hash not in self._ref_cnt and (medium, block_hash) not in self._pending

    def _touch_tail_first(self, block_hashes: Sequence[BlockHash], new: frozenset = frozenset()) -> None:
        """A use of ``block_hashes`` (``new`` ones only move to the recent end of probation),
        in reverse order, so the head of a request is the last of it to be evicted."""
        tiers = [*self.pools, *([self.disk] if self.disk is not None else [])]
        for h in reversed(block_hashes):
            for tier in tiers:
                if h in tier:
                    tier.refresh(h) if h in new else tier.touch(h)

    # -- eviction and spills -----------------------------------------------------------------
    def _make_room(self, index: int, num_blocks: int) -> None:
        """Evict from ``pools[index]`` until ``num_blocks`` slots are free (or nothing more
        is evictable); victims spill down in one batch."""
        self._drain()
        pool = self.pools[index]
        missing = num_blocks - pool.num_free
        if missing <= 0:
            return
        victims = self._victims(pool, missing)
        if len(victims) < missing and self._background:
            # Background writes (REMOTE puts, write-through) pin their sources: wait for them
            # (each bounded by its tier's timeout) rather than refuse the store.
            self._reap(wait=True)
            victims = self._victims(pool, missing)
        if self.config.write_policy == "write_back":
            spill = victims
        else:
            spill = [h for h in victims if not self._below_has(index, h)]
        self._write_down(index, spill)
        # The head of a request being stored is never dropped to make room for its own tail
        # (a request larger than every tier keeps its head: the part a later prompt can hit).
        victims = [h for h in victims if h not in self._protected or self._below_has(index, h)]
        for h in victims:
            pool.free(h, evicted=True)
        self.stats.evicted_blocks[pool.medium] += len(victims)

    def _victims(self, pool: BlockPool, num_blocks: int) -> list[BlockHash]:
        victims = []
        for h in pool.lru_order():
            if len(victims) >= num_blocks:
                break
            if self._evictable(pool.medium, h):
                victims.append(h)
        return victims

    def _below_has(self, index: int, block_hash: BlockHash) -> bool:
        below = self.pools[index + 1 :]
        return any(block_hash in p for p in below) or (self.disk is not None and block_hash in self.disk)

    def _write_down(self, index: int, block_hashes: list[BlockHash]) -> None:
        """Copy blocks of ``pools[index]`` into the next tier down (the next pool, else
        DISK), skipping those it already holds; blocks that find no room there are dropped."""
        pool = self.pools[index]
        if index + 1 == len(self.pools):
            if self.disk is not None:
                self._spill_to_disk(pool, [h for h in block_hashes if h not in self.disk])
            return
        below = self.pools[index + 1]
        todo = [h for h in block_hashes if h not in below]
        self._pin(todo)  # the sources must survive the evictions below
        try:
            self._make_room(index + 1, len(todo))
        finally:
            self._unpin(todo)
        for h in todo:
            below_id = below.allocate(h)
            if below_id is None:
                break
            below.tensor[below_id].copy_(pool.tensor[pool.block_id(h)])
            self.stats.spilled_blocks[below.medium] += 1

    def _disk_room(self, num_blocks: int) -> tuple[list[BlockHash], int] | None:
        """DISK victims that make room for ``num_blocks`` more records: ``(victims,
        footprint)``, or ``None`` when not even evicting everything unpinned would do."""
        assert self.disk is not None
        size = self.disk.footprint(self.spec.block_nbytes)
        need, free = size * num_blocks, self.disk.free_bytes
        victims: list[BlockHash] = []
        for h in self.disk.lru_order():
            if free >= need:
                break
            if self._evictable(Medium.DISK, h) and h not in self._protected:
                victims.append(h)
                free += self.disk.footprint_of(h)
        return (victims, size) if free >= need else None

    def _spill_to_disk(self, pool: BlockPool, block_hashes: list[BlockHash]) -> None:
        """Write blocks of ``pool`` to DISK, batched into LMDB transactions of ~64 MiB
        (evicting DISK victims in the first)."""
        if not block_hashes or self.disk is None:
            return
        room = self._disk_room(len(block_hashes))
        while room is None and block_hashes:  # keep the newest that fit
            block_hashes = block_hashes[1:]
            room = self._disk_room(len(block_hashes))
        if not block_hashes:
            return
        victims, _ = room
        batch = max(1, _DISK_TXN_BYTES // self.spec.block_nbytes)
        for start in range(0, len(block_hashes), batch):
            puts = []
            for h in block_hashes[start : start + batch]:
                block = pool.tensor[pool.block_id(h)]
                puts.append((h, self.namespace, block if block.device.type == "cpu" else block.cpu()))
            try:
                ok = self.disk.write_batch(puts, deletes=victims if start == 0 else ())
            except Exception as exc:  # never into the inference loop: the blocks are just not on DISK
                logger.warning("DISK spill of %d blocks failed: %r", len(puts), exc)
                ok, reason = [False] * len(puts), "error"
            else:
                reason = "full"
            self.stats.spilled_blocks[Medium.DISK] += sum(ok)
            self.stats.store_failures[reason] += len(ok) - sum(ok)
        self.stats.evicted_blocks[Medium.DISK] += len(victims)

    def _write_through(self, block_hashes: list[BlockHash]) -> None:
        """Copy new blocks into every lower pool now; write them to DISK on an I/O thread."""
        for index in range(len(self.pools) - 1):
            self._write_down(index, [h for h in block_hashes if h in self.pools[index]])
        if self.disk is None:
            return
        host = next((p for p in reversed(self.pools) if p.tensor.device.type == "cpu"), None)
        todo = [h for h in block_hashes if host is not None and h in host and h not in self.disk]
        room = self._disk_room(len(todo)) if todo else None
        if room is None:
            self._spill_to_disk(self.pools[-1], [h for h in block_hashes if h in self.pools[-1] and h not in self.disk])
            return
        lease = Lease(self, todo)  # the host copies stay until the write is done
        victims = room[0]
        if victims:
            # Evict now, under the lock, while the victims are known to be unpinned: a job that
            # deleted them later could evict a block pinned in between (guarantee 4).
            self.disk.write_batch([], deletes=victims)
            self.stats.evicted_blocks[Medium.DISK] += len(victims)
        job = TransferJob(host.medium, Medium.DISK, todo, src_ids=[host.block_id(h) for h in todo])
        self._background[self.engine.submit(job)] = (Medium.DISK, lease)

    def _put_remote(self, block_hashes: list[BlockHash]) -> None:
        """Send newly stored blocks to the REMOTE tier in the background (so that other
        processes hit them at once), from the top pool; they stay pinned until it is done."""
        top = self.top
        todo = [h for h in block_hashes if h in top and (top.medium, h) not in self._pending]
        if self.remote is None or not todo:
            return
        lease = Lease(self, todo)
        job = TransferJob(top.medium, Medium.REMOTE, todo, src_ids=[top.block_id(h) for h in todo])
        self._background[self.engine.submit(job)] = (Medium.REMOTE, lease)

    def _reap(self, wait: bool = False) -> None:
        """Consume finished background (write-through) jobs and release their pins."""
        if not self._background:
            return
        ids = list(self._background)
        results = self.engine.wait(ids).values() if wait else self.engine.poll(ids)
        for result in results:
            medium, lease = self._background.pop(result.job_id)
            lease.release()
            if medium is Medium.REMOTE:
                self.stats.stored_blocks[Medium.REMOTE] += sum(result.ok)
            else:
                self.stats.spilled_blocks[medium] += sum(result.ok)
            for reason in result.reasons.values():
                self.stats.store_failures[reason] += 1

