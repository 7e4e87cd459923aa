"""Socket-level reads and writes of the daemon's frame streams (kvtier.server.frames): a put
body received straight into its destinations (:class:`BodyReceiver`) or read a received piece
at a time without copies, a get's chunk of frames handed to the transport in one call, and the
wait until the transport has sent it."""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import Sequence

from aiohttp import http_parser, web, web_protocol

from kvtier.server.connections import BodyClock, reset
from kvtier.server.errors import error
from kvtier.types import BlockHash
from kvtier.wire import frame_nbytes, frame_prefix


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
    """A put body read through a :class:`BodyClock`: straight from the socket into the
    caller's buffers when a :class:`BodyReceiver` took it over (:meth:`of`), else
    ``request.content`` a received chunk at a time (``readchunk``: aiohttp's ``read(n)`` and
    ``readany`` join the buffered chunks into a new bytes, a copy of every payload byte); the
    rest of a chunk waits in ``_left`` for the next read."""

    def __init__(self, content, clock: BodyClock, receiver: "BodyReceiver | None" = None) -> None:
        self.content, self.clock, self.receiver = content, clock, receiver
        self._left = memoryview(receiver.leftover if receiver is not None else b"")

    @classmethod
    def of(cls, request: web.Request, clock: BodyClock, block_nbytes: int) -> "FrameReader":
        """The reader of a put body of blocks of ``block_nbytes`` bytes (a receiver's where
        :meth:`BodyReceiver.take` gives one)."""
        return cls(request.content, clock, BodyReceiver.take(request, block_nbytes, clock))

    async def piece(self, n: int) -> memoryview:
        """The next 1 to ``n`` bytes of the body (a view of a received chunk, no copy;
        from a receiver: a fill of at least a frame prefix's bytes, whose rest waits for the
        next read; ``n`` is a frame's prefix field there, payloads go through
        :meth:`readinto`); empty at its end."""
        if not self._left:
            if self.receiver is None:
                self._left = memoryview(await self.clock.read(next_chunk(self.content)))
            else:  # a whole frame prefix per fill (one event-loop round trip, not three)
                self._left = memoryview(bytearray(min(max(n, _PREFIX_NBYTES), self.receiver.available)))
                if self._left:
                    await self._fill(self._left)
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

    async def readinto(self, dst: memoryview, digest, frame: int) -> None:
        """The body's next ``len(dst)`` bytes into ``dst`` (writable, format ``B``), fed to
        ``digest`` (a running hash with ``update``) as they come.

        Raises:
            web.HTTPBadRequest: the body ends first.
            kvtier.server.connections.Expired: slower than the BodyClock allows.
            ConnectionResetError: the client went away or ended its side (receiver).
        """
        offset, nbytes = 0, len(dst)
        while offset < nbytes and (self._left or self.receiver is None):
            piece = await self.piece(nbytes - offset)
            if not piece:
                raise error(web.HTTPBadRequest, f"frame {frame}: the body ends inside a block")
            dst[offset : offset + len(piece)] = piece
            digest.update(piece)
            offset += len(piece)
        if offset < nbytes:
            if self.receiver.available < nbytes - offset:
                raise error(web.HTTPBadRequest, f"frame {frame}: the body ends inside a block")
            await self._fill(dst[offset:], digest)

    async def drain(self) -> None:
        """Read the rest of a receiver's body and drop it (an error answered before the body
        ended: the client gets the answer once it sent its body, as aiohttp's lingering read
        gives it; aiohttp's own reads are left to aiohttp). Within the clock; raises
        :class:`~kvtier.server.connections.Expired`."""
        if self.receiver is None:
            return
        self._left = memoryview(b"")
        scratch = memoryview(bytearray(min(256 << 10, self.receiver.available)))
        while self.receiver.available:
            await self._fill(scratch[: min(len(scratch), self.receiver.available)])

    async def _fill(self, view: memoryview, digest=None) -> None:
        receiver = self.receiver
        await self.clock.receive(receiver.fill(view, digest), len(view), receiver.landed)

    def close(self, consumed: bool) -> None:
        """The body is done with (``consumed``: read to its end): a receiver gives the
        transport back (kvtier.server.streams.BodyReceiver.close)."""
        if self.receiver is not None:
            self.receiver.close(consumed)


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


