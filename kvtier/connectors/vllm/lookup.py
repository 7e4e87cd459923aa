"""Scheduler -> worker lookups over a Unix socket (the store lives in the worker process).

vLLM runs the scheduler-side connector in the engine-core process and the worker-side one in
each worker process. kvtier's store (its CPU pool, its DISK directory, which one process
owns) lives with the worker; the scheduler asks it, per request, how many blocks it can
supply: LMCache's lookup client/server split. One :class:`LookupServer` per worker (TP rank)
listens on ``<tmp>/kvtier-<uid>/<engine_id>-dp<r>-tp<r>.sock`` (a directory only this user can
enter); the scheduler's :class:`LookupClient` asks every rank and takes the shortest answer.
A starting server removes the sockets of killed engines from that directory.

Messages are msgpack arrays, one request and one reply at a time per connection::

    request: ["match", request_id, [block_hash, ...], wait_s, [fingerprint, ...]]
    reply:   [num_blocks | None, [medium, ...]]     None: a load is still in flight
    request: ["drop", request_id]  ->  reply: [0, []]
    request: ["reset", ""]         ->  reply: [0, []]   every tier of the worker's store emptied

A client that gets no reply within its timeout (or cannot connect) treats the lookup as a
miss and reconnects next time, so a stuck or dead worker never stalls the scheduler; the
connection is closed so that a late reply is never read as the answer to a later request.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener

import msgpack

logger = logging.getLogger(__name__)

MatchReply = tuple["int | None", list[str]]
"""``(num_blocks, media)``: leading blocks ready in the worker's CPU pool (``None``: not yet
known, ask again), and the medium each came from."""

Handler = Callable[[str, str, list[bytes], float, "list[bytes] | None"], MatchReply]
"""``handler(op, request_id, block_hashes, wait_s, fingerprints)`` run by the server for each
request (``fingerprints``: the blocks' token fingerprints, ``None`` when not sent)."""


def socket_dir() -> str:
    """``<tmp>/kvtier-<uid>``, created with mode 0700 (only this user connects)."""
    path = os.path.join(tempfile.gettempdir(), f"kvtier-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid != os.getuid():
        raise PermissionError(f"expected {path} to belong to uid {os.getuid()}")
    return path


def socket_path(engine_id: str, dp_rank: int, tp_rank: int) -> str:
    """Socket of one worker's lookup server (AF_UNIX paths are limited to ~107 bytes)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(engine_id))[:48]
    return os.path.join(socket_dir(), f"{safe}-dp{dp_rank}-tp{tp_rank}.sock")


def sweep_stale_sockets(directory: str) -> list[str]:
    """Remove the ``*.sock`` files in ``directory`` that nothing listens on (left by engines
    that were killed); returns their paths. A live server's socket is kept."""
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".sock"):
            continue
        try:
            Client(path, family="AF_UNIX").close()
        except OSError:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass  # another process swept it first
    return removed


class LookupServer:
    """Accepts connections on ``path`` and answers each request with ``handler`` on its own
    thread (one per connection; a handler exception is logged and answered as a miss).

    Raises:
        RuntimeError: another live server already listens on ``path`` (two engines with one
            ``engine_id``).
    """

    def __init__(self, path: str, handler: Handler) -> None:
        self.path, self._handler = path, handler
        sweep_stale_sockets(os.path.dirname(path))
        if os.path.exists(path):
            raise RuntimeError(f"another kvtier lookup server listens on {path}; set a distinct engine_id")
        self._listener = Listener(path, family="AF_UNIX")
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while not self._closed:
                try:
                    message = msgpack.unpackb(conn.recv_bytes(), raw=False)
                except (EOFError, OSError):
                    return
                except Exception:  # a malformed message: drop this connection
                    logger.warning("kvtier lookup: malformed request; closing the connection", exc_info=True)
                    return
                try:
                    op, request_id, hashes, wait_s, fingerprints = _request_fields(message)
                    if fingerprints is not None:
                        fingerprints = [bytes(f) for f in fingerprints]
                    reply = self._handler(
                        str(op), str(request_id), [bytes(h) for h in hashes], float(wait_s), fingerprints
                    )
                except Exception:
                    logger.exception("kvtier lookup: handler failed; answering a miss")
                    reply = (0, [])
                try:
                    conn.send_bytes(msgpack.packb(list(reply), use_bin_type=True))
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _request_fields(message: list) -> tuple:
    """``(op, request_id, block_hashes, wait_s, fingerprints)`` of a request, the fields it
    does not carry at their defaults (a drop carries two)."""
    defaults = ["", "", [], 0.0, None]
    fields = list(message)[:5]
    return tuple(fields + defaults[len(fields) :])


class LookupClient:
    """The scheduler's end: one connection per TP rank's server, opened lazily.

    Args:
        paths: socket path of every rank, rank order.
        timeout_s: seconds to wait for a connection or a reply before answering a miss.
    """

    def __init__(self, paths: list[str], timeout_s: float = 10.0) -> None:
        self.paths, self.timeout_s = list(paths), timeout_s
        self._conns: list[Connection | None] = [None] * len(self.paths)
        self._lock = threading.Lock()
        self._last_warning = 0.0

    def match(
        self, request_id: str, hashes_by_rank: list[list[bytes]], wait_s: float,
        fingerprints_by_rank: list[list[bytes]] | None = None,
    ) -> MatchReply:
        """Ask every rank (with the blocks' token fingerprints on that rank, checked by its
        store); the answer is the shortest prefix any rank can supply (``None`` while any
        rank is still loading). Unreachable or silent ranks count as a miss."""
        fingerprints = fingerprints_by_rank or [None] * len(hashes_by_rank)
        replies = self._ask_all(
            [["match", request_id, hashes, wait_s, fps] for hashes, fps in zip(hashes_by_rank, fingerprints)]
        )
        if replies is None:
            return 0, []
        if any(n is None for n, _ in replies):
            return None, []
        n, media = min(replies, key=lambda r: r[0])
        return n, media[:n]

    def drop(self, request_id: str) -> None:
        """Release the blocks the ranks hold for ``request_id`` (best effort)."""
        self._ask_all([["drop", request_id, [], 0.0]] * len(self.paths))

    def reset(self) -> bool:
        """Empty every rank's store (``TieredStore.reset``); ``True`` when every rank
        answered within the timeout (one that did not may still finish its reset)."""
        return self._ask_all([["reset", "", [], 0.0]] * len(self.paths)) is not None

    def _ask_all(self, messages: list[list]) -> list[MatchReply] | None:
        with self._lock:
            try:
                conns = [self._connect(rank) for rank in range(len(self.paths))]
                for conn, message in zip(conns, messages):
                    conn.send_bytes(msgpack.packb(message, use_bin_type=True))
                replies = []
                for rank, conn in enumerate(conns):
                    if not conn.poll(self.timeout_s):
                        raise TimeoutError(f"no reply from {self.paths[rank]} within {self.timeout_s} s")
                    n, media = msgpack.unpackb(conn.recv_bytes(), raw=False)
                    replies.append((n, list(media)))
                return replies
            except (OSError, EOFError, TimeoutError, ValueError) as exc:
                self._reset()
                now = time.monotonic()
                if now - self._last_warning > 60:
                    self._last_warning = now
                    logger.warning("kvtier lookup failed (%s); treating it as a miss", exc)
                return None

    def _connect(self, rank: int) -> Connection:
        conn = self._conns[rank]
        if conn is None:
            conn = self._conns[rank] = Client(self.paths[rank], family="AF_UNIX")
        return conn

    def _reset(self) -> None:
        for conn in self._conns:
            if conn is not None:
                try:
                    conn.close()
                except OSError:
                    pass
        self._conns = [None] * len(self.paths)

    def close(self) -> None:
        with self._lock:
            self._reset()
