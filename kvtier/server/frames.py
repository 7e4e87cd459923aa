"""Block streams of the daemon: ``get`` writes frames from the store's pool, ``put`` reads and
verifies frames into staging buffers and stores them (format: kvtier.wire).

get: the blocks are loaded (``store.load``: pinned in the top pool, DISK blocks read up) a
chunk at a time on the registry's threads; each block's header is computed there from the
slot (one hashing pass, no copy), with the token fingerprint the block was stored with, and
the slot's own memory is handed to the transport: a chunk of blocks per write on uvloop (one
HTTP chunk: :func:`kvtier.server.streams.write_frames`), block by block on asyncio's loop.
The daemon checks no fingerprint for the
client: it is a relay, and the client checks every block against its own tokens (it could
not trust a daemon's word that it did). The
lease is released only once the socket has taken every byte of the chunk (a transport may
keep a reference to the memory it was given until it is sent), while the next chunk is
already being loaded. Pins come from the namespace's budget and writes run on a clock
(kvtier.server.connections): a client that does not read is cut off and its pins freed.

put: each frame is checked before its payload is read (hash size, a consistent header, the
namespace, the registered shape and dtype, ``--max-block-bytes``: a block over the limit is
refused with 413 after its 128-byte header, chunked bodies too, case S1), then its payload
is copied, piece by piece as it arrives, straight into a top-pool slot reserved for that one
block (:class:`_Direct`: invisible to lookups until its checksum holds) and hashed as it is
copied; a block whose checksum fails is not stored (``stored[i] = False``) and its slot is
freed. A frame that gets no fresh slot (the block is stored already, another request is
writing it, every slot is pinned), and every frame of a store with a tier below its top
pool (DISK: its spills go in batches) or a top pool on CUDA, is copied into a staging
buffer instead; a full staging buffer is stored with one store call on a
thread while the next buffer fills. A put is acknowledged (``True``) only once the block is
in the store; with ``--durable`` only once it is committed to DISK. Each block is stored
with the fingerprint of its record header (what a later get sends). Staging comes from the
daemon's budget, reads run on a clock: a body that trickles is cut off and its slot or
buffers freed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from aiohttp import web

from kvtier.checks import BLOCK_HASH_NBYTES
from kvtier.records import HEADER_NBYTES, encode_header, parse_header
from kvtier.server.connections import BodyClock, Budget, Expired, own_deadline, reset
from kvtier.server.errors import LOG, error
from kvtier.server.streams import FrameReader, holds_buffers, sent, write_frames
from kvtier.types import DTYPE_NAMES, BlockHash
from kvtier.wire import END, FRAMES, block_bytes, frame_nbytes, frame_prefix, max_frames_nbytes

if TYPE_CHECKING:
    from kvtier.server.registry import Namespace, Registry
    from kvtier.server.settings import ServeConfig
    from kvtier.store import LoadResult, TieredStore

logger = logging.getLogger(__name__)

_LOAD_CHUNK_BYTES = 32 << 20
"""Blocks loaded and pinned per step of a get (two steps are in flight at once)."""
_PIN_WAIT_S = 0.2
"""Longest a get waits for pins when gets in flight hold the namespace's budget (then it
sends the blocks it could pin: a shorter hit)."""


# -- get ---------------------------------------------------------------------------------------
async def send_blocks(
    request: web.Request, registry: "Registry", entry: "Namespace", block_hashes: Sequence[BlockHash]
) -> web.StreamResponse:
    """Stream the leading present blocks of ``block_hashes``, then the end byte. Pins come
    from the namespace's budget (a get that finds none free ends its stream early: a shorter
    hit); writes are bounded by a :class:`BodyClock` (a client that does not read is cut off
    and its pins released)."""
    settings = registry.settings
    own_deadline(request)
    pins: Budget = entry.pins
    chunk = max(1, min(pins.capacity // 4, _LOAD_CHUNK_BYTES // entry.spec.block_nbytes))
    clock = BodyClock(settings.grace_s, settings.min_rate_bytes_per_s)
    response = web.StreamResponse(headers={"Content-Type": FRAMES})
    loads = _Loads(registry, entry, pins)
    try:
        await loads.next(block_hashes[:chunk])
        await clock.write(response.prepare(request), 0)
        await clock.write(response.write(b""), 0)  # the headers go out (aiohttp >= 3.10 holds them back)
        offset = 0
        while loads.ahead is not None:
            part, (loaded, blocks) = await loads.take()
            offset += len(part)
            try:
                if len(blocks) == len(part) and offset < len(block_hashes):
                    await loads.next(block_hashes[offset : offset + chunk])
                await _send(request.transport, response, clock, part, blocks)
            finally:
                loads.release(loaded)
            if len(blocks) < len(part):
                break
        await clock.write(response.write(END), 1)
        await clock.write(response.write_eof(), 0)
    except ConnectionResetError:
        logger.debug("get: client went away mid-stream")
    except Expired as exc:
        logger.debug("get: %s", exc)
        reset(request.transport)
    finally:
        await loads.close()
    if not response.prepared:
        raise error(web.HTTPServiceUnavailable, "get: the response could not start")
    return response


async def _send(transport, response: web.StreamResponse, clock: BodyClock, part: Sequence[BlockHash],
                blocks: list) -> None:
    """The frames of one loaded chunk out, until the kernel has every byte (then its lease
    may go): one write of the slots' memory on uvloop, block by block through aiohttp else
    (kvtier.server.streams.holds_buffers)."""
    if holds_buffers(transport):
        nbytes = write_frames(transport, part, blocks)
        await clock.write(sent(transport), nbytes)
        return
    for h, (header, payload) in zip(part, blocks):
        await clock.write(response.write(frame_prefix(h) + header), len(header))
        await clock.write(response.write(payload), len(payload))
    await clock.write(sent(transport), 0)


class _Loads:
    """The chunk loaded ahead of the one being sent, with its pins taken from the budget."""

    def __init__(self, registry: "Registry", entry: "Namespace", pins: Budget) -> None:
        self.registry, self.entry, self.pins = registry, entry, pins
        self.ahead: tuple[Sequence[BlockHash], int, asyncio.Future] | None = None

    async def next(self, part: Sequence[BlockHash]) -> None:
        """Start loading ``part`` (or as much of its head as the pin budget allows now)."""
        n = await self.pins.take(len(part), _PIN_WAIT_S) if part else 0
        if n:
            part = part[:n]
            self.ahead = (part, n, asyncio.ensure_future(self.registry.run_on(self.entry, _load, self.entry, part)))

    async def take(self):
        part, n, future = self.ahead
        self.ahead = None
        try:
            loaded, blocks = await asyncio.shield(future)
        except asyncio.CancelledError:  # the load goes on: release what it pins once it is done
            future.add_done_callback(self._dropper(n))
            raise
        except BaseException:
            self.pins.give(n)
            raise
        return part, (_Pinned(loaded, n), blocks)

    def release(self, pinned: "_Pinned") -> None:
        pinned.result.lease.release()
        self.pins.give(pinned.n)

    async def close(self) -> None:
        """Release a chunk loaded ahead that will not be sent (once its load is done)."""
        if self.ahead is not None:
            _, n, future = self.ahead
            self.ahead = None
            future.add_done_callback(self._dropper(n))

    def _dropper(self, n: int):
        def drop(future: asyncio.Future) -> None:
            try:
                future.result()[0].lease.release()
            except BaseException:  # the load failed or was cancelled: nothing is pinned
                logger.debug("get: a load ahead failed", exc_info=True)
            finally:
                self.pins.give(n)

        return drop


class _Pinned(NamedTuple):
    result: "LoadResult"
    n: int


def _load(entry: "Namespace", block_hashes: Sequence[BlockHash]) -> tuple["LoadResult", list]:
    """On a registry thread: the leading blocks pinned in the top pool and, per block, its
    record header and its bytes (the slot itself on CPU; a host copy of a GPU slot)."""
    store = entry.store
    loaded = store.load(block_hashes, count=False)  # the client's /lookup counted these (M1)
    try:
        pool = store.top
        top = pool.tensor
        blocks = []
        for block_id, fingerprint in zip(loaded.block_ids, loaded.fingerprints):
            block = top[block_id]
            if block.device.type != "cpu":
                block = block.cpu()
            digest = pool.payload_digest_at(block_id)  # known where the slot's writer hashed it: not read here
            blocks.append((encode_header(entry.namespace, block, 0, fingerprint, digest), block_bytes(block)))
        return loaded, blocks
    except BaseException:
        loaded.lease.release()
        raise


# -- put ---------------------------------------------------------------------------------------
async def receive_blocks(request: web.Request, registry: "Registry", entry: "Namespace", staging: Budget) -> list[bool]:
    """Read, verify and store the frames of a put body; one bool per frame. Reads are
    bounded by a :class:`BodyClock`, staging memory by ``staging`` (a put that finds none
    free within ``grace_s`` is a 503)."""
    settings = registry.settings
    own_deadline(request)
    limit = max_frames_nbytes(settings.max_batch_blocks, settings.max_block_bytes)
    if request.content_length is not None and request.content_length > limit:
        raise error(web.HTTPRequestEntityTooLarge, f"expected a put body of at most {limit} bytes "
                    f"(--max-batch-blocks x --max-block-bytes), got Content-Length {request.content_length}")
    stored: list[bool] = []
    batch: _Batch | None = None
    direct = _Direct.of(registry, entry)
    reader = FrameReader.of(request, BodyClock(settings.grace_s, settings.min_rate_bytes_per_s),
                            entry.spec.block_nbytes)  # last: from here on only the finally gives it back
    consumed = False
    try:
        while (record := await _next_frame(reader, entry, settings, len(stored))) is not None:
            block_hash, header, record = record
            index = len(stored)
            stored.append(False)
            digest = record.digest(header)
            handle = None if direct is None else await direct.reserve(block_hash, record.fingerprint)
            if handle is not None:  # straight into its pool slot
                ok = await direct.receive(reader, handle, digest, record.checksum, index)
                if not ok:
                    _rejected(entry, index)
                continue
            if batch is None:  # staging is taken once a frame needs it
                batch = await _Batch.start(registry, entry, stored, staging, _expected_frames(request, entry))
            if block_hash in batch.hashes:  # a repeat within one store call would end its chain
                await batch.flush()
            await _payload(reader, batch.slot(), digest, index)
            if digest.intdigest() == record.checksum:
                batch.add(block_hash, index, record.fingerprint)
            else:
                _rejected(entry, index)
            if batch.full:
                await batch.flush()
        if await reader.read(1):
            raise error(web.HTTPBadRequest, f"expected the body to end after the end byte (after {len(stored)} frames)")
        consumed = True
        if batch is not None:
            await batch.flush()
            await batch.drain()
        if direct is not None:
            await direct.acknowledge(stored)
    except Expired as exc:
        reset(request.transport)
        raise error(web.HTTPRequestTimeout, f"put body: {exc}") from None
    except Exception:  # answered before the body's end: read the rest first
        if not consumed:
            if direct is not None:  # the slots and buffers are not held while it drains
                direct.release()
                direct = None
            if batch is not None:
                await batch.release()
                batch = None
            consumed = await _drained(reader, request)
        raise
    finally:
        reader.close(consumed)
        if direct is not None:
            direct.release()
        if batch is not None:
            await batch.release()
    return stored


async def _drained(reader: FrameReader, request: web.Request) -> bool:
    """Whether the rest of the body could be read (and dropped) so that an error answered
    before its end reaches the client (kvtier.server.streams.FrameReader.drain)."""
    try:
        await reader.drain()
    except (Expired, ConnectionError):
        reset(request.transport)
        return False
    return True


def _rejected(entry: "Namespace", index: int) -> None:
    entry.rejected_blocks += 1
    LOG.log(logger, logging.WARNING, "put checksum", "put: frame %d of %s failed its checksum; not stored", index,
            entry.label)


async def _next_frame(reader: FrameReader, entry: "Namespace", settings: "ServeConfig", i: int):
    """``(block_hash, header bytes, record header)`` of the next frame, checked before its
    payload is read; ``None`` at the end byte. Raises a 400 or 413 HTTP error."""
    hash_len = (await reader.exactly(1, i))[0]
    if hash_len == 0:
        return None
    if hash_len not in BLOCK_HASH_NBYTES:
        raise error(web.HTTPBadRequest, f"frame {i}: expected a hash length of 16 or 32 bytes, got {hash_len}")
    if i >= settings.max_batch_blocks:
        raise error(web.HTTPRequestEntityTooLarge, f"expected at most {settings.max_batch_blocks} frames per put "
                    "(--max-batch-blocks), got more")
    block_hash = BlockHash(await reader.exactly(hash_len, i))
    header = await reader.exactly(HEADER_NBYTES, i)
    record = parse_header(header)
    if record is None:
        raise error(web.HTTPBadRequest, f"frame {i}: expected a kvtier record header, got inconsistent bytes")
    if record.payload_nbytes > settings.max_block_bytes:
        raise error(web.HTTPRequestEntityTooLarge, f"frame {i}: expected a block of at most "
                    f"{settings.max_block_bytes} bytes (--max-block-bytes), got {record.payload_nbytes}")
    if record.namespace != entry.namespace:
        raise error(web.HTTPBadRequest, f"frame {i}: expected the record's namespace to be the URL's, "
                    f"got {record.namespace.hex()}")
    dtype, shape = DTYPE_NAMES[entry.spec.dtype], tuple(entry.spec.block_shape)
    if record.dtype != dtype or record.shape != shape:
        raise error(web.HTTPBadRequest, f"frame {i}: expected a {dtype} block of shape {list(shape)}, "
                    f"got {record.dtype} {list(record.shape)}")
    return block_hash, header, record


def _expected_frames(request: web.Request, entry: "Namespace") -> int | None:
    """Frames a body of ``Content-Length`` bytes holds at most (``None``: chunked)."""
    if request.content_length is None:
        return None
    return max(1, request.content_length // frame_nbytes(b"\0" * 16, entry.spec.block_nbytes))


async def _payload(reader: FrameReader, dst: np.ndarray, digest, frame: int) -> None:
    """The next ``dst.nbytes`` body bytes into ``dst`` (flat ``uint8``), hashed as they come."""
    await reader.readinto(memoryview(dst), digest, frame)


class _Batch:
    """Two staging buffers: verified blocks fill one while the other is being stored. Each
    holds ``min(staging_blocks, frames the body can hold)`` blocks; their bytes are taken
    from the daemon's staging budget and given back once no store call uses them."""

    def __init__(self, registry: "Registry", entry: "Namespace", stored: list[bool], buffers: list[torch.Tensor],
                 staging: Budget, nbytes: int) -> None:
        self.registry, self.entry, self.stored, self.durable = registry, entry, stored, registry.settings.durable
        self.buffers, self.staging, self.nbytes = buffers, staging, nbytes
        self.current = 0
        self.hashes: list[BlockHash] = []
        self.fingerprints: list[bytes] = []
        self.indices: list[int] = []
        self.task: asyncio.Future | None = None
        self.task_indices: list[int] = []

    @classmethod
    async def start(cls, registry: "Registry", entry: "Namespace", stored: list[bool], staging: Budget,
                    expected_frames: int | None) -> "_Batch":
        """Raises a 503 when the staging budget has no room within ``grace_s``."""
        n = entry.staging_blocks if expected_frames is None else min(entry.staging_blocks, expected_frames)
        nbytes = 2 * n * entry.spec.block_nbytes
        if not await staging.take(nbytes, registry.settings.grace_s, least=nbytes):
            exc = error(web.HTTPServiceUnavailable, f"put: every staging byte is in use (--max-staging-bytes "
                        f"{staging.capacity}); try again")
            exc.headers["Retry-After"] = "1"
            raise exc
        return cls(registry, entry, stored, [entry.take_staging(n), entry.take_staging(n)], staging, nbytes)

    @property
    def full(self) -> bool:
        return len(self.hashes) == self.buffers[self.current].shape[0]

    def slot(self) -> np.ndarray:
        """The next free block of the current buffer as flat bytes (``add`` keeps it)."""
        return self.buffers[self.current][len(self.hashes)].view(torch.uint8).numpy().reshape(-1)

    def add(self, block_hash: BlockHash, index: int, fingerprint: bytes) -> None:
        self.hashes.append(block_hash)
        self.indices.append(index)
        self.fingerprints.append(fingerprint)

    async def flush(self) -> None:
        """Start storing the current buffer (after the other buffer's store is done)."""
        if not self.hashes:
            return
        await self.drain()
        blocks = self.buffers[self.current][: len(self.hashes)]
        self.task = asyncio.ensure_future(
            self.registry.run_on(self.entry, _store, self.entry.store, self.hashes, blocks, self.fingerprints,
                                 self.durable))
        self.task_indices = self.indices
        self.hashes, self.indices, self.fingerprints = [], [], []
        self.current ^= 1

    async def drain(self) -> None:
        """Wait for the store in flight and record its acknowledgements."""
        if self.task is None:
            return
        task, self.task = self.task, None
        for index, ok in zip(self.task_indices, await task):
            self.stored[index] = ok

    async def release(self) -> None:
        """Return the buffers and their budget once no store call uses them: wait for a store
        still in flight (an error path), or, when the call is being cancelled (a deadline, a
        deletion), return them from that store's completion without waiting."""
        task, self.task = self.task, None
        if task is not None and not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                task.add_done_callback(lambda _: self._give())
                raise
        self._give()

    def _give(self) -> None:
        for buffer in self.buffers:
            self.entry.give_staging(buffer)
        self.buffers = []
        self.staging.give(self.nbytes)