_KEY = getattr(web, "RequestKey", None)  # aiohttp >= 3.12; plain strings before
CLOSE_AFTER = _KEY("kvtier_close_after", bool) if _KEY else "kvtier_close_after"
"""``request[CLOSE_AFTER]``: the response closes the connection (set where a
:class:`BodyReceiver` took the body past aiohttp's parser, which still waits for it)."""


_PARSER_CLASSES = tuple(c for c in (getattr(http_parser, "HttpRequestParserPy", None),
                                    getattr(http_parser, "HttpRequestParserC", None)) if isinstance(c, type))
_PARSER_SETTINGS = ("read_bufsize", "max_line_size", "max_field_size", "max_headers", "auto_decompress")


def _handler_defaults() -> dict | None:
    """``RequestHandler.__init__``'s defaults of :data:`_PARSER_SETTINGS` (``None`` when one
    is missing). Read once, at import: an ``inspect.signature`` per received put was 2.6% of
    the daemon's busy put samples."""
    parameters = inspect.signature(web_protocol.RequestHandler.__init__).parameters
    if any(n not in parameters for n in _PARSER_SETTINGS):
        return None
    return {n: parameters[n].default for n in _PARSER_SETTINGS}


_HANDLER_DEFAULTS = _handler_defaults()


def fresh_parser(protocol: asyncio.BaseProtocol) -> tuple[str, object] | None:
    """``(attribute, parser)``: a new HTTP request parser for aiohttp's ``RequestHandler``
    ``protocol``, made as aiohttp makes the one a connection starts with (the same class, the
    handler's limits from its server's settings, else ``RequestHandler``'s defaults) and
    the handler attribute it goes in; ``None`` where this aiohttp's handler does not look as
    3.9-3.14 do (``_request_parser``, or ``_parser`` from 3.14) or the class refuses those
    arguments. aiohttp has no public way to tell its parser that a body was read past it
    (:class:`BodyReceiver`): a fresh parser is how the connection gets its next request.
    Event-loop only (the parser takes the running loop)."""
    attribute = next((a for a in ("_parser", "_request_parser")
                      if isinstance(getattr(protocol, a, None), _PARSER_CLASSES)), None)
    settings = getattr(getattr(protocol, "_manager", None), "_kwargs", None)
    if attribute is None or not isinstance(settings, dict) or _HANDLER_DEFAULTS is None:
        return None
    conf = {n: settings.get(n, default) for n, default in _HANDLER_DEFAULTS.items()}
    queue = {"max_msg_queue_size": protocol._max_msg_queue_size} if hasattr(protocol, "_max_msg_queue_size") else {}
    try:
        parser = type(getattr(protocol, attribute))(
            protocol, asyncio.get_running_loop(), conf.pop("read_bufsize"),
            payload_exception=web_protocol.RequestPayloadError, **conf, **queue)
    except TypeError:
        return None
    return attribute, parser


RECEIVE_MIN_NBYTES = 1 << 20
RECEIVE_MIN_BLOCK_NBYTES = 256 << 10
"""A put body of at least :data:`RECEIVE_MIN_NBYTES` bytes (its ``Content-Length``), of blocks
of at least :data:`RECEIVE_MIN_BLOCK_NBYTES`, is received straight into its destinations
(:class:`BodyReceiver`); others keep aiohttp's reads. Where it was measured faster (issue 17,
bench/results/2026-12-03-keepalive, 2 vCPUs, uvloop, with the connection kept after the
reply): every shape of 256 KiB-4 MiB blocks in bodies of 1-32 MiB at 1.04-1.36x aiohttp's GB/s
and 0.62-0.94x its daemon CPU per GB; 64 KiB blocks lose (0.87-0.90x: a turn of the event loop
per frame), 128 KiB blocks break even (1.02x), a body of one 256 KiB block loses (0.93x).
Before keep-alive, a reconnect per put made it lose below 16 MiB bodies of 1 MiB blocks
(bench/results/2026-12-03-receive)."""

