"""Worker side: the store, the lookup server, and the copies into and out of vLLM's cache.

Protocol per request (see :mod:`kvtier.connectors.vllm.scheduler` for the scheduler's half):

- ``reset`` (lookup server thread, from the scheduler's ``reset_cache``): the store is
  emptied (``TieredStore.reset``) and every match is dropped, so no block matched before the
  reset is loaded after it (a load planned on one is reported as a load error: vLLM
  recomputes it); a save prepared before it publishes nothing.
- ``match`` (lookup server thread): ``store.prefetch`` pins the cached chain and starts
  reading DISK/REMOTE blocks into the CPU pool; the answer is the number of blocks that
  arrived and were verified (checksum, and the request's token fingerprints), once the
  reads are done. The blocks stay pinned in a *ticket*
  under the request id until a load takes them or the request goes away.
- ``start_load_kv``: turn this step's :class:`LoadSpec` s into one copy plan (CPU pool slots
  -> vLLM block ids). A block the ticket does not hold (the ticket was released, or fewer
  blocks arrived than planned) is a load error: its vLLM block id is reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes it; it is never decoded.
- ``wait_for_layer_load(layer)``: copy that layer of every planned block into vLLM's cache
  (``kvtier.kernels.gather_blocks_to_paged``), just before the layer's attention reads it.
- ``save_kv_layer(layer)``: copy that layer of this step's new full blocks into CPU-pool
  slots reserved at the step's first layer (``store.prepare_store``: pinned, invisible to
  lookups); ``wait_for_save`` publishes them (``complete_store``), or frees them when a layer
  is missing or a load of the step failed (blocks computed from bad K/V are never stored).
  Under the default ``write_through`` policy the store then writes them to DISK on its I/O
  threads.

On CUDA (FLASH_ATTN, FLASHINFER) the copies cross PCIe through a staging buffer, whole blocks
at a time (:mod:`kvtier.connectors.vllm.copies`): ``start_load_kv`` enqueues the whole load
(H2D on a side stream, gathers on the current stream) and ``wait_for_layer_load`` makes the
layer's stream wait for it; ``save_kv_layer`` only records that the layer ran, and
``wait_for_save`` enqueues the step's saves (scatters, then D2H). Nothing waits on the host:
the load's pool slots are released, and the saved blocks published, once the copies' event
has completed, checked at the next connector call (``_poll``); before reserving slots for new
saves the worker waits for the previous step's (so a block is never reserved twice).

Threads: the lookup server answers on its own thread; tickets are guarded by one lock; the
store is thread-safe. Everything else runs on vLLM's worker thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any, Callable

import torch

from kvtier.connectors.vllm.copies import Fence, PagedCopies
from kvtier.connectors.vllm.keys import EngineKey
from kvtier.connectors.vllm.layout import block_views, kv_spec_for_caches
from kvtier.connectors.vllm.lookup import LookupServer, MatchReply
from kvtier.connectors.vllm.metadata import KVTierMetadata
from kvtier.connectors.vllm.options import ConnectorOptions
from kvtier.connectors.ttft import PrefillRate
from kvtier.store import Lease, PrefetchHandle, StoreHandle, TieredStore

logger = logging.getLogger(__name__)


@dataclass
class _Ticket:
    """Blocks matched for one request: pinned, and in the CPU pool once ``handle`` is done."""

    block_hashes: list[bytes]
    handle: PrefetchHandle
    fingerprints: list[bytes] | None = None

    def release(self) -> None:
        self.handle.wait().lease.release()


@dataclass
class _StepLoad:
    """This step's copies CPU pool -> vLLM cache."""

    pool_ids: torch.Tensor  # [n] int64, CPU-pool slots
    paged_ids: torch.Tensor  # [n] int64, vLLM block ids
    leases: list[Lease]
    layers_done: list[bool]
    failed: bool = False
    fence: Fence | None = None  # staged (CUDA): the whole load, enqueued by start_load_kv


