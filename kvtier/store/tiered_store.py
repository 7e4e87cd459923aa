"""TieredStore: one index over the memory pools (GPU, CPU), DISK and REMOTE; the store's facade.

Protocol (the order every caller follows; vLLM kv_offload/abstract.py names the same steps):

    lookup(block_hashes, pin=?)   -> LookupResult     longest cached prefix; no side effects
                                                      beyond an optional pin (a Lease)
    prefetch(block_hashes, fingerprints=?)            checks each block's token fingerprint,
                                  -> PrefetchHandle   pins the hit prefix and starts moving it
                                                      into the top pool (DISK reads on I/O
                                                      threads, CPU->GPU on a CUDA side stream)
    handle.wait() / load(...)     -> LoadResult       the prefix now in top.tensor[block_ids],
                                                      pinned; the caller gathers, then
                                                      releases the lease
    prepare_store(block_hashes, fingerprints=?)       top-pool slots for new blocks (kept
                                  -> StoreHandle      with their fingerprints), pinned and
                                                      invisible to lookups
    (caller writes top.tensor[handle.block_ids])
    complete_store(handle, ok)                        publishes (or frees) them
    store(block_hashes, blocks) / store_with(block_hashes, write)   both store steps, chunked
    reset()                                           every tier empty (kvtier.store.reset)

Verified hits: a block hash decides where to look, never alone what is served. Every tier
keeps with each block the fingerprint of the tokens it was computed from
(:func:`kvtier.hashing.block_keys_for`); a caller that knows the request's tokens (every
connector) passes their fingerprints to ``prefetch``/``load`` and ``store``/``store_with``/
``prepare_store``, and a block of other tokens (a hash collision, a forged or misplaced
record) is a miss counted in ``stats.load_failures["token_mismatch"]``, never served, never
an exception. Without fingerprints a store keeps ``NO_FINGERPRINT`` and a load checks nothing
and reports what each block carries (``LoadResult.fingerprints``): the daemon's relay path.

The work is done by the modules below this one (listed in :mod:`kvtier.store`); none
reaches into another's private names. Tiers are named by where they live: a GPU pool exists
only on a CUDA device (see :func:`kvtier.store.placement.make_pools`).

Threads: every public method takes the store's lock; transfers run outside it on slots that
are pinned and pending until their results are consumed. REMOTE calls are never made under
the lock.
"""

from __future__ import annotations

import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvtier.checks import CheckedHashes, check_block_hashes, check_fingerprints, check_namespace
from kvtier.config import StoreConfig
from kvtier.kernels import host_copy
from kvtier.store import misses
from kvtier.store.events import AllBlocksCleared, EventBatch, KVEventPublisher
from kvtier.store.lookup import ChainLookup
from kvtier.store.misses import Explanation, MissMemory
from kvtier.store.placement import Placement, make_pools
from kvtier.store.prefetch import Prefetcher, PrefetchHandle
from kvtier.store.reset import empty_local_tiers, empty_remote
from kvtier.store.residency import Residency
from kvtier.store.results import (
    LoadResult, LookupResult, PromptInfo, ResetResult, StoreHandle, StoreStats, check_connector_counts,
)
from kvtier.store.stores import StorePath
from kvtier.store.trace import open_trace
from kvtier.store.writes import BackgroundWrites
from kvtier.tiers.backend import RemoteBackend, make_remote
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import BlockPool
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.handlers import register_handlers, slot_runs
from kvtier.types import BlockHash, Fingerprint, KVSpec, Medium


