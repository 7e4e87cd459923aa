"""Block streams of the daemon: ``get`` writes frames from the store's pool, ``put`` reads and
verifies frames into staging buffers and stores them (format: kvtier.wire).

get: the blocks are loaded (``store.load``: pinned in the top pool, DISK blocks read up) a
chunk at a time on the registry's threads; each block's header is computed there from the
slot (one hashing pass, no copy), with the token fingerprint the block was stored with, and
the slot's own memory is written to the socket. The daemon checks no fingerprint for the
client: it is a relay, and the client checks every block against its own tokens (it could
not trust a daemon's word that it did). The
lease is released only once the socket has taken every byte of the chunk (a transport may
keep a reference to the memory it was given until it is sent), while the next chunk is
already being loaded.

put: each frame is checked before its payload is read (hash size, a consistent header, the
namespace, the registered shape and dtype, ``--max-block-bytes``: a block over the limit is
refused with 413 after its 128-byte header, chunked bodies too, case S1), its payload is
copied into a staging buffer and hashed piece by piece as it arrives, and a block whose
checksum fails is not stored (``stored[i] = False``). A full staging buffer is stored with
one store call on a thread while the next buffer fills. A put is acknowledged (``True``)
only once the block is in the store; with ``--durable`` only once it is committed to DISK.
Each block is stored with the fingerprint of its record header (what a later get sends).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from aiohttp import web

from kvtier.checks import BLOCK_HASH_NBYTES
from kvtier.records import HEADER_NBYTES, encode_header, parse_header
from kvtier.server.errors import error
from kvtier.types import DTYPE_NAMES, BlockHash
from kvtier.wire import END, FRAMES, block_bytes, frame_prefix, max_frames_nbytes

if TYPE_CHECKING:
    from kvtier.server.registry import Namespace, Registry
    from kvtier.server.settings import ServeConfig
    from kvtier.store import LoadResult, TieredStore

logger = logging.getLogger(__name__)

_LOAD_CHUNK_BYTES = 32 << 20
"""Blocks loaded and pinned per step of a get (two steps are in flight at once)."""


# -- get ---------------------------------------------------------------------------------------
async def send_blocks(
    request: web.Request, registry: "Registry", entry: "Namespace", block_hashes: Sequence[BlockHash]
) -> web.StreamResponse:
    """Stream the leading present blocks of ``block_hashes``, then the end byte."""
    top = entry.store.top
    chunk = max(1, min(top.num_blocks // 4, _LOAD_CHUNK_BYTES // entry.spec.block_nbytes))
    parts = [block_hashes[i : i + chunk] for i in range(0, len(block_hashes), chunk)]
    response = web.StreamResponse(headers={"Content-Type": FRAMES})
    next_load = asyncio.ensure_future(registry.run(_load, entry, parts[0])) if parts else None
    try:
        await response.prepare(request)
        for k, part in enumerate(parts):
            loaded, blocks = await next_load
            next_load = None
            try:
                if len(blocks) == len(part) and k + 1 < len(parts):
                    next_load = asyncio.ensure_future(registry.run(_load, entry, parts[k + 1]))
                for h, (header, payload) in zip(part, blocks):
                    await response.write(frame_prefix(h) + header)
                    await response.write(payload)
                await _sent(request.transport)
            finally:
                loaded.lease.release()
            if len(blocks) < len(part):
                break
        await response.write(END)
        await response.write_eof()
    except ConnectionResetError:
        logger.debug("get: client went away mid-stream")
    finally:
        if next_load is not None:  # a chunk loaded ahead that will not be sent
            try:
                (await next_load)[0].lease.release()
            except Exception:  # the load failed: nothing is pinned
                logger.debug("get: a load ahead failed", exc_info=True)
    if not response.prepared:
        raise error(web.HTTPServiceUnavailable, "get: the response could not start")
    return response


def _load(entry: "Namespace", block_hashes: Sequence[BlockHash]) -> tuple["LoadResult", list]:
    """On a registry thread: the leading blocks pinned in the top pool and, per block, its
    record header and its bytes (the slot itself on CPU; a host copy of a GPU slot)."""
    store = entry.store
    loaded = store.load(block_hashes, count=False)  # the client's /lookup counted these (M1)
    try:
        top = store.top.tensor
        blocks = []
        for block_id, fingerprint in zip(loaded.block_ids, loaded.fingerprints):
            block = top[block_id]
            if block.device.type != "cpu":
                block = block.cpu()
            blocks.append((encode_header(entry.namespace, block, 0, fingerprint), block_bytes(block)))
        return loaded, blocks
    except BaseException:
        loaded.lease.release()
        raise


async def _sent(transport: asyncio.Transport | None) -> None:
    """Wait until the transport has handed every byte to the kernel (or is closed)."""
    while transport is not None and not transport.is_closing() and transport.get_write_buffer_size():
        await asyncio.sleep(0.0005)


# -- put ---------------------------------------------------------------------------------------
async def receive_blocks(request: web.Request, registry: "Registry", entry: "Namespace", settings: "ServeConfig") -> list[bool]:
    """Read, verify and store the frames of a put body; one bool per frame."""
    limit = max_frames_nbytes(settings.max_batch_blocks, settings.max_block_bytes)
    if request.content_length is not None and request.content_length > limit:
        raise error(web.HTTPRequestEntityTooLarge, f"expected a put body of at most {limit} bytes "
                    f"(--max-batch-blocks x --max-block-bytes), got Content-Length {request.content_length}")
    content = request.content
    stored: list[bool] = []
    batch = _Batch(registry, entry, stored, settings.durable)
    dtype, shape = DTYPE_NAMES[entry.spec.dtype], tuple(entry.spec.block_shape)
    try:
        while True:
            i = len(stored)
            hash_len = (await _exactly(content, 1, i))[0]
            if hash_len == 0:
                break
            if hash_len not in BLOCK_HASH_NBYTES:
                raise error(web.HTTPBadRequest, f"frame {i}: expected a hash length of 16 or 32 bytes, got {hash_len}")
            if i >= settings.max_batch_blocks:
                raise error(web.HTTPRequestEntityTooLarge, f"expected at most {settings.max_batch_blocks} frames per put "
                            "(--max-batch-blocks), got more")
            block_hash = BlockHash(await _exactly(content, hash_len, i))
            header = await _exactly(content, HEADER_NBYTES, i)
            record = parse_header(header)
            if record is None:
                raise error(web.HTTPBadRequest, f"frame {i}: expected a kvtier record header, got inconsistent bytes")
            if record.payload_nbytes > settings.max_block_bytes:
                raise error(web.HTTPRequestEntityTooLarge, f"frame {i}: expected a block of at most "
                            f"{settings.max_block_bytes} bytes (--max-block-bytes), got {record.payload_nbytes}")
            if record.namespace != entry.namespace:
                raise error(web.HTTPBadRequest, f"frame {i}: expected the record's namespace to be the URL's, "
                            f"got {record.namespace.hex()}")
            if record.dtype != dtype or record.shape != shape:
                raise error(web.HTTPBadRequest, f"frame {i}: expected a {dtype} block of shape {list(shape)}, "
                            f"got {record.dtype} {list(record.shape)}")
            if block_hash in batch.hashes:  # a repeat within one store call would end its chain
                await batch.flush()
            digest = record.digest(header)
            await _payload(content, batch.slot(), digest, i)
            stored.append(False)
            if digest.intdigest() == record.checksum:
                batch.add(block_hash, i, record.fingerprint)
            else:
                entry.rejected_blocks += 1
                logger.warning("put: frame %d of namespace %s failed its checksum; not stored", i, entry.namespace.hex())
            if batch.full:
                await batch.flush()
        if await content.read(1):
            raise error(web.HTTPBadRequest, f"expected the body to end after the end byte (after {len(stored)} frames)")
        await batch.flush()
        await batch.drain()
    finally:
        await batch.release()
    return stored


async def _exactly(content, n: int, frame: int) -> bytes:
    try:
        return await content.readexactly(n)
    except asyncio.IncompleteReadError:
        raise error(web.HTTPBadRequest, f"frame {frame}: the body ends inside a frame or without the end byte") from None


async def _payload(content, dst: np.ndarray, digest, frame: int) -> None:
    """Copy the next ``dst.nbytes`` body bytes into ``dst`` and hash them, piece by piece."""
    offset, nbytes = 0, dst.nbytes
    while offset < nbytes:
        piece = await content.read(min(nbytes - offset, 1 << 20))
        if not piece:
            raise error(web.HTTPBadRequest, f"frame {frame}: the body ends inside a block")
        dst[offset : offset + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        digest.update(piece)
        offset += len(piece)


class _Batch:
    """Two staging buffers: verified blocks fill one while the other is being stored."""

    def __init__(self, registry: "Registry", entry: "Namespace", stored: list[bool], durable: bool) -> None:
        self.registry, self.entry, self.stored, self.durable = registry, entry, stored, durable
        self.buffers = [entry.take_staging(), entry.take_staging()]
        self.current = 0
        self.hashes: list[BlockHash] = []
        self.fingerprints: list[bytes] = []
        self.indices: list[int] = []
        self.task: asyncio.Future | None = None
        self.task_indices: list[int] = []

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
            self.registry.run(_store, self.entry.store, self.hashes, blocks, self.fingerprints, self.durable)
        )
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
        """Wait for a store still in flight (on an error path), then return the buffers."""
        if self.task is not None:
            await asyncio.wait([self.task])
            self.task = None
        for buffer in self.buffers:
            self.entry.give_staging(buffer)
        self.buffers = []


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