class _Direct:
    """A put's frames received straight into top-pool slots: one copy of each payload byte
    (aiohttp's receive buffer -> the slot; none after the kernel's where a
    kvtier.server.streams.BodyReceiver took the body), hashed piece by piece as it lands,
    where the staging path copies it twice (-> staging buffer -> slot).

    Per frame, once its header is checked: ``prepare_store`` of that one block reserves a
    slot (pending: pinned, invisible to lookups), the payload is read into the slot's bytes,
    then ``complete_store`` publishes it if its checksum holds and frees it otherwise. A body
    that fails mid-frame (a client reset, a truncated body, a deadline, a cancelled call)
    frees the slot it was writing; blocks completed before it stay stored, as on the staging
    path. A frame that gets no fresh slot (the block is stored already, another request is
    writing it, every slot is pinned) goes the staging path, which answers those cases as
    ``TieredStore.store`` does. A put holds one reserved slot at a time, and each block it
    published is protected from eviction until the put ends (as ``TieredStore.store``
    protects the chunks it stored): a batch longer than the pool can take stores its head
    and is refused the rest (``False``), never evicting its own head for its tail; and a
    block is acknowledged only if it is still in the store when the put ends (case B2:
    never claim more than is stored).

    Only for a store with nothing below its top pool (no DISK, no REMOTE, one pool): making
    room there evicts without I/O, so the store's lock is taken on the event loop, without
    waiting (``blocking=False``; when another thread holds it, the call runs on a registry
    thread). With a tier below, each one-block ``prepare_store`` would spill its victim in a
    DISK transaction of its own where the staging path's store call spills a buffer's worth
    at once: measured 0.18-0.19 GB/s against staging's 0.23-0.25 GB/s with a DISK tier under
    the pool (bench/results/2026-12-02-daemon-4/put_ab_disk-direct.log), so such stores keep the
    staging path.
    """

    def __init__(self, registry: "Registry", entry: "Namespace") -> None:
        self.registry, self.entry, self.store = registry, entry, entry.store
        top = self.store.top.tensor
        self.slots = top.view(torch.uint8).numpy().reshape(top.shape[0], -1)
        self.parent: BlockHash | None = None
        self.done: list[tuple[int, BlockHash]] = []
        self.protected: list[BlockHash] = []  # published here, protected until release()
        self.released = False

    @classmethod
    def of(cls, registry: "Registry", entry: "Namespace") -> "_Direct | None":
        """``None`` where a slot cannot take the socket's bytes (a top pool in GPU memory) or
        where the staging path stores faster (a tier below the top pool)."""
        store = entry.store
        top = store.top.tensor
        if top.device.type != "cpu" or not top.is_contiguous() or store.disk is not None \
                or store.remote is not None or len(store.pools) != 1 or registry.settings.durable:
            return None
        return cls(registry, entry)

    async def reserve(self, block_hash: BlockHash, fingerprint: bytes):
        """A handle with one fresh slot for ``block_hash``, or ``None`` (then the staging path
        takes the frame)."""
        handle = self.store.prepare_store([block_hash], [fingerprint], blocking=False)
        if handle is None:  # another thread holds the store's lock: wait for it there
            future = asyncio.ensure_future(
                self.registry.run_on(self.entry, self.store.prepare_store, [block_hash], [fingerprint]))
            try:
                handle = await asyncio.shield(future)
            except asyncio.CancelledError:  # the reservation goes on: free its slot once it is made
                future.add_done_callback(_abandon_reserved)
                raise
        if not handle.block_ids:
            _abandon(handle)  # publishes nothing: a present block's pin, or nothing at all
            return None
        handle.parent = self.parent
        return handle

    async def receive(self, reader: FrameReader, handle, digest, checksum: int, index: int) -> bool:
        """The frame's payload into the handle's slot, then publish it (checksum ``ok``) or
        free it; returns ``ok``. Any exception frees the slot and propagates."""
        try:
            await _payload(reader, self.slots[handle.block_ids[0]], digest, index)
        except BaseException:
            _abandon(handle)
            raise
        ok = digest.intdigest() == checksum
        if ok:  # a get or a spill of the slot makes its record without hashing it again
            self.store.top.set_payload_digest(handle.block_ids[0], digest.payload_intdigest())
        if await self._locked(self._publish, handle, ok):
            self.parent = handle.block_hashes[0]
            self.done.append((index, handle.block_hashes[0]))
        return ok

    def _publish(self, handle, ok: bool) -> bool:
        """Under the store's lock: complete ``handle``; a block it published is protected
        until :meth:`release`. Returns whether it was published (not when a reset made the
        handle stale: then it freed the slot instead)."""
        with self.store.residency.lock:
            self.store.complete_store(handle, success=ok)
            published = ok and handle.generation == self.store.residency.generation
            if published and not self.released:
                self.store.residency.protect(handle.block_hashes)
                self.protected.extend(handle.block_hashes)
            return published

    async def _locked(self, fn, *args):
        """``fn(*args)`` (which takes the store's lock itself) on the event loop when the lock
        is free now, else on a registry thread, shielded: a call cancelled meanwhile (the
        client went away) still runs to its end."""
        lock = self.store.residency.lock
        if lock.acquire(blocking=False):
            try:
                return fn(*args)
            finally:
                lock.release()
        return await asyncio.shield(asyncio.ensure_future(self.registry.run_on(self.entry, fn, *args)))

    def _acknowledge(self, stored: list[bool]) -> None:
        with self.store.residency.lock:
            medium_of = self.store.placement.medium_of
            for index, block_hash in self.done:
                stored[index] = medium_of(block_hash) is not None

    def _release(self) -> None:
        with self.store.residency.lock:
            self.released = True
            protected, self.protected = self.protected, []
            self.store.residency.unprotect(protected)

    async def acknowledge(self, stored: list[bool]) -> None:
        """``stored[i] = True`` for each block published here that is still in the store
        (``--durable`` puts never come here: they wait for DISK commits, which the staging
        path's store call does)."""
        await self._locked(self._acknowledge, stored)

    def release(self) -> None:
        """Unprotect the blocks published here (the put is over, or failed): at once when the
        store's lock is free, else on a registry thread (a publish still running there sees
        ``released`` and protects nothing)."""
        lock = self.store.residency.lock
        if lock.acquire(blocking=False):
            try:
                self._release()
            finally:
                lock.release()
        else:
            asyncio.ensure_future(self.registry.run_on(self.entry, self._release))


def _abandon(handle) -> None:
    """Free a prepared handle's slots and pins without waiting for the store's lock (the
    cleanup a dropped handle runs: queued for the lock's next holder if it is taken)."""
    if handle.abandon is not None:
        handle.abandon()
    handle.lease.release()


def _abandon_reserved(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        _abandon(future.result())


def _store(
    store: "TieredStore", block_hashes: list[BlockHash], blocks: torch.Tensor, fingerprints: list[bytes], durable: bool
) -> list[bool]:
    """On a registry thread: store (with the records' fingerprints), then report which blocks
    are in the store (``durable``: committed to DISK, waiting for the write-through writes)."""
    num_stored = store.store(block_hashes, blocks, fingerprints)
    ok = [i < num_stored for i in range(len(block_hashes))]
    if durable:
        store.wait_for_writes()
        ok = [good and on_disk for good, on_disk in zip(ok, store.on_disk(block_hashes))]
    return ok