@dataclass
class _StepSave:
    """This step's copies vLLM cache -> CPU pool, published in ``wait_for_save``."""

    handle: StoreHandle | None
    pool_ids: torch.Tensor  # [n] int64
    paged_ids: torch.Tensor  # [n] int64
    layers_done: list[bool]


@dataclass
class WorkerCounters:
    """Connector events on one worker (tokens and blocks), for logs, tests and benchmarks."""

    matches: int = 0
    loaded_tokens: Counter = field(default_factory=Counter)  # by source medium
    load_error_blocks: int = 0
    saved_blocks: int = 0
    save_skipped_blocks: int = 0  # no free CPU-pool slot this step
    save_discarded_blocks: int = 0  # a layer missing or a load failed in the step


class WorkerSide:
    """Worker-side state of the connector; the store is built in :meth:`register_kv_caches`.

    Args:
        engine_key: the engine's key fields.
        options: store config and connector options.
        socket_path: where this rank's lookup server listens.
    """

    def __init__(self, engine_key: EngineKey, options: ConnectorOptions, socket_path: str) -> None:
        self.engine_key, self.options, self.socket_path = engine_key, options, socket_path
        self.block_size = engine_key.block_size
        self.tp_rank = 0
        self.store: TieredStore | None = None
        self.server: LookupServer | None = None
        self.counters = WorkerCounters()
        self.copies: PagedCopies | None = None
        self._caches: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._tickets: dict[str, _Ticket] = {}
        self._lock = threading.Lock()
        self._load: _StepLoad | None = None
        self._save: _StepSave | None = None
        self._load_errors: set[int] = set()
        self._deferred: list[tuple[Fence, Callable[[], None]]] = []  # run once the fence is done
        self.prefill_rate = PrefillRate()
        self._step: list[float] | None = None  # [start, prompt tokens, loaded tokens, load s] of this step

    # -- set-up ------------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], layer_order: list[str], tp_rank: int, backend: str = "CPU_ATTN",
        head_size: int | None = None, staged: bool | None = None,
    ) -> None:
        """Build the store for these caches and start the lookup server.

        Args:
            kv_caches: layer name -> ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
                (CPU_ATTN: contiguous; FLASH_ATTN/FLASHINFER: vLLM 0.32's logical ``[B, H,
                N, C]`` view, any strides; :mod:`kvtier.connectors.vllm.layout`).
            layer_order: the attention layers' names in model order; names sharing one cache
                tensor (cross-layer KV sharing) map to the first of them.
            tp_rank: this worker's tensor-parallel rank.
            backend: the attention backend's name (``AttentionBackend.get_name()``).
            head_size: the model's head size (default: half the cache's last dim).
            staged: copy through a staging buffer, whole blocks (default: when the caches are
                not in host memory; ``True`` runs that path on the CPU, for tests).

        Raises:
            ValueError: a cache not in the backend's layout.
            NotImplementedError: a backend the connector does not handle.
        """
        self.tp_rank = tp_rank
        by_ptr: dict[int, int] = {}
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for name in layer_order:
            cache = kv_caches[name]
            index = by_ptr.setdefault(cache.data_ptr(), len(self._caches))
            if index == len(self._caches):
                self._caches.append(cache)
                key, value = block_views(backend, cache, self.block_size, head_size or cache.shape[-1] // 2)
                keys.append(key)
                values.append(value)
            self._layer_index[name] = index
        spec = kv_spec_for_caches(self._caches, self.block_size)
        self.store = TieredStore(spec, self.options.store, self.engine_key.namespace(tp_rank), device="cpu")
        self.copies = PagedCopies(self.store.top.tensor, keys, values, self.options.staging_bytes, staged=staged)
        self.store.name = self.engine_key.model_id
        self.server = LookupServer(self.socket_path, self.handle)
        logger.info(
            "kvtier: %s on %s, %d layers, block %d tokens (%.1f MiB), CPU pool %d blocks, DISK %s%s; lookups on %s",
            backend, keys[0].device, spec.num_layers, spec.block_size, spec.block_nbytes / 2**20,
            self.store.top.num_blocks, self.options.store.data_dir if self.store.disk is not None else "off",
            f"; staging 2 x {self.copies.staging_blocks} blocks" if self.copies.staged else "", self.socket_path,
        )

    # -- lookups (server thread) ---------------------------------------------------------------
    def handle(
        self, op: str, req_id: str, block_hashes: list[bytes], wait_s: float, fingerprints: list[bytes] | None = None
    ) -> MatchReply:
        """Answer one lookup request (see :mod:`kvtier.connectors.vllm.lookup`); the blocks
        are loaded only if they carry ``fingerprints`` (the request's tokens)."""
        if op == "drop":
            self._drop(req_id)
            return 0, []
        if op == "reset":
            self.reset()
            return 0, []
        if op != "match":
            raise ValueError(f"expected op 'match', 'drop' or 'reset', got {op!r}")
        assert self.store is not None, "lookup before register_kv_caches"
        keys = (block_hashes, fingerprints)
        with self._lock:
            ticket = self._tickets.get(req_id)
            stale = ticket is not None and (ticket.block_hashes, ticket.fingerprints) != keys  # vLLM's hit moved
            if stale:
                del self._tickets[req_id]
        if stale:
            ticket.release()  # first: its pending slots would cut the new prefetch short
            ticket = None
        if ticket is None:
            handle = self.store.prefetch(block_hashes, request_id=req_id, fingerprints=fingerprints)
            ticket = _Ticket(block_hashes, handle, fingerprints)
            with self._lock:
                self._tickets[req_id] = ticket
            self.counters.matches += 1
        deadline = time.monotonic() + wait_s
        while not ticket.handle.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not ticket.handle.done():
            return None, []
        result = ticket.handle.wait()
        if not result.block_ids:
            self._drop(req_id)
            return 0, []
        return len(result.block_ids), [str(m) for m in result.sources]

    def reset(self) -> None:
        """Empty the store's tiers (REMOTE namespace included) and drop every match."""
        if self.store is None:
            return
        result = self.store.reset()
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
        for ticket in tickets:
            ticket.release()  # from before the reset: empty, or pins on blocks no tier holds now
        logger.info("kvtier: reset: dropped %s (REMOTE emptied: %s)", result.dropped_blocks, result.remote_cleared)

    def _drop(self, req_id: str) -> None:
        with self._lock:
            ticket = self._tickets.pop(req_id, None)
        if ticket is not None:
            ticket.release()

    # -- loads -------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Release dropped matches; plan this step's copies into vLLM's cache (staged: enqueue them)."""
        started = time.perf_counter()
        self._step = [started, meta.prefill_tokens, 0, 0.0]
        self._poll()
        for req_id in meta.drops:
            self._drop(req_id)
        if not meta.loads:
            return
        self._step[2] = sum(len(spec.block_ids) for spec in meta.loads) * self.block_size
        pool_ids: list[int] = []
        paged_ids: list[int] = []
        leases: list[Lease] = []
        failed = False
        for spec in meta.loads:
            with self._lock:
                ticket = self._tickets.pop(spec.req_id, None)
            result = ticket.handle.wait() if ticket is not None else None  # answered: returns at once
            num_ok = min(len(result.block_ids), len(spec.block_ids)) if result is not None else 0
            if result is not None:
                leases.append(result.lease)
                pool_ids += result.block_ids[:num_ok]
                for medium in result.sources[:num_ok]:
                    self.counters.loaded_tokens[str(medium)] += self.block_size
            paged_ids += spec.block_ids[:num_ok]
            if num_ok < len(spec.block_ids):
                logger.warning(
                    "kvtier: request %s: %d of %d planned blocks not held; vLLM recomputes them",
                    spec.req_id, len(spec.block_ids) - num_ok, len(spec.block_ids),
                )
                self._fail_blocks(spec.block_ids[num_ok:])
                failed = True
        self._load = load = _StepLoad(
            torch.tensor(pool_ids, dtype=torch.int64), torch.tensor(paged_ids, dtype=torch.int64),
            leases, [False] * len(self._caches), failed=failed,
        )
        if self.copies.staged and paged_ids:
            try:
                load.fence = self.copies.load(pool_ids, paged_ids)
            except Exception:
                logger.exception("kvtier: enqueueing this step's loads failed; vLLM recomputes them")
                self.copies.settle()
                self._fail_load(load)
        self._step[2] = len(pool_ids) * self.block_size
        self._step[3] += time.perf_counter() - started

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Copy layer ``layer_name`` of this step's loads into vLLM's cache."""
        load = self._load
        index = self._layer_index.get(layer_name)
        if load is None or index is None or load.layers_done[index]:
            return
        load.layers_done[index] = True
        if not load.paged_ids.numel():
            return
        if load.fence is not None:  # staged: the whole load was enqueued by start_load_kv
            load.fence.wait_ready()
            return
        started = time.perf_counter()
        try:
            self.copies.load_layer(index, load.pool_ids, load.paged_ids)
        except Exception:
            logger.exception("kvtier: copying layer %s into vLLM's cache failed; vLLM recomputes", layer_name)
            self._fail_load(load)
        if self._step is not None:
            self._step[3] += time.perf_counter() - started

    def _fail_blocks(self, paged_ids: list[int]) -> None:
        self._load_errors.update(int(i) for i in paged_ids)
        self.counters.load_error_blocks += len(paged_ids)

    def _fail_load(self, load: _StepLoad) -> None:
        """Report every block of the step's loads (some layers may hold stale K/V)."""
        self._fail_blocks(load.paged_ids.tolist())
        load.paged_ids = load.paged_ids[:0]
        load.pool_ids = load.pool_ids[:0]
        load.failed = True

    def _finish_load(self) -> None:
        """End of step: a layer that was never copied means the forward read blocks without
        their K/V: report them so vLLM recomputes. Then unpin the pool slots."""
        load, self._load = self._load, None
        if load is None:
            return
        if load.paged_ids.numel() and not all(load.layers_done):
            missing = [i for i, done in enumerate(load.layers_done) if not done]
            logger.error("kvtier: layers %s never waited for their load; vLLM recomputes", missing)
            self._fail_load(load)
        release = partial(_release_all, load.leases)
        if load.fence is not None and not load.fence.done():
            self._deferred.append((load.fence, release))  # the H2D copies still read those slots
        else:
            release()

    def _poll(self, wait: bool = False) -> None:
        """Run the deferred releases and publications whose copies are done (``wait``: all of
        them, blocking the host until their copies are)."""
        while self._deferred:
            fence, action = self._deferred[0]
            if not wait and not fence.done():
                return
            fence.wait()
            self._deferred.pop(0)
            action()

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, meta: KVTierMetadata, kv_layer: torch.Tensor | None = None) -> None:
        """Copy layer ``layer_name`` of this step's new full blocks into reserved pool slots.
        ``kv_layer``: the cache vLLM passes (must be the one registered for that layer)."""
        if self._save is None:
            self._save = self._prepare_save(meta)
        save = self._save
        index = self._layer_index.get(layer_name)
        if save.handle is None or index is None or save.layers_done[index]:
            return
        assert kv_layer is None or kv_layer.data_ptr() == self._caches[index].data_ptr(), (
            f"layer {layer_name}: vLLM saves from another cache tensor than it registered"
        )
        if not self.copies.staged:  # staged: wait_for_save copies every layer at once
            self.copies.save_layer(index, save.paged_ids, save.pool_ids)
        save.layers_done[index] = True

    def _prepare_save(self, meta: KVTierMetadata) -> _StepSave:
        """Reserve pool slots for the step's blocks that kvtier does not hold yet (each
        once, in request order: blocks shared by requests of one batch are written once).
        Staged saves of earlier steps are published first (their blocks are pending until then)."""
        self._poll(wait=True)
        empty = torch.empty(0, dtype=torch.int64)
        hashes: list[bytes] = []
        fingerprints: list[bytes] = []
        paged: list[int] = []
        seen: set[bytes] = set()
        for spec in meta.saves:
            rank_fps = spec.fingerprints[self.tp_rank]
            for block_hash, fingerprint, block_id in zip(spec.block_hashes[self.tp_rank], rank_fps, spec.block_ids):
                if block_hash in seen or self.store.medium_of(block_hash) is not None:
                    continue
                seen.add(block_hash)
                hashes.append(block_hash)
                fingerprints.append(fingerprint)
                paged.append(block_id)
        if not hashes:
            return _StepSave(None, empty, empty, [])
        handle = self.store.prepare_store(hashes, fingerprints)
        self.counters.save_skipped_blocks += len(hashes) - handle.num_blocks
        return _StepSave(
            handle,
            torch.tensor(handle.block_ids, dtype=torch.int64),
            torch.tensor([paged[i] for i in handle.indices], dtype=torch.int64),
            [False] * len(self._caches),
        )

    def wait_for_save(self) -> None:
        """End of step: finish loads, publish (or discard) this step's saves."""
        load_failed = self._load is not None and self._load.failed
        if load_failed and self._step is not None:
            self._step[2] = 0  # recomputed: nothing saved
        self._finish_load()
        self._count_step()
        save, self._save = self._save, None
        if save is not None and save.handle is not None:  # else nothing new, or no forward this step
            self._finish_save(save, ok=all(save.layers_done) and not load_failed)
        self._poll()

    def _finish_save(self, save: _StepSave, ok: bool) -> None:
        """Publish the step's saves (staged: once their copies are done), or free their slots."""
        fence = None
        if ok and self.copies.staged:
            try:
                fence = self.copies.save(save.paged_ids.tolist(), save.pool_ids.tolist())
            except Exception:
                logger.exception("kvtier: enqueueing this step's saves failed; they are not stored")
                self.copies.settle()
                ok = False
        if not ok:
            logger.warning("kvtier: discarding %d blocks of this step (layer missing or load failed)", len(save.pool_ids))
            self.counters.save_discarded_blocks += len(save.handle.block_hashes)
        else:
            self.counters.saved_blocks += len(save.handle.block_hashes)
        publish = partial(self.store.complete_store, save.handle, success=ok)
        if fence is not None and not fence.done():
            self._deferred.append((fence, publish))
        else:
            publish()

    def _count_step(self) -> None:
        """This step's prompt tokens and the TTFT its kvtier loads saved (kvtier.connectors.ttft):
        the step's forward time, less the load copies, fits the prefill rate."""
        step, self._step = self._step, None
        if step is None or not step[1] or self.store is None:
            return
        started, prompt_tokens, loaded_tokens, load_s = step
        self.prefill_rate.observe(int(prompt_tokens), time.perf_counter() - started - load_s)
        saved, lost = self.prefill_rate.saving(int(loaded_tokens), load_s)
        self.store.record_computed_tokens(int(prompt_tokens), ttft_saved_s=saved, ttft_lost_s=lost)

    # -- lifecycle -----------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> None:
        """Release matches of requests that finished (aborted while waiting, for example)."""
        self._poll()
        for req_id in finished_req_ids:
            self._drop(req_id)

    def stats(self) -> dict[str, Any]:
        """Counters of this worker and its store (JSON-friendly)."""
        counters = asdict(self.counters)
        counters["loaded_tokens"] = dict(self.counters.loaded_tokens)
        out: dict[str, Any] = {"connector": counters, "tp_rank": self.tp_rank}
        if self.store is not None:
            stats = self.store.stats
            out["store"] = {
                f.name: ({str(k): n for k, n in value.items()} if isinstance(value, Counter) else value)
                for f in fields(stats) for value in [getattr(stats, f.name)]
            }
            out["usage"] = self.store.usage()
        return out

    def flush(self) -> None:
        """Write every block held only in memory to DISK and fsync (wait for write-through)."""
        self._poll(wait=True)
        if self.store is not None:
            self.store.flush()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
        for ticket in tickets:
            ticket.release()
        self._poll(wait=True)
        if self.store is not None:
            logger.info("kvtier: worker shutting down: %s", self.stats()["connector"])
            self.store.close()
            self.store = None


def _release_all(leases: list[Lease]) -> None:
    for lease in leases:
        lease.release()
