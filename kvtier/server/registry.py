"""The daemon's namespaces: one :class:`~kvtier.store.TieredStore` per registered namespace
(each model has its own block shape and dtype), each in its own directory::

    <data_dir>/serve.lock                 one daemon per data directory (flock)
    <data_dir>/<namespace hex>/spec.msgpack   {"block_shape", "dtype"}, written before the store
    <data_dir>/<namespace hex>/disk/          the namespace's DISK tier (LMDB)

On start the registry reopens every namespace directory with a spec file, so blocks on DISK
hit again after a restart. Store calls block (locks, LMDB I/O): the registry runs them on
its own thread pool; handlers ``await registry.run(fn, ...)``.

A namespace in use is never closed under a call: :meth:`Registry.use` counts calls in
flight, and :meth:`Registry.delete` waits for them before closing the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from kvtier.checks import check_namespace, namespace_hex, parse_namespace
from kvtier.server.settings import ServeConfig
from kvtier.store import TieredStore
from kvtier.types import KVSpec
from kvtier.wire import describe, pack_spec, unpack_spec

logger = logging.getLogger(__name__)

SPEC_FILE = "spec.msgpack"
_STAGING_BYTES = 8 << 20
"""Per-buffer size of the put path's staging (blocks are verified there, then stored in one
store call per buffer while the next buffer fills)."""


class UnknownNamespace(LookupError):
    """No namespace of that name is registered (HTTP 404)."""


class RegistryError(Exception):
    """A registration that cannot be done; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Namespace:
    """One registered namespace and its store."""

    namespace: bytes
    spec: KVSpec
    store: TieredStore
    path: Path
    in_flight: int = 0
    rejected_blocks: int = 0
    """Put frames whose checksum failed (corrupted on the way); never stored."""
    closing: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    staging_blocks: int = 1
    """Blocks per staging buffer of the put path (~8 MiB, at most a batch)."""
    _staging: list[torch.Tensor] = field(default_factory=list)

    def take_staging(self) -> torch.Tensor:
        """A host buffer ``[staging_blocks, *spec.block_shape]`` (reused across puts)."""
        if self._staging:
            return self._staging.pop()
        return torch.empty((self.staging_blocks, *self.spec.block_shape), dtype=self.spec.dtype)

    def give_staging(self, buffer: torch.Tensor) -> None:
        if len(self._staging) < 4:
            self._staging.append(buffer)


