"""The daemon's namespaces: one :class:`~kvtier.store.TieredStore` per (tenant, namespace)
(each model has its own block shape and dtype; each tenant its own blocks), each in its own
directory (kvtier.server.layout). On start the registry reopens every namespace directory it
made, so blocks on DISK hit again after a restart. Store calls block (locks, LMDB I/O): they
run on the registry's thread pool (:meth:`Registry.run`).

Calls on a namespace enter :meth:`Registry.use`, which counts them and remembers their tasks
and threads. Deleting or resetting a namespace (:meth:`Registry.delete`, :meth:`Registry.reset`)
takes the registry-wide lock only to change the tables, never while waiting: it cancels the
namespace's calls in flight (a stalled put or a get nobody reads is cut, releasing its pins
and staging buffers), waits for their store threads, then closes the store. A registration of
the same namespace meanwhile waits for that one namespace, no other.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from kvtier.checks import check_namespace
from kvtier.server import layout
from kvtier.server.connections import Budget
from kvtier.server.settings import ServeConfig
from kvtier.server.tenants import DEFAULT_TENANT, Tenant, Tenants
from kvtier.store import TieredStore
from kvtier.types import KVSpec
from kvtier.wire import describe

logger = logging.getLogger(__name__)

Key = tuple[str, bytes]
"""(tenant name, namespace)."""
_STAGING_BYTES = 8 << 20
"""Per-buffer size of the put path's staging (blocks are verified there, then stored in one
store call per buffer while the next buffer fills)."""


class UnknownNamespace(LookupError):
    """No namespace of that name is registered for the tenant (HTTP 404)."""


class RegistryError(Exception):
    """A registration that cannot be done; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Namespace:
    """One registered namespace of one tenant, and its store."""

    tenant: str
    namespace: bytes
    spec: KVSpec
    store: TieredStore
    path: Path
    name: str | None = None
    """Display name given at registration (the token file's, if any, comes first)."""
    label: str = ""
    """Its name in metrics and stats: ``tenant/display name`` or ``tenant/ns-<opaque id>``."""
    rejected_blocks: int = 0
    """Put frames whose checksum failed (corrupted on the way); never stored."""
    closing: bool = False
    calls: set = field(default_factory=set)
    """Tasks of the calls in flight (cancelled when the namespace is deleted or reset)."""
    threads: set = field(default_factory=set)
    """Store calls running on the registry's threads for this namespace."""
    staging_blocks: int = 1
    """Blocks per staging buffer of the put path (~8 MiB, at most a batch)."""
    pins: Budget | None = None
    """Blocks of the top pool that gets in flight may pin together (``max_pinned_fraction``)."""
    _staging: list[torch.Tensor] = field(default_factory=list)

    @property
    def in_flight(self) -> int:
        return len(self.calls)

    def take_staging(self, num_blocks: int | None = None) -> torch.Tensor:
        """A host buffer ``[n, *spec.block_shape]``, ``n = min(num_blocks, staging_blocks)``
        (full-size buffers are reused across puts)."""
        n = self.staging_blocks if num_blocks is None else max(1, min(num_blocks, self.staging_blocks))
        if n == self.staging_blocks and self._staging:
            return self._staging.pop()
        return torch.empty((n, *self.spec.block_shape), dtype=self.spec.dtype)

    def give_staging(self, buffer: torch.Tensor) -> None:
        if buffer.shape[0] == self.staging_blocks and len(self._staging) < 4:
            self._staging.append(buffer)