RECEIVE_LOWAT_NBYTES = 512 << 10
"""Bytes a received put body lets queue in the socket before the event loop wakes for them
(``SO_RCVLOWAT``, socket(7): Linux reports a TCP socket readable only once that many bytes
are queued, its receive window is closing, or the peer ended). Without it the loop woke for
every ~250 KiB loopback delivered (~4,000 reads per GB of put), and each wake-up was paid by
the client too: its kernel wakes the daemon as it sends. Set once per body when a fill first
waits on the socket, lowered as the body's last bytes come (never waiting for bytes past
its end: 1 once its last byte is read, before aiohttp reads the next request) and 1 when a
fill is cancelled; at most a quarter of what the body clock's grace allows at its minimum rate
(bytes held in the socket count as late: a client that stops inside a body is cut up to a
quarter of the grace sooner). TCP only (:data:`_LOWAT_FAMILIES`). Measured (issue
17, bench/results/2026-12-04-rcvlowat, 2 vCPUs, loopback, 16 x 2 MiB puts, paired rounds):
batch put 2.74-2.79 GB/s against 2.47-2.59 without, the client's CPU 325-332 ms/GB against
368-375, the daemon's reads per GB ~1,500 against ~4,000; 256 KiB gave 2.68-2.74 GB/s, 1 MiB
2.51-2.62; set per fill instead of per body (three calls a frame), 2.76 against 2.78."""
RECEIVE_READ_NBYTES = 256 << 10
"""Most bytes one read lands in a fill (the buffer ``get_buffer`` hands the kernel). Each
read's bytes are hashed right after the kernel copied them, while they are still in the
core's cache: xxh3 over just-received bytes ran at 39 GB/s in reads of 256 KiB, 30 at 512
KiB, 18 at 2 MiB (issue 17, bench/results/2026-12-04-rcvlowat/rx_hash.py). The event loop
reads again at once while a read fills its buffer (libuv; asyncio's loop on its next turn),
so a wake-up for :data:`RECEIVE_LOWAT_NBYTES` takes several reads. Measured there (40 paired
rounds of 16 x 2 MiB puts): reads of at most 256 KiB put 2.91-2.94 GB/s at 289-290 ms of
daemon CPU per GB, against 2.80 / 313 with reads as large as the fill (up to a block); 128
KiB 2.49, 512 KiB 2.80."""
_LOWAT_FAMILIES = (socket.AF_INET, socket.AF_INET6) if hasattr(socket, "SO_RCVLOWAT") else ()
"""Sockets whose ``SO_RCVLOWAT`` the receiver sets: TCP's (Linux's poll ignores it on Unix
stream sockets); none where the platform has no such option."""
_DISCARD_NBYTES = 64 << 10  # one read's buffer for what comes after the body
_PREFIX_NBYTES = frame_nbytes(bytes(32), 0)  # a put frame up to its payload: 161 bytes