class Registry:
    """Namespaces of one daemon. Create it with the settings; :meth:`open` (at start-up,
    in the app's cleanup context) locks the data directory, starts the thread pool and
    reopens the namespaces found there; :meth:`close` closes every store (flushing memory
    tiers to DISK when ``flush_on_close``).

    ``on_open`` callbacks run (in the event loop) for every namespace opened, with its
    :class:`Namespace`; ``on_close`` before its store is closed (metrics use them)."""

    def __init__(self, settings: ServeConfig) -> None:
        self.settings = settings
        self.data_dir = Path(settings.store.data_dir)
        self.namespaces: dict[bytes, Namespace] = {}
        self.on_open: list[Callable[[Namespace], None]] = []
        self.on_close: list[Callable[[Namespace], None]] = []
        self.cuda = torch.cuda.is_available()
        self._executor: ThreadPoolExecutor | None = None
        self._lock_file = None
        self._changes = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    async def open(self) -> None:
        """Raises ``RuntimeError`` if another daemon holds the data directory."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock(self.data_dir / "serve.lock")
        self._executor = ThreadPoolExecutor(self.settings.num_threads, thread_name_prefix="kvtier-serve")
        for path in sorted(self.data_dir.iterdir()):
            spec = _read_spec(path)
            if spec is None:
                continue
            namespace = parse_namespace(path.name)
            if len(self.namespaces) >= self.settings.max_namespaces:
                logger.warning("not reopening namespace %s: --max-namespaces %d reached", path.name,
                               self.settings.max_namespaces)
                continue
            try:
                self._add(Namespace(namespace, spec, await self.run(self._open_store, namespace, spec, path), path))
            except (ValueError, RuntimeError, OSError) as exc:
                logger.warning("not reopening namespace %s: %s", path.name, exc)

    async def close(self) -> None:
        for entry in list(self.namespaces.values()):
            await self._close(entry)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    async def run(self, fn: Callable, *args):
        """``fn(*args)`` on the registry's thread pool."""
        assert self._executor is not None, "registry is not open"
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))

    # -- namespaces --------------------------------------------------------------------------
    def get(self, namespace: bytes) -> Namespace | None:
        entry = self.namespaces.get(namespace)
        return None if entry is None or entry.closing else entry

    def __iter__(self) -> Iterator[Namespace]:
        return iter(list(self.namespaces.values()))

    @contextlib.asynccontextmanager
    async def use(self, namespace: bytes) -> AsyncIterator[Namespace]:
        """The namespace, kept open until the block exits. Raises :class:`UnknownNamespace`."""
        entry = self.get(namespace)
        if entry is None:
            raise UnknownNamespace(namespace.hex())
        entry.in_flight += 1
        entry.idle.clear()
        try:
            yield entry
        finally:
            entry.in_flight -= 1
            if not entry.in_flight:
                entry.idle.set()

    async def register(self, namespace: bytes, spec: KVSpec) -> tuple[Namespace, bool]:
        """``(namespace, created)``; idempotent for the same spec.

        Raises:
            RegistryError: 409 (known with another spec), 507 (``max_namespaces`` reached),
                413 (block over ``max_block_bytes``), 400 (capacities below one block).
        """
        check_namespace(namespace)
        async with self._changes:
            entry = self.get(namespace)
            if entry is not None:
                if entry.spec != spec:
                    raise RegistryError(409, f"namespace registered with another spec: expected {describe(entry.spec)}, "
                                             f"got {describe(spec)}")
                return entry, False
            if spec.block_nbytes > self.settings.max_block_bytes:
                raise RegistryError(413, f"expected blocks of at most {self.settings.max_block_bytes} bytes "
                                         f"(--max-block-bytes), got {spec.block_nbytes}")
            if len(self.namespaces) >= self.settings.max_namespaces:
                raise RegistryError(507, f"expected at most {self.settings.max_namespaces} namespaces "
                                         "(--max-namespaces); delete one first")
            path = self.data_dir / namespace_hex(namespace)  # 64 hex digits: never data_dir itself
            try:
                store = await self.run(self._create_store, namespace, spec, path)
            except ValueError as exc:
                raise RegistryError(400, str(exc)) from None
            return self._add(Namespace(namespace, spec, store, path)), True

    async def delete(self, namespace: bytes) -> bool:
        """Close the namespace's store (after its calls in flight) and delete its blocks."""
        async with self._changes:
            entry = self.get(namespace)
            if entry is None:
                return False
            await self._close(entry)
            await self.run(shutil.rmtree, entry.path, True)
            return True

    def _add(self, entry: Namespace) -> Namespace:
        entry.idle.set()
        entry.staging_blocks = max(1, min(self.settings.max_batch_blocks, _STAGING_BYTES // entry.spec.block_nbytes))
        self.namespaces[entry.namespace] = entry
        for callback in self.on_open:
            callback(entry)
        return entry

    async def _close(self, entry: Namespace) -> None:
        entry.closing = True
        await entry.idle.wait()
        try:
            for callback in self.on_close:
                callback(entry)
            await self.run(entry.store.close)
        except Exception:  # the namespace goes away all the same; its DISK data stays
            logger.exception("closing namespace %s failed", entry.namespace.hex())
        finally:
            self.namespaces.pop(entry.namespace, None)

    def _create_store(self, namespace: bytes, spec: KVSpec, path: Path) -> TieredStore:
        path.mkdir(parents=True, exist_ok=True)
        if _read_spec(path) is None:  # a directory left by a delete that failed halfway
            _write_spec(path, spec)
        try:
            return self._open_store(namespace, spec, path)
        except Exception:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def _open_store(self, namespace: bytes, spec: KVSpec, path: Path) -> TieredStore:
        config = self.settings.store_config(path, spec.block_size, self.cuda)
        return TieredStore(spec, config, namespace, device="cuda" if self.cuda and config.gpu_bytes else "cpu")


def _read_spec(path: Path) -> KVSpec | None:
    """The spec saved in a namespace directory; ``None`` when ``path`` is not one (its name
    is not a namespace's 64 lowercase hex digits, or it has no spec file)."""
    try:
        parse_namespace(path.name)
    except ValueError:
        return None
    if not path.is_dir():
        return None
    try:
        return unpack_spec((path / SPEC_FILE).read_bytes())
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exc:
        logger.warning("ignoring %s: unreadable %s (%s)", path, SPEC_FILE, exc)
        return None


def _write_spec(path: Path, spec: KVSpec) -> None:
    """Atomically (write, fsync, rename): a crash leaves the old file or the new one."""
    tmp = path / (SPEC_FILE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(pack_spec(spec))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / SPEC_FILE)


def _lock(path: Path):
    f = open(path, "a+b")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RuntimeError(f"another kvtier serve uses {path.parent} (it holds {path})") from None
    return f