class Registry:
    """Namespaces of one daemon. :meth:`open` (at start-up, in the app's cleanup context)
    prepares and locks the data directory, starts the thread pool and reopens the namespaces
    found there; :meth:`close` closes every store (flushing memory tiers to DISK when
    ``flush_on_close``)."""

    def __init__(self, settings: ServeConfig, tenants: Tenants | None = None) -> None:
        self.settings = settings
        self.tenants = tenants or settings.tenants()
        self.data_dir = Path(settings.store.data_dir)
        self.namespaces: dict[Key, Namespace] = {}
        self.on_open: list[Callable[[Namespace], None]] = []
        self.on_close: list[Callable[[Namespace], None]] = []
        self.cuda = torch.cuda.is_available()
        self._executor: ThreadPoolExecutor | None = None
        self._lock_fd: int | None = None
        self._secret = b""
        self._changes = asyncio.Lock()
        self._busy: dict[Key, asyncio.Future] = {}  # registrations, deletions, resets under way

    # -- lifecycle ---------------------------------------------------------------------------
    async def open(self) -> None:
        """Raises ``RuntimeError`` if another daemon holds the data directory or it belongs
        to another user."""
        self.data_dir = layout.prepare_data_dir(self.data_dir)
        self._lock_fd = layout.lock(self.data_dir)
        self._secret = layout.secret(self.data_dir)
        self._executor = ThreadPoolExecutor(self.settings.num_threads, thread_name_prefix="kvtier-serve")
        if DEFAULT_TENANT in self.tenants.tenants:
            if moved := layout.migrate_legacy(self.data_dir, DEFAULT_TENANT):
                logger.info("moved %d namespace directories to %s/%s", moved, layout.TENANTS_DIR, DEFAULT_TENANT)
        for tenant, namespace, path, spec, name in layout.find_namespaces(self.data_dir):
            owner = self.tenants.tenants.get(tenant)
            if owner is None or not owner.allows(namespace):
                logger.warning("not reopening %s: tenant %s may not use it (token file)", path, tenant)
                continue
            if self._count() >= self.settings.max_namespaces:
                logger.warning("not reopening %s: --max-namespaces %d reached", path, self.settings.max_namespaces)
                continue
            try:
                store = await self.run(self._open_store, namespace, spec, path)
            except (ValueError, RuntimeError, OSError) as exc:
                logger.warning("not reopening %s: %s", path, exc)
                continue
            self._add(Namespace(tenant, namespace, spec, store, path, name))

    async def close(self) -> None:
        for entry in list(self.namespaces.values()):
            await self._retire(entry, flush=True)
            self.namespaces.pop((entry.tenant, entry.namespace), None)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def run(self, fn: Callable, *args):
        """``fn(*args)`` on the registry's thread pool."""
        assert self._executor is not None, "registry is not open"
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))

    async def run_on(self, entry: Namespace, fn: Callable, *args):
        """``fn(*args)`` on the thread pool, counted as a call of ``entry`` until it returns
        (a deletion waits for it before closing the store)."""
        assert self._executor is not None, "registry is not open"
        future: Future = self._executor.submit(fn, *args)
        entry.threads.add(future)
        future.add_done_callback(entry.threads.discard)
        return await asyncio.wrap_future(future)

    # -- namespaces --------------------------------------------------------------------------
    def get(self, tenant: str, namespace: bytes) -> Namespace | None:
        entry = self.namespaces.get((tenant, namespace))
        return None if entry is None or entry.closing else entry

    def __iter__(self) -> Iterator[Namespace]:
        return iter([e for e in list(self.namespaces.values()) if not e.closing])

    def of(self, tenant: str) -> list[Namespace]:
        return [e for e in self if e.tenant == tenant]

    def use(self, tenant: str, namespace: bytes) -> "_Use":
        """``async with registry.use(tenant, namespace) as entry``: the namespace, kept open
        until the block exits (its task is cut if the namespace is deleted or reset
        meanwhile). Raises :class:`UnknownNamespace` on entry."""
        return _Use(self, tenant, namespace)

    async def register(self, tenant: Tenant, namespace: bytes, spec: KVSpec,
                       name: str | None = None) -> tuple[Namespace, bool]:
        """``(namespace, created)``; idempotent for the same spec.

        Raises:
            RegistryError: 409 (known with another spec, or its directory holds something the
                daemon did not make), 507 (``max_namespaces`` reached,
                the daemon's or the tenant's), 413 (block over ``max_block_bytes``), 400
                (capacities below one block).
        """
        check_namespace(namespace)
        key = (tenant.name, namespace)
        while True:
            async with self._changes:
                entry = self.get(*key)
                if entry is not None:
                    if entry.spec != spec:
                        raise RegistryError(409, f"namespace registered with another spec: expected "
                                                 f"{describe(entry.spec)}, got {describe(spec)}")
                    return entry, False
                busy = self._busy.get(key)
                if busy is None:
                    self._check_room(tenant, spec)
                    busy = self._busy[key] = asyncio.get_running_loop().create_future()
                    break
            await asyncio.shield(busy)  # another call registers, deletes or resets it: wait, then look again
        # shielded: a registration whose caller is cut still ends with its store added (or closed)
        return await asyncio.shield(self._create(tenant, namespace, spec, name, busy)), True

    async def _create(self, tenant: Tenant, namespace: bytes, spec: KVSpec, name: str | None,
                      busy: asyncio.Future) -> Namespace:
        key = (tenant.name, namespace)
        try:
            path = layout.namespace_dir(self.data_dir, tenant.name, namespace)
            store = await self.run(self._create_store, tenant.name, namespace, spec, name)
            return self._add(Namespace(tenant.name, namespace, spec, store, path, name))
        except ValueError as exc:
            raise RegistryError(400, str(exc)) from None
        except RuntimeError as exc:  # a directory there that the daemon did not make
            raise RegistryError(409, str(exc)) from None
        finally:
            self._busy.pop(key, None)
            busy.set_result(None)

    def _check_room(self, tenant: Tenant, spec: KVSpec) -> None:
        if spec.block_nbytes > self.settings.max_block_bytes:
            raise RegistryError(413, f"expected blocks of at most {self.settings.max_block_bytes} bytes "
                                     f"(--max-block-bytes), got {spec.block_nbytes}")
        if self._count() >= self.settings.max_namespaces:
            raise RegistryError(507, f"expected at most {self.settings.max_namespaces} namespaces "
                                     "(--max-namespaces); an admin may delete one")
        if tenant.max_namespaces is not None and len(self.of(tenant.name)) >= tenant.max_namespaces:
            raise RegistryError(507, f"expected at most {tenant.max_namespaces} namespaces for tenant "
                                     f"{tenant.name} (token file)")

    def _count(self) -> int:
        """Namespaces holding memory: open, being created, being closed."""
        return len(self.namespaces) + sum(1 for k in self._busy if k not in self.namespaces)

    async def delete(self, tenant: str, namespace: bytes) -> bool:
        """Cut the namespace's calls in flight, close its store, delete its directory. Runs
        to the end even if the call that asked is cut (shielded)."""
        return await asyncio.shield(self._change(tenant, namespace, remove=True))

    async def reset(self, tenant: str, namespace: bytes) -> int | None:
        """Empty the namespace (every tier, DISK included) and keep it registered: its calls
        in flight are cut, its store is closed without a flush, its DISK tier deleted, and a
        new store opened in its place (shielded, like :meth:`delete`). Returns the distinct
        blocks it held when the reset began, ``None`` when there is no such namespace."""
        return await asyncio.shield(self._change(tenant, namespace, remove=False))

    async def _change(self, tenant: str, namespace: bytes, remove: bool) -> bool | int | None:
        key = (tenant, namespace)
        while True:
            async with self._changes:
                entry = self.get(*key)
                busy = self._busy.get(key)
                if busy is None:
                    if entry is None:
                        return False if remove else None
                    entry.closing = True
                    busy = self._busy[key] = asyncio.get_running_loop().create_future()
                    break
            await asyncio.shield(busy)
        try:
            held = 0 if remove else await self.run(_held_blocks, entry.store)
            await self._retire(entry, flush=False)
            if remove:
                await self.run(layout.remove_namespace_dir, self.data_dir, tenant, namespace)
                self.namespaces.pop(key, None)
                return True
            self.namespaces.pop(key, None)
            await self.run(layout.wipe_blocks, self.data_dir, tenant, namespace)
            store = await self.run(self._create_store, tenant, namespace, entry.spec, entry.name)
            self._add(Namespace(tenant, namespace, entry.spec, store, entry.path, entry.name))
            return held
        finally:
            self._busy.pop(key, None)
            busy.set_result(None)

    def _add(self, entry: Namespace) -> Namespace:
        entry.staging_blocks = max(1, min(self.settings.max_batch_blocks, _STAGING_BYTES // entry.spec.block_nbytes))
        entry.pins = Budget(max(1, int(entry.store.top.num_blocks * self.settings.max_pinned_fraction)))
        entry.label = self._label(entry.tenant, entry.namespace, entry.name)
        self.namespaces[(entry.tenant, entry.namespace)] = entry
        for callback in self.on_open:
            callback(entry)
        return entry

    def _label(self, tenant: str, namespace: bytes, name: str | None) -> str:
        """``tenant/display name`` (token file first, then the registration's), unique within
        the tenant; else ``tenant/ns-<12 hex digits of HMAC(secret, tenant, namespace)>``."""
        owner = self.tenants.tenants.get(tenant)
        name = (owner.names.get(namespace) if owner else None) or name
        opaque = hmac.new(self._secret, tenant.encode() + b"\0" + namespace, hashlib.sha256).hexdigest()[:12]
        taken = {e.label for e in self.namespaces.values() if (e.tenant, e.namespace) != (tenant, namespace)}
        if name and f"{tenant}/{name}" not in taken:
            return f"{tenant}/{name}"
        return f"{tenant}/ns-{opaque}"

    async def _retire(self, entry: Namespace, flush: bool) -> None:
        """Cut the calls in flight, wait for their store threads, close the store."""
        entry.closing = True
        current = asyncio.current_task()
        for task in list(entry.calls):
            if task is not current:
                task.cancel()
        while entry.threads:
            await asyncio.wait([asyncio.wrap_future(f) for f in list(entry.threads)])
        try:
            for callback in self.on_close:
                callback(entry)
            await self.run(_close_store, entry.store, flush)
        except Exception:  # the namespace goes away all the same; its DISK data stays
            logger.exception("closing namespace %s failed", entry.label)

    def _create_store(self, tenant: str, namespace: bytes, spec: KVSpec, name: str | None = None) -> TieredStore:
        path = layout.create_namespace_dir(self.data_dir, tenant, namespace, spec, name)
        try:
            return self._open_store(namespace, spec, path)
        except Exception:
            layout.remove_namespace_dir(self.data_dir, tenant, namespace)  # only ever the one it made
            raise

    def _open_store(self, namespace: bytes, spec: KVSpec, path: Path) -> TieredStore:
        config = self.settings.store_config(path, spec.block_size, self.cuda)
        store = TieredStore(spec, config, namespace, device="cuda" if self.cuda and config.gpu_bytes else "cpu")
        layout.tighten(path)
        return store


class _Use:
    """:meth:`Registry.use` (a plain class: every lookup enters one, and a generator-based
    context manager costs several times more)."""

    __slots__ = ("registry", "tenant", "namespace", "entry", "task")

    def __init__(self, registry: Registry, tenant: str, namespace: bytes) -> None:
        self.registry, self.tenant, self.namespace = registry, tenant, namespace

    async def __aenter__(self) -> Namespace:
        entry = self.registry.get(self.tenant, self.namespace)
        if entry is None:
            raise UnknownNamespace(self.namespace.hex())
        self.entry, self.task = entry, asyncio.current_task()
        entry.calls.add(self.task)
        return entry

    async def __aexit__(self, *exc_info) -> None:
        self.entry.calls.discard(self.task)


def _close_store(store: TieredStore, flush: bool) -> None:
    """Close ``store``; without ``flush``, memory blocks are dropped, not written to DISK
    (a namespace being deleted or emptied)."""
    if not flush and store.config.flush_on_close:
        store.config = replace(store.config, flush_on_close=False)
    store.close()


def _held_blocks(store: TieredStore) -> int:
    """Distinct blocks ``store`` holds in any tier (a reset's reply)."""
    with store.residency.lock:
        held = {h for pool in store.pools for h in pool.lru_order()}
        if store.disk is not None:
            held.update(store.disk.lru_order())
    return len(held)
