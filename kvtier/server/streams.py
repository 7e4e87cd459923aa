"""Socket-level reads and writes of the daemon's frame streams (kvtier.server.frames): a put
body read a received piece at a time without copies, a get's chunk of frames handed to the
transport in one call, and the wait until the transport has sent it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import web

from kvtier.server.connections import BodyClock
from kvtier.server.errors import error
from kvtier.types import BlockHash
from kvtier.wire import frame_prefix


def holds_buffers(transport: asyncio.BaseTransport | None) -> bool:
    """Whether ``transport`` sends from the buffers it is given (uvloop's). asyncio's own
    (Python 3.11) copies what the socket does not take at once into one bytearray and
    drains it from the front, a ``memmove`` of the rest after every send: given a chunk of
    32 MiB at once, that costs more than the whole copy per block it saves, so there the
    frames go block by block through aiohttp, each write waiting for the last to drain."""
    return transport is not None and type(transport).__module__.startswith("uvloop")


def write_frames(transport: asyncio.Transport | None, part: Sequence[BlockHash], blocks: list) -> int:
    """The frames of ``blocks`` as one HTTP/1.1 chunk (the response is chunked), handed to the
    transport in one ``writelines``: the slots' own memory, no copy on uvloop (aiohttp's
    ``write`` joins each chunk's size line, payload and CRLF into a new bytes first on
    Python < 3.12.9: a copy of every block). Returns the bytes of the frames."""
    pieces: list = []
    for h, (header, payload) in zip(part, blocks):
        pieces += (frame_prefix(h) + header, payload)
    nbytes = sum(len(p) for p in pieces)  # payloads are flat byte views: len == nbytes
    if not nbytes:  # a chunk of size 0 would end the body
        return 0
    if transport is None or transport.is_closing():
        raise ConnectionResetError("get: the client went away")
    transport.writelines([b"%x\r\n" % nbytes, *pieces, b"\r\n"])
    return nbytes


async def sent(transport: asyncio.Transport | None) -> None:
    """Wait until the transport has handed every byte to the kernel (or is closed): polls,
    0.5 ms at first, then less often (a client that reads slowly costs no CPU)."""
    pause = 0.0005
    while transport is not None and not transport.is_closing() and transport.get_write_buffer_size():
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.05)


class FrameReader:
    """``request.content`` read through a :class:`BodyClock`, a received chunk at a time
    (``readchunk``: aiohttp's ``read(n)`` and ``readany`` join the buffered chunks into a new
    bytes, a copy of every payload byte); the rest of a chunk waits in ``_left`` for the next
    read."""

    def __init__(self, content, clock: BodyClock) -> None:
        self.content, self.clock = content, clock
        self._left = memoryview(b"")

    async def piece(self, n: int) -> memoryview:
        """The next 1 to ``n`` bytes of the body (a view of a received chunk, no copy);
        empty at its end."""
        if not self._left:
            self._left = memoryview(await self.clock.read(next_chunk(self.content)))
        piece, self._left = self._left[:n], self._left[n:]
        return piece

    async def exactly(self, n: int, frame: int) -> bytes:
        parts, need = [], n
        while need:
            piece = await self.piece(need)
            if not piece:
                raise error(web.HTTPBadRequest, f"frame {frame}: the body ends inside a frame or without the end "
                                                "byte")
            parts.append(piece)
            need -= len(piece)
        return b"".join(parts)

    async def read(self, n: int) -> bytes:
        return bytes(await self.piece(n))


async def next_chunk(content) -> bytes:
    """The next received piece of the body as aiohttp buffered it; ``b""`` at its end (the
    empty pieces ``readchunk`` returns at the end of each HTTP chunk of a chunked body are
    skipped). The end is asked of ``at_eof`` first: a request without a body gets aiohttp's
    one shared ``EMPTY_PAYLOAD``, whose ``readchunk`` answers ``(b"", True)`` without waiting
    once any request read it to its end, which this loop would skip forever."""
    while True:
        if content.at_eof():
            return b""
        data, http_chunk_end = await content.readchunk()
        if data or not http_chunk_end:
            return data
