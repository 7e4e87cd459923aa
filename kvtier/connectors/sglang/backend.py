"""``KVTierStorage``: kvtier as an SGLang HiCache L3 storage backend (``HiCacheStorage``).

SGLang's HiCache keeps a radix tree over GPU memory (L1) and a pinned host pool (L2) and
hands pages to an L3 backend from its cache controller's threads
(sglang/srt/managers/cache_controller.py): the prefetch thread asks ``batch_exists`` for the
longest stored prefix of a request's page keys, an I/O thread reads the hits into host pool
slots, the backup thread writes pages the host pool holds. With ``"interface_v1": 1`` in the
extra config the controller calls the zero-copy variants, ``batch_get_v1`` /
``batch_set_v1`` with host-pool token indices: pages move between kvtier's CPU pool and
SGLang's ``kv_buffer`` with one strided copy each, no SGLang-side staging page; without it,
the generic ``batch_get`` / ``batch_set`` with flat page tensors. Both are implemented.

Under it: a :class:`~kvtier.store.TieredStore` per backend (CPU pool + DISK, plus the shared
REMOTE tier when ``remote_url`` is set), built when SGLang registers its host pool (the page
layout fixes the block spec and the namespace). DISK lives under
``<data_dir>/sglang/<namespace>-dp<rank>-tp<rank>/`` (one process per directory; processes
and machines share through REMOTE). Every read is a verified kvtier record (namespace,
shape, dtype, xxh3 checksum): a corrupt or missing page is a miss. No call raises into
SGLang's threads: an error is logged, counted in ``errors`` and answered as a miss
(``0`` / ``False`` / ``None``).

Refused when the host pool is registered (SGLang then fails the attach with the message):
host layouts other than those in :mod:`kvtier.connectors.sglang.layout`, extra pools of hybrid
models (Mamba, SWA, DSA indexer, DeepSeek V4 compressed state: ``register_mem_host_pool_v2``),
decode context parallel, split heads (``tp_lcm_size``), and an MLA model on several TP ranks
without a REMOTE tier (SGLang writes MLA pages from one rank; the others could never read
them from their own DISK).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolName

from kvtier.connectors.sglang.keys import block_hashes, block_keys, namespace_context
from kvtier.connectors.sglang.layout import PageLayout, page_layout_for
from kvtier.connectors.sglang.options import BackendOptions
from kvtier.store import TieredStore

logger = logging.getLogger(__name__)


def _miss_on_error(miss: Callable[..., Any]):
    """Run a storage call; on any exception log it, count it and return ``miss(*args)``: an
    exception must never reach SGLang's prefetch and backup threads."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                self.errors[method.__name__] += 1
                logger.warning("kvtier HiCache %s failed, answered as a miss: %r", method.__name__, exc)
                return miss(*args, **kwargs)

        return wrapper

    return decorate


def _all_false(keys, *_, **__) -> List[bool]:
    return [False] * len(keys)