class TieredStore:
    """GPU pool -> CPU slab -> DISK -> REMOTE, one SLRU index per tier and pins across tiers.

    Args:
        spec: block shape and dtype.
        config: capacities (bytes), policies, data directory, I/O threads.
        namespace: 32-byte ``KeyContext.namespace()``; written into every DISK record and
            checked on every DISK read.
        device: device of the top pool; default ``cuda`` when available, else ``cpu``. A GPU
            pool is built only on a non-CPU device; on ``cpu`` the ``gpu_bytes`` budget is
            added to the CPU pool (no tier is called GPU where there is no GPU).
        remote: the REMOTE tier (kvtier.tiers.backend); default: built from
            ``config.remote_url`` (and closed with the store), none when that is unset. A
            backend passed in stays the caller's to close.
        emulate_gpu: on a ``cpu`` device, build the GPU pool in host memory anyway (labelled
            GPU, ``pool.device`` cpu): a two-pool hierarchy for tests and benchmarks without
            CUDA. Ignored on a CUDA device.

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
        emulate_gpu: bool = False,
    ) -> None:
        check_namespace(namespace)
        if spec.block_size != config.block_size:
            raise ValueError(f"expected spec.block_size == config.block_size, got {spec.block_size}, {config.block_size}")
        self.spec, self.config, self.namespace = spec, config, namespace
        self.pools = make_pools(spec, config, device, emulate_gpu)
        self.disk = DiskTier(config.data_dir / "disk", config.disk_bytes) if config.disk_bytes else None
        self.remote = self._open_remote(remote)
        self.stats = StoreStats()
        self.residency = Residency()
        self.events = KVEventPublisher(spec.block_size)
        """KV events of this store (kvtier.store.events): subscribe, queue or keep a history."""
        self.name: str | None = None
        """A display name (a connector sets the model id): metrics, ``/v1/stats`` and
        ``kvtier stats`` name the store by it rather than by its namespace."""
        self.placement = Placement(
            spec, namespace, config.write_policy, self.pools, self.disk, self.residency, self.stats, self.events
        )
        self._closed = False
        self.misses = MissMemory()
        self.trace = open_trace(config, spec, self.pools, self.disk)
        self._lookups = ChainLookup(
            self.placement, self.residency, self.stats, self.remote, namespace, self._check_open, self.misses
        )
        self._lookups.trace = self.trace
        self._start_io()
        ref = weakref.ref(self)
        # The forking thread holds the store's lock across fork(): no other thread is then in
        # the middle of changing the pools or the pins, so the child's copy is consistent.
        os.register_at_fork(
            before=lambda: (store := ref()) is not None and store.residency.lock.acquire(),
            after_in_parent=lambda: (store := ref()) is not None and store.residency.lock.release(),
            after_in_child=lambda: (store := ref()) is not None and store._after_fork_in_child(),
        )
        self.observe: Callable[[str, float], None] | None = None
        """Latency hook: ``observe(op, seconds)`` after each ``lookup``, ``load`` (prefetch
        submit to ``wait`` done) and ``store`` (``store``/``store_with``); kvtier.metrics
        sets it to feed its histograms. Must be cheap and must not raise."""

    def _open_remote(self, remote: RemoteBackend | None) -> RemoteBackend | None:
        config = self.config
        self._owns_remote = remote is None and config.remote_url is not None
        if self._owns_remote:
            remote = make_remote(config.remote_url, token=config.remote_token, timeout_s=config.remote_timeout_s)
        if remote is not None:
            try:
                remote.register(self.namespace, self.spec)
            except BaseException:
                if self.disk is not None:
                    self.disk.close()
                if self._owns_remote:
                    remote.close()
                raise
        return remote

    def _start_io(self) -> None:
        """I/O threads, the transfer engine and its handlers, and the parts that use them."""
        self._executor = ThreadPoolExecutor(self.config.num_io_threads, thread_name_prefix="kvtier-io")
        self.engine = register_handlers(TransferEngine(), self.pools, self.disk, self.remote, self.namespace, self._executor)
        self._writes = BackgroundWrites(self.placement, self.residency, self.engine, self.stats, self.remote)
        self.placement.wait_for_writes = partial(self._writes.reap, wait=True)
        self._stores = StorePath(self.placement, self.residency, self._writes, self.stats, self._check_open)
        self._stores.trace, self._stores.memory = self.trace, self.misses
        self._prefetcher = Prefetcher(
            self.placement, self.residency, self.engine, self.stats, self.config.num_io_threads, self._observe,
            self.misses,
        )

    # -- where blocks are --------------------------------------------------------------------
    @property
    def top(self) -> BlockPool:
        """The pool loads land in and stores start from (GPU, else CPU)."""
        return self.placement.top

    def pool(self, medium: Medium) -> BlockPool | None:
        return self.placement.pool(medium)

    def medium_of(self, block_hash: BlockHash) -> Medium | None:
        """Fastest medium holding a published copy of ``block_hash``, else ``None`` (without
        the lock: a snapshot that may change right after)."""
        return self.placement.medium_of(block_hash)

    def on_disk(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each block has a committed DISK record (the daemon's durable puts)."""
        with self.residency.lock:
            return [self.disk is not None and h in self.disk for h in block_hashes]

    def ref_cnt(self, block_hash: BlockHash) -> int:
        """Live pins on ``block_hash``."""
        return self.residency.ref_cnt(block_hash)

    # -- lookups and loads -------------------------------------------------------------------
    def lookup(
        self, block_hashes: Sequence[BlockHash], pin: bool = False, request_id: str | None = None,
        blocking: bool = True, prompt: PromptInfo | None = None,
    ) -> LookupResult | None:
        """Longest prefix of ``block_hashes`` present in any tier, the REMOTE tier last (asked
        only for the blocks after the local prefix, outside the store's lock). Touches no
        LRU order; pins the local part when ``pin``.

        Args:
            request_id: when given, a repeated lookup for the same request (a retried
                schedule) is not counted again in ``stats`` (case M1).
            blocking: ``False``: return ``None`` at once if another thread holds the store's
                lock, and never ask REMOTE (an event loop can call it inline: the daemon).
            prompt: what the caller knows of the prompt (its length, content keys), so the
                misses are counted with their reasons (kvtier.store.misses).
        """
        _check_hashes(block_hashes)
        t0 = time.perf_counter()
        walked = self._lookups.walk(block_hashes, request_id, pin=pin, blocking=blocking, prompt=prompt)
        if walked is None:
            return None
        media, lease = walked.media, walked.lease
        self._observe("lookup", t0)
        return LookupResult(len(media), media, lease)

    def prefetch(
        self, block_hashes: Sequence[BlockHash], request_id: str | None = None, count: bool = True,
        prompt: PromptInfo | None = None, fingerprints: Sequence[Fingerprint] | None = None,
        sinks: Callable[[int], Sequence[Any] | None] | None = None,
    ) -> PrefetchHandle:
        """Pin the cached prefix of ``block_hashes`` and start bringing it into the top pool
        (REMOTE blocks included: asked for first, outside the lock). Returns at once;
        ``handle.wait()`` gives the :class:`LoadResult`. Counted as a lookup exactly as
        :meth:`lookup` counts it, and the blocks found but not loaded (beyond the top pool,
        failed, of other tokens, ...) as misses on ``wait``; ``request_id``, ``prompt``: see
        :meth:`lookup`; ``count=False``: not a lookup (the daemon's get, whose lookup was counted
        already).

        Args:
            fingerprints: the request's token fingerprint of each block
                (:func:`kvtier.hashing.block_keys_for`); the prefix ends at the first block
                a tier holds with another (a miss counted as ``token_mismatch``). ``None``:
                not checked (the daemon's relay, tests).
            sinks: a second destination for the blocks read from DISK into a host-memory top
                pool (:meth:`Prefetcher.plan`; ``handle.sunk`` says which): ``sinks(n)``, called
                under the store's lock with the number of blocks planned, returns one tensor of
                the block's shape per block, or ``None``. The blocks still land in the top pool.

        Raises:
            ValueError: bad block hashes, or fingerprints that are not one 32-byte value per hash.
        """
        _check_hashes(block_hashes)
        fingerprints = check_fingerprints(fingerprints, len(block_hashes))
        walk = self._lookups.walk(block_hashes, request_id, count=count, prompt=prompt, load=True)
        with self.residency.lock:
            self._check_open()
            self._writes.reap()
            return self._prefetcher.plan(block_hashes, walk.media, fingerprints, walk.counted, self.namespace,
                                         walk.generation, sinks)

    def load(
        self, block_hashes: Sequence[BlockHash], request_id: str | None = None, count: bool = True,
        prompt: PromptInfo | None = None, fingerprints: Sequence[Fingerprint] | None = None,
    ) -> LoadResult:
        """``prefetch(block_hashes, ..., fingerprints).wait()``: the leading cached blocks in
        the top pool, pinned. Shorter than asked when a block is missing, corrupt, of other
        tokens or finds no slot."""
        return self.prefetch(block_hashes, request_id, count, prompt, fingerprints).wait()

    def explain(self, block_hashes: Sequence[BlockHash], prompt: PromptInfo | None = None) -> Explanation:
        """Where each block of ``block_hashes`` would hit and why the rest would miss, as a
        load would see them now (REMOTE asked for what the local tiers miss); counts
        nothing, pins nothing, moves nothing (kvtier.store.misses)."""
        _check_hashes(block_hashes)
        walk = self._lookups.walk(block_hashes, count=False)
        with self.residency.lock:
            self._check_open()
            return misses.explain(self.placement, self.misses, block_hashes, walk.media, walk.remote_down, prompt,
                                  self.namespace)

    def events_snapshot(self) -> EventBatch:
        """An ``AllBlocksCleared`` then a ``BlockStored`` per tier of every block held now,
        numbered with the last published batch's ``seq`` (a stream resumes after it)."""
        with self.residency.lock:  # events are published under this lock: seq and blocks agree
            self._check_open()
            return self.events.snapshot(self.placement.held_blocks())

    # -- stores ------------------------------------------------------------------------------
    def prepare_store(
        self, block_hashes: Sequence[BlockHash], fingerprints: Sequence[Fingerprint] | None = None,
        blocking: bool = True,
    ) -> StoreHandle | None:
        """Reserve top-pool slots for the blocks of ``block_hashes`` not stored yet (pinned,
        invisible to lookups), each kept with its token fingerprint (``fingerprints``;
        default ``NO_FINGERPRINT``); write ``top.tensor[handle.block_ids]``, then
        :meth:`complete_store`. Stops at the first block that gets no slot (every candidate
        victim pinned) or that another request is writing: blocks after a gap could never be
        hit through the chain.

        Args:
            blocking: ``False``: return ``None`` at once, reserving nothing, if another thread
                holds the store's lock (an event loop can call it inline: the daemon's put).
        """
        _check_hashes(block_hashes)
        fingerprints = check_fingerprints(fingerprints, len(block_hashes))
        lock = self.residency.lock
        if not lock.acquire(blocking=blocking):
            return None
        try:
            return self._stores.prepare(block_hashes, fingerprints)
        finally:
            lock.release()

    def complete_store(self, handle: StoreHandle, success: bool = True) -> None:
        """Publish the written blocks (or free their slots when ``success`` is False)."""
        self._stores.complete(handle, success)

    def store(
        self, block_hashes: Sequence[BlockHash], blocks: torch.Tensor, fingerprints: Sequence[Fingerprint] | None = None
    ) -> int:
        """Store ``blocks`` (``[len(block_hashes), *spec.block_shape]``, spec dtype, any
        device) under ``block_hashes``, each with its token fingerprint (``fingerprints``;
        default ``NO_FINGERPRINT``). Returns the number of leading blocks now stored.

        Raises:
            ValueError: ``blocks`` has the wrong shape or dtype; bad fingerprints.
        """
        self._check_block_tensor(blocks, len(block_hashes))

        top = self.top.tensor
        source = host_blocks(blocks, top)

        def write(indices: list[int], block_ids: list[int]) -> list[int | None] | None:
            if source is not None:  # each block hashed as it is copied
                return copy_hashed(top, block_ids, source, indices)
            # One copy per run of consecutive slots (index_copy_ runs at half a plain copy's
            # speed on CPU, and a gathered source would be a second copy).
            for i0, b0, n in slot_runs(list(zip(indices, block_ids))):
                top[b0 : b0 + n].copy_(blocks[i0 : i0 + n])  # synchronous: the caller may reuse `blocks`
            return None

        return self.store_with(block_hashes, write, fingerprints=fingerprints)

    def store_with(
        self, block_hashes: Sequence[BlockHash], write: Callable[[list[int], list[int]], None],
        prompt: PromptInfo | None = None, fingerprints: Sequence[Fingerprint] | None = None,
    ) -> int:
        """Store a request's blocks in chunks of at most half the top pool, so that a request
        larger than the top pool still goes through it (earlier chunks spill down, tail
        first) instead of being cut short.

        Args:
            block_hashes: the request's full blocks, in order.
            write: ``write(indices, block_ids)`` copies request blocks ``indices`` into
                ``top.tensor[block_ids]``; an exception frees the chunk's slots and propagates.
                It may run on the DISK tier's writer thread (a store into a full last pool
                whose blocks are >= 640 KiB writes each block into a victim's slot as LMDB
                copies the next victim: kvtier.tiers.disk._WriteOverlap) while this thread
                holds the store's lock and waits for it: it must not take that lock or call
                the store, and gets this thread's grad and inference modes but no other
                thread-local torch state (autocast, dispatch modes, streams).
            prompt: its content keys, when given, are remembered to explain later misses
                under another namespace (kvtier.store.misses).
            fingerprints: each block's token fingerprint (default ``NO_FINGERPRINT``).

        Returns:
            leading blocks of the request now stored.

        Raises:
            ValueError: bad block hashes or fingerprints.
        """
        _check_hashes(block_hashes)
        fingerprints = check_fingerprints(fingerprints, len(block_hashes))
        t0 = time.perf_counter()
        stored = self._stores.store_with(block_hashes, write, fingerprints)
        if prompt is not None:
            with self.residency.lock:
                self.misses.note_stored(block_hashes[:stored], prompt, self.namespace)
        self._observe("store", t0)
        return stored

    def record_computed_tokens(
        self, num_tokens: int, ttft_saved_s: float | None = None, ttft_lost_s: float = 0.0
    ) -> None:
        """Count what a connector reports after a prefill, under the store's lock: the prompt
        tokens the engine prefilled itself after the cached prefix (``stats.computed_tokens``)
        and, when it can estimate them, the prefill seconds the cache saved
        (``stats.ttft_saved_s``) or lost (``stats.ttft_lost_s``: a load slower than
        recomputing; kvtier.connectors.ttft).

        Raises:
            ValueError: a negative or non-integer token count, a negative or non-finite time.
        """
        check_connector_counts(num_tokens, ttft_saved_s, ttft_lost_s)
        with self.residency.lock:
            self.stats.computed_tokens += num_tokens
            if ttft_saved_s is not None:
                self.stats.ttft_saved_s = (self.stats.ttft_saved_s or 0.0) + float(ttft_saved_s)
                self.stats.ttft_lost_s += float(ttft_lost_s)

    # -- lifecycle ---------------------------------------------------------------------------
    def reset(self, remote: bool = True) -> ResetResult:
        """Empty every tier for this store: the memory pools, its DISK records and (with
        ``remote``, when the backend can) its REMOTE namespace, for every process sharing it.
        Counters are kept; usage goes to 0. What is in flight (:mod:`kvtier.store.reset`):
        a prefetch publishes nothing (its ``wait()`` is an empty LoadResult) and frees its
        slots; a store prepared before publishes nothing; a LoadResult's blocks keep their
        bytes until its lease is released; background writes land before the reset.

        Raises:
            RuntimeError: the store is closed, or this is a forked child (DISK is read-only
                here; nothing was changed).
        """
        with self.residency.lock:
            self._check_open()
            self._writes.reap(wait=True)  # in flight: land now, never after the reset
            dropped = empty_local_tiers(self.pools, self.disk, self.residency)
            if self.events.active:  # subscribers (a router) forget every block of this store
                self.events.publish([AllBlocksCleared()])
            clear_remote = remote and self.remote is not None
            if clear_remote:
                self._lookups.remote_clearing += 1
        if not clear_remote:
            return ResetResult(dropped, None)
        try:
            removed = empty_remote(self.remote, self.namespace)
        finally:
            with self.residency.lock:
                self._lookups.remote_clearing -= 1
        if removed is not None:
            dropped["REMOTE"] = removed
        return ResetResult(dropped, removed is not None)

    def wait_for_writes(self) -> None:
        """Block until background writes (write-through to DISK, puts to REMOTE) are done
        and released."""
        with self.residency.lock:
            self._writes.reap(wait=True)

    def flush(self) -> None:
        """Write every block held only in memory down to DISK (oldest first), then fsync."""
        with self.residency.lock:
            self._writes.reap(wait=True)
            if self.disk is None:
                return
            self.placement.flush_to_disk()
            self.disk.flush()

    def close(self) -> None:
        """Flush (if ``config.flush_on_close``), stop the I/O threads, close DISK. Idempotent."""
        with self.residency.lock:
            if self._closed:
                return
            if self.config.flush_on_close:
                self.flush()
            self._writes.reap(wait=True)
            self.engine.close()
            self._executor.shutdown(wait=True)
            if self.disk is not None:
                self.disk.close()
            if self._owns_remote:
                self.remote.close()
            if self.trace is not None:
                self.trace.close()
            self._closed = True

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier (``"GPU"``, ``"CPU"``, ``"DISK"``): ``blocks``, ``used_bytes``,
        ``capacity_bytes``. Where each memory pool lives: ``pool.device``."""
        tiers = [(p.medium, len(p), p.used_bytes, p.capacity_bytes) for p in self.pools]
        if self.disk is not None:
            tiers.append((Medium.DISK, len(self.disk), self.disk.used_bytes, self.disk.capacity_bytes))
        return {str(m): {"blocks": n, "used_bytes": u, "capacity_bytes": c} for m, n, u, c in tiers}

    def check_invariants(self) -> None:
        """For tests: pools and DISK agree with their indexes, caps hold, pins are sane."""
        with self.residency.lock:
            self.residency.drain()
            self._writes.reap(wait=True)
            for pool in self.pools:
                pool.check()
                assert pool.used_bytes <= pool.capacity_bytes
            if self.disk is not None:
                self.disk.check()
            self.residency.check()

    # -- internals ---------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        """A forked child may read (its own read-only DISK view, new I/O threads: the
        parent's do not exist in the child) and use its copies of the memory tiers; it never
        writes the parent's DISK directory (guarantee 5, docs/reliability.md). It starts with
        no pin and no pending slot: those of the parent's prefetches and stores are dropped
        and their slots freed, and their handles are inert here (kvtier.store.residency)."""
        self.residency.after_fork_in_child(self.pools)  # no pin or pending slot of the parent's threads
        self._lookups.remote_clearing = 0
        self._executor = ThreadPoolExecutor(self.config.num_io_threads, thread_name_prefix="kvtier-io")
        if self._closed:
            return
        if self.disk is not None:
            self.disk.after_fork_in_child()
        # the parent's jobs and locks are not the child's
        self.engine = register_handlers(TransferEngine(), self.pools, self.disk, self.remote, self.namespace, self._executor)
        self._writes.after_fork_in_child(self.engine)
        self._prefetcher.engine = self.engine

    def _observe(self, op: str, t0: float) -> None:
        if self.observe is not None:
            self.observe(op, time.perf_counter() - t0)

    def _check_open(self) -> None:
        """Raise if closed, then run deferred cleanups (the caller holds the lock)."""
        if self._closed:
            raise RuntimeError("store is closed")
        self.residency.drain()

    def _check_block_tensor(self, blocks: torch.Tensor, n: int) -> None:
        expected = (n, *self.spec.block_shape)
        if not isinstance(blocks, torch.Tensor) or tuple(blocks.shape) != expected:
            got = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise ValueError(f"expected blocks of shape {expected}, got {got}")
        if blocks.dtype != self.spec.dtype:
            raise ValueError(f"expected blocks of dtype {self.spec.dtype}, got {blocks.dtype}")


def _check_hashes(block_hashes: Sequence[BlockHash]) -> None:
    """Block hashes are ``bytes`` of 16 or 32 bytes (kvtier.checks); anything else would
    poison the index and fail later inside other requests' spills. A
    :class:`~kvtier.checks.CheckedHashes` was checked when it was made (immutable: still valid)."""
    if type(block_hashes) is not CheckedHashes:
        check_block_hashes(block_hashes)




def host_blocks(blocks: torch.Tensor, top: torch.Tensor) -> np.ndarray | None:
    """``blocks`` (``[n, *block_shape]``) as ``[n, block_nbytes]`` uint8 rows for
    :func:`copy_hashed` into the pool tensor ``top``, or ``None`` when that cannot take them:
    not plain contiguous host memory, empty, sharing bytes with ``top``, or without the
    compiled kernels and python-xxhash's exported xxh3 (:mod:`kvtier.kernels.host_copy`)."""
    if (top.device.type != "cpu" or blocks.device.type != "cpu" or not blocks.is_contiguous() or not blocks.numel()
            or blocks.is_neg() or blocks.is_conj() or not host_copy.hashing_available()):
        return None
    start, end = blocks.data_ptr(), blocks.data_ptr() + blocks.numel() * blocks.element_size()
    top_start = top.data_ptr()
    if start < top_start + top.numel() * top.element_size() and top_start < end:
        return None
    return blocks.view(torch.uint8).reshape(blocks.shape[0], -1).numpy()


def copy_hashed(top: torch.Tensor, block_ids: list[int], source: np.ndarray, indices: list[int]) -> list[int | None]:
    """Copy ``source[indices[k]]`` (:func:`host_blocks`' rows) into the host pool slot
    ``top[block_ids[k]]`` for every ``k``, each hashed as it is copied
    (:func:`kvtier.kernels.host_copy.hash_copy_rows`: every 64 KiB hashed, then copied from
    cache with streaming stores); returns each slot's xxh3-64 (its
    :meth:`~kvtier.tiers.pool.BlockPool.payload_digest_at`; ``None`` for a block the kernel
    left to numpy's copy).

    Why: the digest spares every record later made of the slot a pass over its bytes (a DISK
    spill, a daemon get: :mod:`kvtier.records`), and the fused copy is no slower than the
    copy alone: 128 x 2 MiB bf16 blocks, one at a time, 7.4 GB/s against 6.9 GB/s for torch's
    ``copy_`` (2026-12-04, bench/results/2026-12-04-payload-digest/copy_in.txt).
    """
    digests: list[int | None] = []
    for b, i in zip(block_ids, indices):
        row, slot = source[i], top[b]
        digest = host_copy.hash_copy_rows(slot.data_ptr(), (1, row.size, row.size), row)
        if digest is None:
            np.copyto(slot.view(torch.uint8).numpy().reshape(-1), row)
        digests.append(digest)
    return digests