class BodyReceiver(asyncio.BufferedProtocol):
    """The rest of a request's ``Content-Length`` body read from the socket straight into the
    buffers the handler gives (:meth:`fill`), with no copy in user space.

    aiohttp's reads copy each received byte twice before a handler sees it: its event loop
    (uvloop) makes a ``bytes`` of every read, and its HTTP parser slices the body out of
    that (``cb_on_body``); kvtier's copy into a pool slot was the third (issue 17's profile,
    bench/results/2026-12-02-floors: 29 % of the daemon's put samples in ``memmove``). Here
    the transport's protocol is swapped (asyncio's ``set_protocol``; ``BufferedProtocol``:
    ``get_buffer`` hands the kernel the destination itself, uvloop and asyncio's selector
    loop both support it) for the rest of the body, after the bytes aiohttp had already
    buffered (``leftover``). Each fill feeds the bytes to a running digest as they land,
    still in cache; the socket wakes the loop once :data:`RECEIVE_LOWAT_NBYTES` of the body
    are queued (``SO_RCVLOWAT``), not for every segment loopback delivers.

    aiohttp's parser still counts the body as unread: once the whole body was read,
    :meth:`close` ends aiohttp's view of the body (no lingering read) and hands the transport
    back to aiohttp's protocol with a fresh parser (:func:`fresh_parser`), so the connection
    carries the client's next request; opening a connection per put cost the client 11% more
    CPU per GB and the put 12% of its GB/s (issue 17,
    bench/results/2026-12-03-keepalive/put_ab-1.txt). Where this aiohttp gives no fresh parser, the reply
    closes the connection (``request[CLOSE_AFTER]``) and the receiver stays the transport's
    protocol until then, dropping what comes after the body. Once a fill is
    done, reading goes on into a stash of at most one frame prefix (161 bytes: the next
    frame's hash and record header come in the same turn of the loop as the payload before
    them, and the next small fill is served from it without waiting), then pauses until the
    next fill; it never runs past the body's end (into a block, or into the next request).
    Connection loss, an EOF and the transport's write flow control are passed on to aiohttp's
    protocol as they would have reached it.

    Event-loop only. Not for TLS transports (their protocol is asyncio's SSL protocol) or
    bodies without a ``Content-Length``: :meth:`take` answers ``None`` there.
    """

    def __init__(self, request: web.Request, transport: asyncio.Transport, remaining: int,
                 clock: BodyClock | None = None) -> None:
        self.request, self.transport, self.inner = request, transport, request.protocol
        self.remaining = remaining  # body bytes still in the socket
        self._stash = bytearray()
        self._spare: memoryview | None = None
        self._target: memoryview | None = None
        self._filled = 0
        self._digest = None
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._lost = False
        self._reading = True
        self._discard: memoryview | None = None  # after the body: what comes is dropped
        self._handed_back = False  # the transport is aiohttp's again (keep-alive)
        sock = transport.get_extra_info("socket")
        self._sock = sock if getattr(sock, "family", None) in _LOWAT_FAMILIES else None
        self._max_lowat = RECEIVE_LOWAT_NBYTES if clock is None else \
            max(1, min(RECEIVE_LOWAT_NBYTES, int(clock.rate * clock.grace_s / 4)))
        self._lowat = 1  # the socket's SO_RCVLOWAT now (1: the kernel's default)
        transport.set_protocol(self)
        self.leftover = request.content.read_nowait(-1)  # what aiohttp buffered already
        self._pause()
        # aiohttp cancels a request's body reads by an exception on ``request.content`` (its
        # shutdown, the connection's loss): its fills must see it too
        self._closed = False
        self._watch = asyncio.ensure_future(request.content.wait_eof())
        self._watch.add_done_callback(self._content_done)

    @classmethod
    def take(cls, request: web.Request, block_nbytes: int, clock: BodyClock | None = None) -> "BodyReceiver | None":
        """A receiver for the rest of ``request``'s body (frames of blocks of
        ``block_nbytes`` bytes), or ``None`` where aiohttp's reads stay: no ``Content-Length``,
        a ``Content-Length`` under :data:`RECEIVE_MIN_NBYTES`, blocks under
        :data:`RECEIVE_MIN_BLOCK_NBYTES`, TLS, a transport already closing or handed to
        another protocol. Decided on the whole body, not on what aiohttp happened to buffer
        before the handler ran (up to ~750 KiB on uvloop): the same put takes the same path
        whatever the timing (the hostile-client review of the keep-alive change). ``clock``
        (the body's): its grace and minimum rate cap how many bytes a fill lets queue
        (:data:`RECEIVE_LOWAT_NBYTES`)."""
        transport, content, length = request.transport, request.content, request.content_length
        if length is None or block_nbytes < RECEIVE_MIN_BLOCK_NBYTES or length < RECEIVE_MIN_NBYTES:
            return None  # most puts: aiohttp's reads
        if transport is None or transport.is_closing() or content.at_eof() \
                or transport.get_extra_info("sslcontext") is not None \
                or transport.get_protocol() is not request.protocol or not hasattr(transport, "set_protocol") \
                or content.exception() is not None or "chunked" in request.headers.get("Transfer-Encoding", "").lower():
            return None
        return cls(request, transport, length - content.total_bytes, clock)

    def landed(self) -> int:
        """Bytes landed so far in the fill now waiting (0 when none waits)."""
        return self._filled if self._waiter is not None else 0

    @property
    def available(self) -> int:
        """Body bytes not yet handed to a fill."""
        return self.remaining + len(self._stash)

    def fill(self, view: memoryview, digest=None) -> asyncio.Future:
        """A future done once ``view`` (writable, format ``B``, at most :attr:`available`
        bytes) holds the body's next ``len(view)`` bytes, each fed to ``digest`` (a running
        hash with ``update``) as it landed. Fails with ``ConnectionResetError`` when the
        connection closes or the client ends its side first. Cancelling the future gives
        ``view`` back: no byte is written into it afterwards.

        Raises:
            RuntimeError: another fill is still waiting (one at a time).
            ValueError: ``view`` reaches past the body's end.
        """
        if self._waiter is not None and not self._waiter.done():
            raise RuntimeError("a fill is already waiting")
        if len(view) > self.available:
            raise ValueError(f"a fill of {len(view)} bytes past the body's end ({self.available} left)")
        waiter = asyncio.get_running_loop().create_future()
        taken = min(len(self._stash), len(view))
        if taken:
            view[:taken] = self._stash[:taken]
            del self._stash[:taken]
            if digest is not None:
                digest.update(view[:taken])
        if taken == len(view):
            waiter.set_result(None)
            return waiter
        if self._error is not None:
            waiter.set_exception(self._error)
            return waiter
        self._target, self._filled, self._digest, self._waiter = view, taken, digest, waiter
        waiter.add_done_callback(self._fill_done)
        self._set_lowat(self.remaining)
        self._resume()
        return waiter

    def close(self, consumed: bool) -> None:
        """The body is done with. ``consumed`` (the whole body was read): the connection goes
        back to aiohttp for its next request (keep-alive, :func:`fresh_parser`), or where this
        aiohttp cannot be given a fresh parser, it closes after the reply (aiohttp's
        ``RequestHandler.close``; ``request[CLOSE_AFTER]`` asks the reply to say so) and
        whatever the client sends after the body is read and dropped until then (unread bytes
        at a close would make the kernel answer with a reset, which can destroy the reply
        before the client reads it: a client that pipelined its next request). Else (an error
        before the body's end) the connection is reset."""
        self._target = self._digest = None
        if not self._closed:
            self._closed = True
            self._watch.cancel()
        if self._lost or self._discard is not None or self._handed_back:
            return
        consumed = consumed and not self.available
        if consumed and self._hand_back():
            return
        self.request[CLOSE_AFTER] = True
        self.inner.close()  # aiohttp closes the connection once the reply is sent
        if consumed:
            self.request.content.feed_eof()
            self._discard = memoryview(bytearray(_DISCARD_NBYTES))
            self._resume()
        else:
            reset(self.transport)

    def _hand_back(self) -> bool:
        """The transport back to aiohttp's protocol with a fresh HTTP parser (the old one still
        waits for the body it never saw), reading again unless aiohttp paused it: the next
        request on this connection is aiohttp's as usual. ``False`` (nothing changed) where
        this aiohttp gives no fresh parser or the connection failed."""
        if self._error is not None or self.transport.is_closing():
            return False
        fresh = fresh_parser(self.inner)
        if fresh is None:
            return False
        self.request.content.feed_eof()  # aiohttp's view of this body ends: no lingering read
        setattr(self.inner, *fresh)
        self.transport.set_protocol(self.inner)
        self._handed_back = True
        # uvloop's transport keeps the old protocol's bound methods: hold nothing of this
        # request (its headers, what aiohttp had buffered: up to ~2.5 MiB a kept connection)
        self.request = self.leftover = self._spare = None
        self._stash = bytearray()
        if not getattr(self.inner, "_reading_paused", False) and not getattr(self.inner, "_buffer_paused", False):
            self.transport.resume_reading()
        return True

    # -- asyncio.BufferedProtocol ---------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._discard is not None:
            return self._discard
        if self._target is not None and not self._waiter.done():  # (a cancelled fill: not)
            self._spare = None
            return self._target[self._filled : self._filled + min(self.remaining, RECEIVE_READ_NBYTES)]
        # no fill waiting: a frame prefix ahead, kept for the next fill
        self._spare = memoryview(bytearray(max(1, min(_PREFIX_NBYTES - len(self._stash), self.remaining))))
        return self._spare

    def buffer_updated(self, nbytes: int) -> None:
        if self._discard is not None:
            return
        if nbytes > self.remaining:  # past the body (only from a read that raced a pause)
            self._fail(ConnectionResetError("the client sent more than its Content-Length"))
            return
        self.remaining -= nbytes
        if self.remaining < self._lowat:  # the body's end nears: never wait past it; at its end
            self._set_lowat(self.remaining)  # the mark is 1, as aiohttp's next request needs
        if self._spare is None:  # into the fill's view (get_buffer chose it)
            start = self._filled
            self._filled += nbytes
            if self._digest is not None:
                self._digest.update(self._target[start : self._filled])
            if self._filled == len(self._target):
                waiter = self._waiter
                self._target = self._digest = self._waiter = None
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
        else:
            self._stash += self._spare[:nbytes]
            self._spare = None
            if len(self._stash) >= _PREFIX_NBYTES:
                self._pause()
        if not self.remaining:
            self._pause()

    def eof_received(self) -> bool | None:
        self._fail(ConnectionResetError("the client ended its side inside the body"))
        return self.inner.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._fail(ConnectionResetError("the client went away inside the body"))
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- internals ------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        waiter, self._waiter = self._waiter, None
        self._target = self._digest = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(self._error)

    def _content_done(self, watch: asyncio.Future) -> None:
        if self._closed:
            return
        if watch.cancelled() or watch.exception() is not None:
            self._fail(ConnectionResetError("the request's body reads were cancelled (shutdown, connection lost)"))

    def _fill_done(self, waiter: asyncio.Future) -> None:
        if waiter.cancelled() and self._waiter is waiter:  # the view is the caller's again
            self._target = self._digest = self._waiter = None
            self._set_lowat(1)
            self._pause()

    def _set_lowat(self, nbytes: int) -> None:
        """The socket's ``SO_RCVLOWAT`` to ``nbytes`` (within 1 and the cap), one system call
        only when it changes (:data:`RECEIVE_LOWAT_NBYTES`). A socket that refuses it (closed under
        the call) is left alone from then on."""
        nbytes = max(1, min(nbytes, self._max_lowat))
        if nbytes == self._lowat or self._sock is None or self._lost or self.transport.is_closing():
            return  # (a closed transport's descriptor may already be another connection's)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self._lowat = nbytes
        except (OSError, ValueError):
            self._sock = None

    def _pause(self) -> None:
        if self._reading and not self._lost:
            self._reading = False
            self.transport.pause_reading()

    def _resume(self) -> None:
        if not self._reading and not self._lost:
            self._reading = True
            self.transport.resume_reading()
