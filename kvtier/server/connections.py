"""Deadlines and budgets of the daemon's connections (issue 12: "nothing times out").

What bounds what:

============================  ======================================================================
idle                          a connection with no call in progress is closed after
                              ``idle_timeout_s``: idle keep-alives, and requests whose headers never
                              finish (slowloris); aiohttp's own keep-alive timer says the same
call                          a call that streams no blocks is cut after ``request_timeout_s`` (admin
                              calls excepted: they close and reopen stores)
put body (:class:`BodyClock`) reads may wait ``grace_s + bytes / min_rate`` in all (time the
                              daemon spends storing does not count); chunked bodies too
get response (``BodyClock``)  writes may wait ``grace_s + bytes / min_rate`` in all
connections                   at most ``max_connections``: a new one closes the longest idle, or is
                              closed itself when every connection is busy
staging (:class:`Budget`)     bytes of staging buffers of all puts together; one put holds at most
                              two buffers (HTTP/1.1: one call per connection at a time)
pins (:class:`Budget`)        blocks that gets in flight pin in a namespace's top pool together;
                              one get holds at most two chunks
============================  ======================================================================

On expiry the connection is aborted and its call's task cancelled: the handler's ``finally``
blocks release its leases and staging buffers at once. Enforced by :class:`Supervisor`, which
the daemon attaches to its aiohttp server (:meth:`Supervisor.attach`) and whose
:meth:`Supervisor.middleware` marks each call's start and end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from kvtier.server.errors import LOG, Handler

logger = logging.getLogger(__name__)

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11

TICK_S = 0.25
"""Seconds between two checks of every connection."""


class Expired(Exception):
    """A body read or a response write ran out of time: the caller is too slow."""


@dataclass(eq=False)
class Conn:
    """One connection: busy (a call in progress, with a deadline) or idle since ``since``."""

    transport: asyncio.Transport
    since: float
    task: asyncio.Task | None = None
    deadline: float | None = None

    @property
    def busy(self) -> bool:
        return self.task is not None

    def expire(self, why: str) -> None:
        LOG.log(logger, logging.INFO, f"expire {why}", "closing a connection: %s", why)
        reset(self.transport)
        if self.task is not None and not self.task.done():
            self.task.cancel()


def reset(transport: asyncio.BaseTransport | None) -> None:
    """Close a connection at once with a TCP reset: what the kernel still holds for a client
    that does not read is dropped too (a plain close would keep sending it)."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class Supervisor:
    """Every connection of one daemon and its deadlines (module docstring)."""

    def __init__(self, idle_timeout_s: float, request_timeout_s: float, max_connections: int) -> None:
        self.idle_timeout_s, self.request_timeout_s = idle_timeout_s, request_timeout_s
        self.max_connections = max_connections
        self.conns: dict[object, Conn] = {}
        self.closed = {"idle": 0, "deadline": 0, "over capacity": 0}
        self._task: asyncio.Task | None = None

    def attach(self, server: web.Server) -> None:
        """Watch the connections ``server`` (``runner.server``) accepts, and start checking."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            self.conns[handler] = conn = Conn(transport, time.monotonic())
            if len(self.conns) > self.max_connections:
                idle = [c for c in self.conns.values() if not c.busy and c is not conn]
                victim = min(idle, key=lambda c: c.since) if idle else conn
                self.closed["over capacity"] += 1
                victim.expire(f"over --max-connections {self.max_connections}")

        def connection_lost(handler, exc=None) -> None:
            self.conns.pop(handler, None)
            lost(handler, exc)

        server.connection_made, server.connection_lost = connection_made, connection_lost
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def abort_all(self) -> None:
        """Close every connection now (shutdown)."""
        for conn in list(self.conns.values()):
            reset(conn.transport)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        for conn in list(self.conns.values()):
            if conn.busy:
                if conn.deadline is not None and now > conn.deadline:
                    self.closed["deadline"] += 1
                    conn.expire("a call over its deadline")
            elif now - conn.since > self.idle_timeout_s:
                self.closed["idle"] += 1
                conn.expire(f"no request for {self.idle_timeout_s:g} s")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Mark the call in progress (deadline ``request_timeout_s`` unless it streams)."""
        conn = self.begin(request)
        try:
            return await handler(request)
        finally:
            self.end(conn)

    def begin(self, request: web.Request) -> Conn | None:
        """The call of ``request`` starts: its connection is busy, with the call deadline
        (``None``: a test server without the supervisor). Pair with :meth:`end`."""
        conn = self.conns.get(request.protocol)
        if conn is not None:
            conn.task, conn.deadline = asyncio.current_task(), time.monotonic() + self.request_timeout_s
        return conn

    @staticmethod
    def end(conn: Conn | None) -> None:
        """The call is over (answered, failed or cancelled): the connection is idle from now."""
        if conn is not None:
            conn.task, conn.deadline, conn.since = None, None, time.monotonic()


