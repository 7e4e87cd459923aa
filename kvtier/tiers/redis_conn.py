"""The redis-py connections under :class:`kvtier.tiers.redis.RedisTier`: zero-copy record
values out, and every call bounded in time and in the bytes it reads back.

Copies: a ``SET`` sends the record header and then the block's own memory (redis-py's Python
command packer passes large buffers to ``sendall`` untouched; the hiredis packer, used
whenever hiredis is installed, copies each value twice, so :func:`client_options` names the
Python one); the checksum is computed over the block in place.

Limits (issue 12: "a Redis that is slow only costs misses, never a hang"): a call runs inside
:func:`call_budget`, a per-thread budget that the guarded connections enforce below redis-py:

- a **deadline** for the whole call: before each socket read or write the socket's timeout is
  cut to the time left (and a connect waits at most that long), so a server that trickles its
  reply a byte at a time (each read well within the socket timeout) still ends the call on
  time. redis-py turns the expiry into its ``TimeoutError`` and drops the connection (a reply
  read half way must never be taken for the next one);
- a **reply-size cap**: no bulk string longer than the call can need is read (its length is
  checked before a byte of it is buffered), and no call reads more bytes in all than its
  replies can hold; either raises :class:`ReplyTooLarge` and drops the connection. So a huge
  reply to a small call costs at most the cap plus one socket read in memory.

The guarded connections speak RESP2 with redis-py's Python parser (the one parser whose
buffer can be bounded; hiredis's reader reads a bulk string whole). They are what RedisTier
uses; the plain ones (:class:`_Connection`) are the baseline of bench/server.py.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

try:
    import redis
    from redis._parsers import _RESP2Parser
    from redis._parsers.socket import SocketBuffer
    from redis.connection import Connection, PythonRespSerializer, SSLConnection
    from redis.exceptions import InvalidResponse
except ImportError:  # only RedisTier needs it
    redis = None  # type: ignore[assignment]

from kvtier.records import encode_header, encode_record
from kvtier.types import NO_FINGERPRINT

MIN_RATE_BYTES_PER_S = 64 << 20
"""A call may take its ``timeout_s`` plus the bytes it moves at this rate (the daemon's client
uses the same rule for its streamed gets)."""

SMALL_REPLY_NBYTES = 1 << 20
"""Longest bulk string any call may read (a call that reads records: at least one record and
a byte). Besides records, replies hold specs, errors and, on a cluster, the topology that
redis-py discovers inside any call (``CLUSTER NODES`` is ~150 bytes per node)."""

REPLY_SLACK_NBYTES = 4 << 20
"""Bytes any call may read beyond its replies' own size: a cluster's topology discovery
(``COMMAND``, ``CLUSTER SLOTS``: a few hundred KiB on Redis 7) may run inside any call."""

_READ_NBYTES = 1 << 20
"""Socket reads of 1 MiB (redis-py's default is 64 KiB): a 2 MiB block's reply in 2 reads."""


# -- per-call budgets ------------------------------------------------------------------------
@dataclass(slots=True)
class Budget:
    """What one RedisTier call may still spend: ``deadline`` (``time.monotonic()``), the
    longest bulk string (bytes), and the bytes read in all (``received`` so far)."""

    deadline: float
    max_bulk: int
    max_total: int
    received: int = 0

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


_CURRENT = threading.local()


def current_budget() -> Budget | None:
    """The budget of the call running on this thread, or ``None``."""
    return getattr(_CURRENT, "budget", None)


@contextlib.contextmanager
def call_budget(timeout_s: float, nbytes: int = 0, max_bulk: int = 0, reply_nbytes: int = 0) -> Iterator[Budget]:
    """Bound the redis-py calls made on this thread inside the block.

    Args:
        timeout_s: seconds for the call, plus ``nbytes`` at :data:`MIN_RATE_BYTES_PER_S`.
        nbytes: bytes the call moves (records sent or expected back).
        max_bulk: the longest bulk string its replies may hold, bytes (at least
            :data:`SMALL_REPLY_NBYTES`).
        reply_nbytes: the most bytes its replies can take; it may read that plus
            :data:`REPLY_SLACK_NBYTES`.

    A call nested in another (a registration inside a lookup) spends the outer budget.
    """
    outer = current_budget()
    if outer is not None:
        yield outer
        return
    budget = Budget(time.monotonic() + timeout_s + nbytes / MIN_RATE_BYTES_PER_S,
                    max(max_bulk, SMALL_REPLY_NBYTES), reply_nbytes + REPLY_SLACK_NBYTES)
    _CURRENT.budget = budget
    try:
        yield budget
    finally:
        _CURRENT.budget = None


class _GuardedSocket:
    """A connected socket whose reads and writes end at the current call's deadline and whose
    reads count against its byte budget (every other attribute is the socket's own)."""

    __slots__ = ("_sock", "_timeout", "_applied")

    def __init__(self, sock) -> None:
        self._sock = sock
        self._timeout = self._applied = sock.gettimeout()  # what redis-py asked for; what is set

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = self._applied = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> Budget | None:
        budget = current_budget()
        want = self._timeout
        if budget is not None:
            left = budget.remaining_s()
            if left <= 0:
                raise socket.timeout("kvtier: the call's deadline passed")
            if want is None or want > left:
                want = left
        applied = self._applied
        # Re-arm when the time left fell 10 ms below the timeout set, not on every read (a
        # read may then outlast the deadline by those 10 ms at most).
        if want != applied and (applied is None or want is None or want < applied - 0.01 or want > applied):
            self._sock.settimeout(want)
            self._applied = want
        return budget

    def recv(self, bufsize: int, *flags: int) -> bytes:
        budget = self._arm()
        data = self._sock.recv(bufsize, *flags)
        if budget is not None:
            budget.received += len(data)
            if budget.received > budget.max_total:
                raise ReplyTooLarge(f"replies of more than {budget.max_total} bytes to one call")
        return data

    def recv_into(self, buffer, nbytes: int = 0, *flags: int) -> int:
        budget = self._arm()
        n = self._sock.recv_into(buffer, nbytes, *flags)
        if budget is not None:
            budget.received += n
            if budget.received > budget.max_total:
                raise ReplyTooLarge(f"replies of more than {budget.max_total} bytes to one call")
        return n

    def sendall(self, data, *flags: int) -> None:
        self._arm()
        self._sock.sendall(data, *flags)

    def send(self, data, *flags: int) -> int:
        self._arm()
        return self._sock.send(data, *flags)


if redis is not None:

    class ReplyTooLarge(InvalidResponse):
        """A reply longer than the call can need (a bulk string or the call's replies in all)."""

    class _BoundedBuffer(SocketBuffer):
        """redis-py's socket buffer, refusing a bulk string longer than the budget allows
        before reading it (``read`` is where every parser reads a bulk string's body)."""

        def read(self, length: int, *args: Any, **kwargs: Any) -> bytes:
            budget = current_budget()
            if budget is not None and length > budget.max_bulk:
                raise ReplyTooLarge(f"a bulk string of {length} bytes (at most {budget.max_bulk} expected)")
            return super().read(length, *args, **kwargs)

    class _BoundedParser(_RESP2Parser):
        """redis-py's Python RESP2 parser over a :class:`_BoundedBuffer`."""

        def on_connect(self, connection) -> None:
            super().on_connect(connection)
            self._buffer = _BoundedBuffer(self._sock, self.socket_read_size, connection.socket_timeout)
else:  # pragma: no cover - without redis-py nothing here is used

    class ReplyTooLarge(Exception):  # type: ignore[no-redef]
        pass


# -- zero-copy record values -----------------------------------------------------------------
class _RecordValue:
    """A ``SET`` value sent as two buffers: the record header (kvtier.records.encode_header,
    which hashes the block in place) and the block's own memory, so the record is never
    assembled in a new buffer. Only :class:`_Packer` knows how to send it."""

    __slots__ = ("header", "payload")

    def __init__(self, namespace: bytes, block: torch.Tensor, fingerprint: bytes = NO_FINGERPRINT) -> None:
        self.header = encode_header(namespace, block, 0, fingerprint)
        self.payload = memoryview(block.view(torch.uint8).numpy().reshape(-1))

    def __len__(self) -> int:
        return len(self.header) + len(self.payload)


if redis is not None:

    class _Packer(PythonRespSerializer):
        """redis-py's Python command packer (large arguments go to ``sendall`` as they are,
        where the hiredis packer, used whenever hiredis is installed, copies each one twice),
        plus :class:`_RecordValue` arguments written as header, payload, ``CRLF``."""

        def pack(self, *args):
            if not any(isinstance(arg, _RecordValue) for arg in args):
                return super().pack(*args)
            output: list = []
            pieces = [b"*%d\r\n" % len(args)]
            for arg in args:
                if isinstance(arg, _RecordValue):
                    pieces += [b"$%d\r\n" % len(arg), arg.header]
                    output += [b"".join(pieces), arg.payload]
                    pieces = [b"\r\n"]
                else:
                    arg = self.encode(arg)
                    pieces += [b"$%d\r\n" % len(arg), arg, b"\r\n"]
            output.append(b"".join(pieces))
            return output

    class _PackWithRecords:
        """Connection mixin: commands are packed by :class:`_Packer`; replies are parsed as
        usual (by hiredis when it is installed). ``_construct_command_packer`` is redis-py's
        hook for the packer (a release without it gets whole records: :func:`record_value`)."""

        def _construct_command_packer(self, packer):
            if packer is None:
                return _Packer(getattr(self, "_buffer_cutoff", 6000), self.encoder.encode)
            return super()._construct_command_packer(packer)

    class _Guards:
        """Connection mixin: RESP2 through :class:`_BoundedParser`, a socket that keeps the
        current call's budget (:class:`_GuardedSocket`), and a connect that waits at most the
        time the call has left."""

        def __init__(self, **kwargs: Any) -> None:
            kwargs["protocol"] = 2
            kwargs["parser_class"] = _BoundedParser
            super().__init__(**kwargs)

        def _connect(self):
            budget = current_budget()
            configured = self.socket_connect_timeout
            if budget is not None:
                left = budget.remaining_s()
                if left <= 0:
                    raise socket.timeout("kvtier: the call's deadline passed")
                self.socket_connect_timeout = left if configured is None else min(configured, left)
            try:
                return _GuardedSocket(super()._connect())
            finally:
                self.socket_connect_timeout = configured

    class _Connection(_PackWithRecords, Connection):
        pass

    class _SSLConnection(_PackWithRecords, SSLConnection):
        pass

    class _GuardedConnection(_Guards, _Connection):
        pass

    class _GuardedSSLConnection(_Guards, _SSLConnection):
        pass


def client_options(timeout_s: float, tls: bool = False, guarded: bool = False) -> dict[str, Any]:
    """redis-py client options: ``timeout_s`` for connects and socket reads/writes, 1 MiB
    socket reads, connections that send large ``bytes``/``memoryview`` arguments without
    copying them, and (``guarded``: RedisTier's) the per-call budgets of :func:`call_budget`
    on RESP2. Unguarded, it is bench/server.py's raw redis-py baseline, so that RedisTier
    differs from it only by the records and the guards."""
    if guarded:
        connection_class = _GuardedSSLConnection if tls else _GuardedConnection
    else:
        connection_class = _SSLConnection if tls else _Connection
    options = dict(
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, socket_read_size=_READ_NBYTES,
        connection_class=connection_class,
    )
    if guarded:
        options["protocol"] = 2  # what the guarded connections speak: the client's reply callbacks must agree
    return options


def record_value(namespace: bytes, block: torch.Tensor, fingerprint: bytes = NO_FINGERPRINT):
    """The ``SET`` value of ``block``'s record (with its token ``fingerprint``, 32 bytes):
    zero-copy where redis-py has the packer hook."""
    if hasattr(Connection, "_construct_command_packer"):
        return _RecordValue(namespace, block, fingerprint)
    return memoryview(encode_record(namespace, block, 0, fingerprint))
