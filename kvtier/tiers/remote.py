"""REMOTE tier over HTTP: the client of a ``kvtier serve`` daemon (kvtier.server).

Implements :class:`kvtier.tiers.backend.RemoteBackend`: blocking, thread-safe calls for the
store's I/O threads, one connection pool (urllib3) per daemon. Wire format: kvtier.wire.

Failures are misses, never exceptions or hangs (the backend contract):

- every call is bounded: connect and read timeouts of ``timeout_s`` per attempt, and a
  streamed get gives up after ``timeout_s`` plus its size at 64 MiB/s;
- fast failures (connection refused or reset, a pooled connection the daemon closed when it
  restarted) are retried with backoff (all calls are idempotent: blocks are named by their
  content hash); timeouts are not retried (a slow daemon would double the wait);
- after a failed call the daemon is treated as down for a pause (kvtier.tiers.backoff:
  ``backoff_s``, doubling up to ``max_backoff_s``): calls in that pause return a miss at
  once, counted as ``skipped``, so an inference loop never waits on a dead daemon more than
  once per pause; the first call after it tries again (reconnects);
- ``errors`` counts by reason: ``unavailable``, ``timeout``, ``skipped``, ``corrupt``,
  ``protocol``, ``unauthorized``, ``rejected`` (a 4xx other than 401/404/409; a namespace
  whose spec the daemon refuses is not asked for again until ``register`` is called),
  ``unregistered`` (404), ``conflict`` (409 on a lazy registration);
- a namespace registered while the daemon was down (or deleted on it since) is registered
  again lazily, before the next call that needs it.

Reads are verified block by block: hash, namespace, dtype, shape and size from the header
before the payload is read, then the xxh3 checksum over the bytes as they land in the
caller's tensor, then the block's token fingerprint against the caller's (the daemon sends
what it stores and checks nothing for the client: a daemon cannot be trusted to). A block
that fails is ``CORRUPT`` or ``TOKEN_MISMATCH`` (counted as ``token_mismatch``), never ``OK``.
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import urllib3
from urllib3.exceptions import HTTPError, MaxRetryError, NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout
from urllib3.util.retry import Retry

from kvtier.checks import (
    BLOCK_HASH_NBYTES,
    check_block_hashes,
    check_fingerprints,
    check_namespace,
    expected_fingerprints,
    namespace_hex,
)
from kvtier.records import HEADER_NBYTES, ReadStatus, check_record, encode_header, failed_header_status, parse_header
from kvtier.tiers.backoff import MAX_S, MIN_S, Backoff
from kvtier.types import DTYPE_NAMES, NO_FINGERPRINT, BlockHash, KVSpec
from kvtier.wire import END, FRAMES, MSGPACK, block_bytes, frame_prefix, pack, spec_to_wire, unpack_map

logger = logging.getLogger(__name__)

_PIECE_NBYTES = 256 << 10
"""Payload bytes received then hashed at a time (stays in L2 between the two)."""
_COALESCE_NBYTES = 64 << 10
"""Frame pieces smaller than this are joined before sending (fewer send calls)."""
_MIN_RATE_BYTES_PER_S = 64 << 20
"""A streamed get may take ``timeout_s`` plus its size at this rate before it is cut off (a
daemon that trickles bytes never trips the per-read timeout)."""
_DEFAULT_MAX_BATCH = 256
"""Blocks per call until the daemon tells its --max-batch-blocks (at registration)."""


class _Retry(Retry):
    """Retries only fast failures: a timeout is not retried (the wait would double)."""

    def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
        if _is_timeout(error):
            raise MaxRetryError(_pool, url, error)
        return super().increment(method, url, response, error, _pool, _stacktrace)


def _is_timeout(error: object) -> bool:
    """A connect or read timeout (urllib3 makes a refused connection a kind of timeout)."""
    return isinstance(error, Urllib3Timeout) and not isinstance(error, NewConnectionError)


class _Failed(Exception):
    """A call that did not complete; ``reason`` is its ``errors`` key."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RemoteTier:
    """Client of a ``kvtier serve`` daemon.

    Args:
        url: ``http://host:port`` (or ``https://``) of the daemon.
        token: bearer token (``--token`` / ``KVTIER_TOKEN`` of the daemon).
        timeout_s: connect and read timeout of each attempt, seconds (a streamed get may take
            this plus its size at 64 MiB/s in all).
        max_connections: pooled keep-alive connections kept (more are opened when needed).
        retries: retries of a fast failure per call.
        backoff_s, max_backoff_s: how long the daemon counts as down after a failed call
            (doubling per consecutive failure), seconds (:class:`~kvtier.tiers.backoff.Backoff`).

    Raises:
        ValueError: a URL that is not ``http(s)://host[:port]``, backoff limits that are
            not ``0 < backoff_s <= max_backoff_s``.
    """

    def __init__(
        self, url: str, token: str | None = None, timeout_s: float = 2.0, *, max_connections: int = 16,
        retries: int = 2, backoff_s: float = MIN_S, max_backoff_s: float = MAX_S,
    ) -> None:
        parsed = urllib3.util.parse_url(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"expected a daemon URL like http://127.0.0.1:8765, got {url!r}")
        self.backoff = Backoff(backoff_s, max_backoff_s)
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.errors: Counter = Counter()
        self._base = (parsed.path or "").rstrip("/") + "/v1/namespaces/"
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._pool = urllib3.connection_from_url(
            self.url, maxsize=max_connections, block=False,
            timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
            retries=_Retry(total=retries, connect=retries, read=retries, redirect=0, status=0, other=0,
                           backoff_factor=backoff_s / 2, allowed_methods=None, raise_on_status=False),
        )
        self._lock = threading.Lock()
        self._specs: dict[bytes, KVSpec] = {}
        self._registered: set[bytes] = set()
        self._refused: set[bytes] = set()  # namespaces whose spec the daemon refused (400/413)
        self._logged: set[int] = set()  # HTTP statuses already logged as warnings
        self._max_batch = _DEFAULT_MAX_BATCH
        self._closed = False

    # -- the RemoteBackend protocol -------------------------------------------------------------
    def register(self, namespace: bytes, spec: KVSpec) -> None:
        """Declare ``namespace``'s block shape and dtype. Raises ``ValueError`` when the daemon
        knows it with another spec; a daemon that cannot be reached is retried lazily."""
        check_namespace(namespace)
        if not isinstance(spec, KVSpec):
            raise TypeError(f"expected a KVSpec, got {type(spec).__name__}")
        with self._lock:
            self._specs[namespace] = spec
            self._registered.discard(namespace)
            self._refused.discard(namespace)
        try:
            self._register(namespace, spec)
        except _Failed as exc:
            if exc.reason == "conflict":
                with self._lock:
                    self._specs.pop(namespace, None)
                raise ValueError(f"daemon {self.url} knows namespace {namespace_hex(namespace)} with another "
                                 f"block shape or dtype than {spec_to_wire(spec)}") from None
            self._count(exc.reason)

    def lookup(self, namespace: bytes, block_hashes: Sequence[BlockHash]) -> int:
        """Leading ``block_hashes`` the daemon holds (0 when it cannot be reached)."""
        check_namespace(namespace)
        hashes = check_block_hashes(block_hashes)
        num_hit = 0
        try:
            for start in range(0, len(hashes), self._max_batch):
                part = hashes[start : start + self._max_batch]
                reply = self._small_call(namespace, "lookup", {"block_hashes": part})
                n = reply.get("num_blocks")
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(part):
                    raise _Failed("protocol")
                num_hit += n
                if n < len(part):
                    break
        except _Failed as exc:
            self._count(exc.reason)
        return num_hit

    def get_into(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], outs: Sequence[torch.Tensor],
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[ReadStatus]:
        """Read blocks into ``outs[i]`` (contiguous CPU tensors ``[num_layers, 2, block_size,
        num_kv_heads, head_dim]`` of the spec's dtype), straight from the socket, each checked
        against ``fingerprints[i]`` (``None``: not checked). ``OK`` iff ``outs[i]`` holds the
        block's exact bytes, of the expected tokens; blocks after the first non-OK one are
        ``MISSING``. Raises ``ValueError`` for mismatched lengths or unusable tensors."""
        check_namespace(namespace)
        hashes = check_block_hashes(block_hashes)
        expected = expected_fingerprints(fingerprints, len(hashes))
        if len(outs) != len(hashes):
            raise ValueError(f"expected one out tensor per block hash ({len(hashes)}), got {len(outs)}")
        self._check_blocks(namespace, outs)
        statuses = [ReadStatus.MISSING] * len(hashes)
        for start in range(0, len(hashes), self._max_batch):
            end = min(start + self._max_batch, len(hashes))
            done = self._get_part(namespace, hashes[start:end], outs[start:end], expected[start:end], statuses, start)
            if done < end - start:
                break
        return statuses

    def put(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor],
        fingerprints: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Send blocks (contiguous CPU tensors) with their token fingerprints (default
        ``NO_FINGERPRINT``); ``True`` for each the daemon acknowledged as stored (with
        ``--durable``: committed to its DISK). Raises ``ValueError`` for mismatched lengths or
        unusable tensors."""
        check_namespace(namespace)
        hashes = check_block_hashes(block_hashes)
        fps = check_fingerprints(fingerprints, len(hashes)) or [NO_FINGERPRINT] * len(hashes)
        if len(blocks) != len(hashes):
            raise ValueError(f"expected one block per block hash ({len(hashes)}), got {len(blocks)}")
        self._check_blocks(namespace, blocks)
        acks: list[bool] = []
        try:
            for start in range(0, len(hashes), self._max_batch):
                part = hashes[start : start + self._max_batch]
                acks += self._put_part(namespace, part, blocks[start : start + len(part)], fps[start : start + len(part)])
        except _Failed as exc:
            self._count(exc.reason)
        return acks + [False] * (len(hashes) - len(acks))

    def close(self) -> None:
        """Release the pooled connections; later calls are misses. Idempotent."""
        self._closed = True
        self._pool.close()

    # -- calls ------------------------------------------------------------------------------------
    def _small_call(self, namespace: bytes, op: str, obj: dict) -> dict:
        response = self._call(namespace, "POST", op, pack(obj), MSGPACK, stream=False)
        try:
            return unpack_map(response.data, op)
        except ValueError:
            raise _Failed("protocol") from None

    def _get_part(self, namespace, hashes, outs, expected, statuses, offset) -> int:
        """One get call; fills ``statuses[offset:]``; returns the blocks read OK."""
        nbytes = sum(out.numel() * out.element_size() for out in outs)
        deadline = time.monotonic() + self.timeout_s + nbytes / _MIN_RATE_BYTES_PER_S
        try:
            response = self._call(namespace, "POST", "get", pack({"block_hashes": hashes}), MSGPACK, stream=True)
        except _Failed as exc:
            self._count(exc.reason)
            statuses[offset] = _STATUS_OF.get(exc.reason, ReadStatus.UNAVAILABLE)
            return 0
        reader = _Reader(response, deadline)
        done, status, reason = 0, None, None
        try:
            for h, out, fingerprint in zip(hashes, outs, expected):
                status = _read_frame(reader, namespace, h, out, fingerprint)
                if status is not ReadStatus.OK:
                    reason = None if status is ReadStatus.MISSING else status.value
                    break
                statuses[offset + done] = ReadStatus.OK
                done += 1
            else:
                status = None
                if reader.read(1) != END:
                    reason = "protocol"
        except _Failed as exc:
            status, reason = _STATUS_OF.get(exc.reason, ReadStatus.UNAVAILABLE), exc.reason
        finally:
            reader.finish(clean=reason is None)
        if status is not None and status is not ReadStatus.MISSING:
            statuses[offset + done] = status
        if reason is not None:
            self._count(reason)
        return done

    def _put_part(
        self, namespace: bytes, hashes: list[BlockHash], blocks: Sequence[torch.Tensor], fingerprints: list[bytes]
    ) -> list[bool]:
        pieces: list[Any] = []
        for h, block, fingerprint in zip(hashes, blocks, fingerprints):
            pieces.append(frame_prefix(h) + encode_header(namespace, block, 0, fingerprint))
            pieces.append(block_bytes(block))
        pieces.append(END)
        body = _coalesce(pieces)
        headers = {"Content-Length": str(sum(len(p) for p in body))}
        response = self._call(namespace, "POST", "put", body, FRAMES, stream=False, headers=headers)
        try:
            stored = unpack_map(response.data, "put").get("stored")
        except ValueError:
            raise _Failed("protocol") from None
        if not isinstance(stored, list) or len(stored) != len(hashes) or not all(isinstance(s, bool) for s in stored):
            raise _Failed("protocol")
        return stored

    def _register(self, namespace: bytes, spec: KVSpec) -> None:
        response = self._request("PUT", namespace_hex(namespace), pack(spec_to_wire(spec)), MSGPACK, stream=False)
        if response.status == 409:
            _discard(response)
            raise _Failed("conflict")
        if response.status in (400, 413):  # this spec will not be taken: stop asking
            with self._lock:
                self._refused.add(namespace)
        self._check_status(response)
        try:
            limit = unpack_map(response.data, "register").get("max_batch_blocks")
        except ValueError:
            raise _Failed("protocol") from None
        with self._lock:
            self._registered.add(namespace)
            if isinstance(limit, int) and limit > 0:
                self._max_batch = min(limit, 4096)

    def _call(self, namespace: bytes, method: str, op: str, body: Any, content_type: str, *, stream: bool,
              headers: dict | None = None):
        """A call on ``namespace`` that returned 200; registers it first (again after a 404)
        when this client knows its spec. Raises :class:`_Failed`."""
        if namespace in self._refused:
            raise _Failed("rejected")
        for attempt in range(2):
            spec = self._specs.get(namespace)
            if spec is not None and namespace not in self._registered:
                self._register(namespace, spec)
            path = f"{namespace_hex(namespace)}/{op}"
            response = self._request(method, path, body, content_type, stream=stream, headers=headers)
            if response.status == 404 and attempt == 0 and spec is not None:
                _discard(response)
                with self._lock:
                    self._registered.discard(namespace)
                continue
            self._check_status(response)
            return response
        raise AssertionError("unreachable")

    def _request(self, method: str, path: str, body: Any, content_type: str, *, stream: bool,
                 headers: dict | None = None):
        """One HTTP exchange (with urllib3's retries of fast failures); raises :class:`_Failed`
        when the daemon cannot be reached. Any status comes back."""
        if self._closed:
            raise _Failed("unavailable")
        if self.backoff.paused():
            raise _Failed("skipped")
        try:
            response = self._pool.urlopen(
                method, self._base + path, body=body, headers={**self._headers, "Content-Type": content_type, **(headers or {})},
                preload_content=not stream, decode_content=False, redirect=False,
            )
        except MaxRetryError as exc:
            self._down(exc.reason)
            raise _Failed("timeout" if _is_timeout(exc.reason) else "unavailable") from None
        except (HTTPError, OSError, http.client.HTTPException) as exc:
            self._down(exc)
            raise _Failed("timeout" if _is_timeout(exc) else "unavailable") from None
        if response.status >= 500:
            _discard(response)
            self._down(f"HTTP {response.status}")
            raise _Failed("unavailable")
        self._up()
        return response

    def _check_status(self, response) -> None:
        if response.status in (200, 201):
            return
        message = _error_message(response)
        _discard(response)
        reason = {401: "unauthorized", 403: "unauthorized", 404: "unregistered"}.get(response.status, "rejected")
        level = logging.DEBUG if response.status in self._logged else logging.WARNING
        self._logged.add(response.status)
        logger.log(level, "daemon %s answered %d: %s", self.url, response.status, message)
        raise _Failed(reason)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1

    def _down(self, cause: Any) -> None:
        if not self.backoff.down:
            logger.warning("daemon %s unreachable (%s): its blocks are misses until it is back", self.url, cause)
        self.backoff.failed()

    def _up(self) -> None:
        if self.backoff.succeeded():
            logger.info("daemon %s reachable again", self.url)

    def _check_blocks(self, namespace: bytes, tensors: Sequence[torch.Tensor]) -> None:
        spec = self._specs.get(namespace)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"expected contiguous CPU tensors, got {type(t).__name__} #{i}"
                                 + (f" on {t.device}" if isinstance(t, torch.Tensor) else ""))
            if t.dtype not in DTYPE_NAMES:
                raise ValueError(f"expected a dtype in {sorted(DTYPE_NAMES.values())}, got {t.dtype}")
            if spec is not None and (tuple(t.shape) != spec.block_shape or t.dtype != spec.dtype):
                raise ValueError(f"expected blocks of shape {spec.block_shape} and dtype {spec.dtype}, "
                                 f"got {tuple(t.shape)} {t.dtype}")


_STATUS_OF = {"timeout": ReadStatus.TIMEOUT, "corrupt": ReadStatus.CORRUPT}


class _Watchdog:
    """One thread that shuts down the socket of a streamed read whose deadline has passed:
    a daemon that trickles bytes keeps every single read within the per-read timeout, so
    only a deadline enforced from outside the reading thread bounds the whole read."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, socket.socket]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def arm(self, sock: socket.socket, deadline: float) -> int:
        with self._cond:
            self._next += 1
            self._armed[self._next] = (deadline, sock)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-remote-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for token, (deadline, sock) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[token]
                        try:
                            sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once
                        except OSError:
                            pass
                next_deadline = min((d for d, _ in self._armed.values()), default=now + 60.0)
                self._cond.wait(max(0.001, next_deadline - now))


_WATCHDOG = _Watchdog()


class _Reader:
    """Exact reads from a streamed response body, straight into caller memory where the
    underlying ``http.client`` response allows it (urllib3's own ``readinto`` goes through
    an intermediate bytes object). Raises :class:`_Failed` on a cut, a stall or the deadline
    (enforced by :class:`_Watchdog`)."""

    def __init__(self, response, deadline: float) -> None:
        self.response, self.deadline = response, deadline
        fp = getattr(response, "_fp", None)
        self._raw = fp if isinstance(fp, http.client.HTTPResponse) else None
        sock = getattr(getattr(response, "connection", None), "sock", None)
        self._watch = _WATCHDOG.arm(sock, deadline) if isinstance(sock, socket.socket) else None

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return bytes(buf)

    def readinto(self, view: memoryview) -> None:
        offset = 0
        while offset < len(view):
            if time.monotonic() > self.deadline:
                raise _Failed("timeout")
            try:
                if self._raw is not None:
                    n = self._raw.readinto(view[offset:])
                else:
                    n = self.response.readinto(view[offset:])
            except (TimeoutError, Urllib3Timeout):
                raise _Failed("timeout") from None
            except (OSError, HTTPError, http.client.HTTPException, ValueError):
                raise _Failed("timeout" if time.monotonic() > self.deadline else "unavailable") from None
            if not n:  # the stream ended early: the daemon went away, or the watchdog cut it
                raise _Failed("timeout" if time.monotonic() > self.deadline else "unavailable")
            offset += n

    def finish(self, clean: bool) -> None:
        """Return the connection to the pool after a complete stream; drop it otherwise."""
        if self._watch is not None:
            _WATCHDOG.disarm(self._watch)
        if clean:
            try:
                self.response.read()  # the chunked terminator: the connection can be reused
                self.response.release_conn()
                return
            except (OSError, HTTPError, http.client.HTTPException, ValueError):
                pass
        _discard(self.response, drop=True)


def _read_frame(
    reader: _Reader, namespace: bytes, block_hash: bytes, out: torch.Tensor, fingerprint: bytes | None
) -> ReadStatus:
    """One frame into ``out``: ``OK``, ``MISSING`` (the stream ended: the daemon has no more
    of the prefix), ``CORRUPT``, ``OTHER_VERSION`` or ``TOKEN_MISMATCH`` (the block is not
    ``fingerprint``'s, when given). Raises :class:`_Failed` when the stream breaks."""
    hash_len = reader.read(1)[0]
    if hash_len == 0:
        return ReadStatus.MISSING
    if hash_len not in BLOCK_HASH_NBYTES or reader.read(hash_len) != block_hash:
        return ReadStatus.CORRUPT  # out of step with the request: nothing after it is trusted
    header = reader.read(HEADER_NBYTES)
    record = parse_header(header)
    if record is None:
        return failed_header_status(header)
    if (
        record.namespace != namespace
        or record.dtype != DTYPE_NAMES[out.dtype]
        or record.shape != tuple(out.shape)
        or record.payload_nbytes != out.numel() * out.element_size()
    ):
        return ReadStatus.CORRUPT
    digest = record.digest(header)
    dst = block_bytes(out)
    for start in range(0, len(dst), _PIECE_NBYTES):
        piece = dst[start : start + _PIECE_NBYTES]
        reader.readinto(piece)
        digest.update(piece)
    return check_record(record, digest.intdigest(), fingerprint)


def _coalesce(pieces: list) -> list:
    """Join runs of small pieces (headers, small blocks) into one bytes each."""
    out: list = []
    run: list = []
    run_nbytes = 0
    for piece in pieces:
        if len(piece) >= _COALESCE_NBYTES:
            if run:
                out.append(b"".join(run))
                run, run_nbytes = [], 0
            out.append(piece)
        else:
            run.append(piece)
            run_nbytes += len(piece)
            if run_nbytes >= 1 << 20:
                out.append(b"".join(run))
                run, run_nbytes = [], 0
    if run:
        out.append(b"".join(run))
    return out


def _discard(response, drop: bool = False) -> None:
    """Let go of a response: read a small error body out, or close its connection."""
    try:
        if drop:
            response.close()
        else:
            response.drain_conn()
        response.release_conn()
    except (OSError, HTTPError, http.client.HTTPException, ValueError):
        pass


def _error_message(response) -> str:
    try:
        data = response.data
    except (OSError, HTTPError, http.client.HTTPException):
        return "(no body)"
    return data[:300].decode("utf-8", "replace") if data else "(no body)"