SUPERVISOR = web.AppKey("supervisor", Supervisor)


def own_deadline(request: web.Request) -> None:
    """Not ``request_timeout_s`` for this call: it bounds itself (a stream of blocks: its
    :class:`BodyClock`) or may take long by design (an admin emptying every namespace)."""
    supervisor = request.app.get(SUPERVISOR)
    conn = supervisor.conns.get(request.protocol) if supervisor is not None else None
    if conn is not None:
        conn.deadline = None


class BodyClock:
    """Time a streamed body may spend waiting on the peer: ``grace_s + nbytes / min_rate``
    in all, ``nbytes`` the bytes moved so far (a write's own bytes count from its start: the
    daemon knows how many it sends; a read's only once they came). Only the waiting counts:
    the daemon's own work between two steps does not."""

    def __init__(self, grace_s: float, min_rate_bytes_per_s: int) -> None:
        self.grace_s, self.rate = grace_s, min_rate_bytes_per_s
        self.waited_s = 0.0
        self.nbytes = 0

    async def read(self, awaitable):
        """Await a read (``bytes``); raises :class:`Expired`."""
        data = await self._wait(awaitable, 0)
        self.nbytes += len(data)
        return data

    async def write(self, awaitable, nbytes: int) -> None:
        """Await a write (or a drain) of ``nbytes``; raises :class:`Expired`."""
        await self._wait(awaitable, nbytes)
        self.nbytes += nbytes

    async def receive(self, fill: asyncio.Future, nbytes: int, landed) -> None:
        """Await a fill of ``nbytes`` (kvtier.server.streams.BodyReceiver.fill), its bytes
        counted as they land (``landed()``: how many so far), as a read's are: a client that
        stops sending is cut ``grace_s`` after its last byte's allowance, however large the
        fill. Raises :class:`Expired`; the fill is cancelled whenever this returns without it
        (its buffer is the caller's again). A fill already done costs no wait."""
        if not fill.done():
            start = time.monotonic()
            try:
                while not fill.done():
                    allowed = self._allowed(landed()) - (time.monotonic() - start)
                    if allowed <= 0:
                        raise self._expired()
                    await asyncio.wait((fill,), timeout=allowed)
            finally:
                self.waited_s += time.monotonic() - start
                if not fill.done():
                    fill.cancel()
                elif not fill.cancelled():
                    fill.exception()  # retrieved (a cancel of this task may have raced its failure)
        fill.result()
        self.nbytes += nbytes

    def _allowed(self, ahead: int) -> float:
        """Seconds the next wait may take: ``grace_s`` plus the allowance of the bytes moved
        and ``ahead`` (counted before they move), less the time waited so far."""
        return self.grace_s + (self.nbytes + ahead) / self.rate - self.waited_s

    def _expired(self) -> "Expired":
        return Expired(f"slower than {self.rate} bytes/s after {self.grace_s:g} s of grace")

    async def _wait(self, awaitable, ahead: int):
        allowed = self._allowed(ahead)
        start = time.monotonic()
        try:
            if allowed <= 0:
                raise asyncio.TimeoutError
            if _timeout is None:  # Python 3.10
                return await asyncio.wait_for(awaitable, allowed)
            async with _timeout(allowed):  # no task per step, unlike wait_for before 3.12
                return await awaitable
        except asyncio.TimeoutError:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise self._expired() from None
        finally:
            self.waited_s += time.monotonic() - start


class Budget:
    """A count shared by concurrent calls (staging bytes, pinned blocks): :meth:`take` what
    is free, waiting up to ``timeout_s`` for some; :meth:`give` back. Event-loop only."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self._freed = asyncio.Event()

    @property
    def free(self) -> int:
        return self.capacity - self.used

    async def take(self, want: int, timeout_s: float, least: int = 1) -> int:
        """Take up to ``want`` (at least ``least``, or nothing: 0) within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.free < min(least, want):
            self._freed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return 0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)
        got = min(want, self.free)
        self.used += got
        return got

    def give(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0, "budget given back more than taken"
        self._freed.set()

    @contextlib.asynccontextmanager
    async def holding(self, want: int, timeout_s: float, least: int = 1) -> AsyncIterator[int]:
        got = await self.take(want, timeout_s, least)
        try:
            yield got
        finally:
            if got:
                self.give(got)