class KVTierStorage(HiCacheStorage):
    """A HiCache L3 backend over kvtier's CPU, DISK and REMOTE tiers.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; ``extra_config`` is the parsed
            ``--hicache-storage-backend-extra-config`` (:mod:`kvtier.connectors.sglang.options`).
        kwargs: what SGLang's factory passes a dynamic backend besides the config (unused).

    Raises:
        ValueError: bad options, decode context parallel, split heads, an MLA model on
            several TP ranks without ``remote_url``, or no model name.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        self.storage_config = storage_config
        self.options = BackendOptions.from_extra_config(storage_config.extra_config)
        self.model_id = self.options.model_id or storage_config.model_name
        if not self.model_id:
            raise ValueError("expected a model name (SGLang's served model name, or the model_id option), got none")
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise ValueError("kvtier's SGLang backend does not serve decode context parallel (--dcp-size > 1)")
        if storage_config.should_split_heads:
            raise ValueError("kvtier's SGLang backend does not serve split heads (tp_lcm_size > tp_size)")
        if storage_config.is_mla_model and storage_config.tp_size > 1 and self.options.store.remote_url is None:
            raise ValueError(
                "an MLA model on several TP ranks needs a shared REMOTE tier (remote_url): SGLang writes "
                "MLA pages from one rank and every rank reads them"
            )
        self.errors: Counter = Counter()
        self.layout: PageLayout | None = None
        self.namespace: bytes | None = None
        self.data_dir: Path | None = None
        self._store: TieredStore | None = None
        self._store_lock = threading.Lock()  # guards building, clearing and closing the store

    # -- registration ------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind SGLang's host KV pool and open the store for its page layout.

        Raises:
            ValueError: a host pool this backend cannot serve exactly (see the module doc).
        """
        super().register_mem_pool_host(mem_pool_host)
        layout = page_layout_for(mem_pool_host, self.storage_config.is_mla_model)
        o, c = self.options, self.storage_config
        context = namespace_context(c, layout, self.model_id, o.model_revision, o.cache_salt)
        namespace = context.namespace()
        data_dir = Path(o.store.data_dir) / "sglang" / f"{namespace.hex()[:24]}-dp{c.dp_rank}-tp{c.tp_rank}"
        config = o.store.with_(block_size=layout.page_size, data_dir=data_dir)
        with self._store_lock:
            if self._store is not None:
                self._store.close()
            self._store = TieredStore(layout.spec, config, namespace, device="cpu")
            self.layout, self.namespace, self.data_dir = layout, namespace, data_dir
        logger.info(
            "kvtier HiCache backend: %s %s pages of %d tokens, %d bytes each; DISK %s; REMOTE %s",
            layout.kind, layout.host_layout, layout.page_size, layout.spec.block_nbytes, data_dir,
            o.store.remote_url or "none",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid models register their extra pools here: only the KV pool is served.

        Raises:
            ValueError: any pool other than the KV pool already registered.
        """
        if str(host_pool_name) == PoolName.KV.value and host_pool is getattr(self, "mem_pool_host", None):
            return super().register_mem_host_pool_v2(host_pool, host_pool_name)
        raise ValueError(
            f"kvtier's SGLang backend serves the KV pool only; this model also has a {str(host_pool_name)!r} "
            "host pool (hybrid attention or state models are not served)"
        )

    @property
    def store(self) -> TieredStore:
        """The store; ``RuntimeError`` before SGLang registered its host pool."""
        store = self._store
        if store is None:
            raise RuntimeError("no host pool registered yet")
        return store

    # -- existence ---------------------------------------------------------------------------
    @_miss_on_error(lambda *a, **k: 0)
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """Leading pages of ``keys`` stored in any tier (REMOTE asked once, for the rest)."""
        if not keys:
            return 0
        return self.store.lookup(block_hashes(self.namespace, keys)).num_hit_blocks

    @_miss_on_error(lambda *a, **k: False)
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy path (host pool indices) --------------------------------------------------
    @_miss_on_error(_all_false)
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Read pages ``keys`` into the host pool at ``host_indices``.

        Args:
            keys: page keys, in request order.
            host_indices: ``[len(keys) * page_size]`` int64 host-pool token slots, page-aligned.

        Returns:
            per key, whether its page now sits in the host pool: a leading run of ``True``
            (a missing, corrupt or unreadable page ends it).
        """
        starts = self._page_starts(keys, host_indices)
        kv = self.mem_pool_host.kv_buffer
        return self._read(keys, lambda i: self.layout.page(kv, starts[i]))

    @_miss_on_error(_all_false)
    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Write the host pool's pages at ``host_indices`` under ``keys`` (shapes as in
        :meth:`batch_get_v1`). Returns per key whether it is stored: a leading run of ``True``."""
        starts = self._page_starts(keys, host_indices)
        kv = self.mem_pool_host.kv_buffer
        stored = self._write(keys, lambda i: self.layout.page(kv, starts[i]))
        return [True] * stored + [False] * (len(keys) - stored)

    # -- generic path (flat page tensors) ----------------------------------------------------
    @_miss_on_error(lambda keys, *a, **k: [None] * len(keys))
    def batch_get(
        self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> List[torch.Tensor | None]:
        """Read pages into flat page tensors (host order, as ``get_dummy_flat_data_page``);
        ``None`` for a page not read (and for every page after it)."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"expected {len(keys)} target locations, got {len(targets)}")
        layout = self._registered_layout()
        targets = [t if t is not None else torch.empty(layout.spec.block_numel, dtype=layout.dtype) for t in targets]
        views = [layout.flat_page(t) for t in targets]  # ValueError for a bad target, before any read
        ok = self._read(keys, views.__getitem__)
        return [t if hit else None for t, hit in zip(targets, ok)]

    @_miss_on_error(lambda *a, **k: False)
    def batch_set(
        self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Write flat pages (host order, as ``get_data_page(i, flat=True)``); True when all are stored."""
        values = list(values or [])
        if len(values) != len(keys):
            raise ValueError(f"expected {len(keys)} values, got {len(values)}")
        layout = self._registered_layout()
        views = [layout.flat_page(v) for v in values]
        return self._write(keys, views.__getitem__) == len(keys)

    @_miss_on_error(lambda *a, **k: None)
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location])[0]

    @_miss_on_error(lambda *a, **k: False)
    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # -- lifecycle ---------------------------------------------------------------------------
    def clear(self) -> bool:
        """Drop every page this backend stored locally (memory pools and DISK:
        ``TieredStore.reset``, so reads and writes in flight on other threads publish
        nothing and the store stays open); pages on the shared REMOTE tier stay (other
        engines own them too). Returns success."""
        with self._store_lock:
            if self._store is None:
                return False
            try:
                self._store.reset(remote=False)
                return True
            except Exception as exc:
                self.errors["clear"] += 1
                logger.warning("kvtier HiCache clear failed: %r", exc)
                return False

    def close(self) -> None:
        """Flush memory-only pages to DISK and close the store (idempotent)."""
        with self._store_lock:
            if self._store is not None:
                self._store.close()

    def get_stats(self):
        """SGLang's storage metrics object is backend-specific; kvtier's counters are in
        ``self.store.stats`` and ``self.errors``."""
        return None

    # -- internals ---------------------------------------------------------------------------
    def _registered_layout(self) -> PageLayout:
        layout = self.layout
        if layout is None:
            raise RuntimeError("no host pool registered yet")
        return layout

    def _page_starts(self, keys: List[str], host_indices: torch.Tensor) -> list[int]:
        page_size = self._registered_layout().page_size
        if host_indices is None or host_indices.numel() != len(keys) * page_size:
            got = None if host_indices is None else host_indices.numel()
            raise ValueError(f"expected {len(keys) * page_size} host indices for {len(keys)} pages, got {got}")
        starts = host_indices.reshape(-1)[::page_size].tolist()
        if any(s % page_size for s in starts):
            raise ValueError(f"expected page-aligned host indices (multiples of {page_size}), got starts {starts}")
        return starts

    def _read(self, keys: List[str], dest: Callable[[int], torch.Tensor]) -> List[bool]:
        """Load pages and copy each into ``dest(i)`` (a canonical page view); stops at the
        first page that is not read. Pages go through the CPU pool in chunks of a quarter of
        it, two in flight: the I/O threads read chunk k+1 from DISK/REMOTE while this thread
        copies chunk k out (half the pool stays free for the backup thread's stores)."""
        store = self.store
        hashes, fps = block_keys(self.namespace, keys)
        chunk = max(1, store.top.num_blocks // 4)
        starts = list(range(0, len(hashes), chunk))
        pending = store.prefetch(hashes[:chunk], fingerprints=fps[:chunk]) if starts else None
        done = 0
        for n, start in enumerate(starts):
            want = min(chunk, len(hashes) - start)
            result = pending.wait()
            pending = None
            try:
                if len(result.block_ids) == want and n + 1 < len(starts):
                    pending = store.prefetch(
                        hashes[start + chunk : start + 2 * chunk], fingerprints=fps[start + chunk : start + 2 * chunk]
                    )
                top = store.top.tensor
                for i, block_id in enumerate(result.block_ids):
                    dest(start + i).copy_(self.layout.block(top[block_id]))
            finally:
                result.lease.release()
            done += len(result.block_ids)
            if pending is None:
                break
        return [True] * done + [False] * (len(keys) - done)

    def _write(self, keys: List[str], src: Callable[[int], torch.Tensor]) -> int:
        """Store pages (``src(i)``: canonical page view) in chunks of half the CPU pool;
        returns the leading count stored.

        Each chunk is copied into the pool while the previous chunk's DISK (and REMOTE) write
        runs on the I/O threads; the chunk is published (``complete_store``, which sizes the
        DISK evictions its own write needs and submits it) only once that write is done. The
        store sizes those evictions from the DISK usage it sees, which does not yet count a
        write still in flight: two in flight at a full DISK made the second one fail as
        "full" (a page acknowledged to SGLang, then lost when the CPU pool evicted it).
        """
        store = self.store
        hashes, fps = block_keys(self.namespace, keys)
        chunk = max(1, store.top.num_blocks // 2)
        stored = 0
        for start in range(0, len(hashes), chunk):
            handle = store.prepare_store(hashes[start : start + chunk], fps[start : start + chunk])
            ok = False
            try:
                top = store.top.tensor
                for i, block_id in zip(handle.indices, handle.block_ids):
                    self.layout.block(top[block_id]).copy_(src(start + i))
                ok = True
            finally:
                store.wait_for_writes()
                store.complete_store(handle, success=ok)
            stored = start + handle.num_blocks
            if stored < min(start + chunk, len(hashes)):
                break
        return stored
