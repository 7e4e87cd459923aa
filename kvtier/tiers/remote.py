"""REMOTE tier over HTTP: the client of a ``kvtier serve`` daemon (kvtier.server).

Implements :class:`kvtier.tiers.backend.RemoteBackend`: blocking, thread-safe calls for the
store's I/O threads, one connection pool (urllib3) per daemon, over TCP (``http://``,
``https://``) or a Unix socket (``unix:///path``, the recommended local way). Wire format:
kvtier.wire; transport, deadlines and capped reads: kvtier.tiers.transport.

Authentication: over ``http://`` the token never travels: the client opens a session and signs
every request, and the daemon proves on every reply that it holds the token too (kvtier.auth);
a reply without that proof (someone else listening on the port) is refused before its body is
read (``errors["unproven"]``). Over a Unix socket or https: ``Authorization: Bearer``.

Failures are misses, never exceptions or hangs (the backend contract):

- every call is bounded as a whole (kvtier.tiers.transport): ``timeout_s`` for lookup and
  register, ``timeout_s`` plus its size at 64 MiB/s for a get or put part, whatever the
  daemon trickles; connect and read timeouts of ``timeout_s`` per attempt; a reply larger
  than the call can need is refused, never read whole (``protocol``);
- fast failures (connection refused or reset, a pooled connection the daemon closed when it
  restarted) are retried with backoff (all calls are idempotent: blocks are named by their
  content hash); timeouts are not retried (a slow daemon would double the wait);
- after a failed call the daemon is treated as down for a pause (kvtier.tiers.backoff:
  ``backoff_s``, doubling up to ``max_backoff_s``): calls in that pause return a miss at
  once, counted as ``skipped``, so an inference loop never waits on a dead daemon more than
  once per pause; the first call after it tries again (reconnects);
- ``errors`` counts by reason: ``unavailable``, ``timeout``, ``skipped``, ``corrupt``,
  ``protocol``, ``unauthorized``, ``unproven``, ``busy`` (503 with Retry-After: the daemon is
  up but has no room now; no pause), ``rejected`` (a 4xx other than 401/404/409; a namespace
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

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.checks import (
    BLOCK_HASH_NBYTES,
    check_block_hashes,
    check_fingerprints,
    check_namespace,
    expected_fingerprints,
    namespace_hex,
)
from kvtier.records import HEADER_NBYTES, ReadStatus, check_record, encode_header, failed_header_status, parse_header
from kvtier.tiers.backoff import MAX_S, MIN_S
from kvtier.tiers.daemon_client import RESET_ONE_TIMEOUT_S, SMALL_REPLY_NBYTES, DaemonClient
from kvtier.tiers.transport import Call, Failed, Reader, call, discard, read_capped
from kvtier.types import DTYPE_NAMES, NO_FINGERPRINT, BlockHash, KVSpec
from kvtier.wire import END, FRAMES, MSGPACK, block_bytes, frame_nbytes, frame_prefix, pack, spec_to_wire, unpack_map

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


class RemoteTier(DaemonClient):
    """Client of a ``kvtier serve`` daemon.

    Args:
        url: ``http://host:port``, ``https://...`` or ``unix:///path/to.sock`` of the daemon.
        token: the daemon's token (``--token``, one of ``--token-file``'s, ``KVTIER_TOKEN``).
        timeout_s: the most a lookup or register may take in all, seconds; a get or put part
            may take this plus its size at 64 MiB/s; also the connect and read timeout of
            each attempt.
        max_connections: pooled keep-alive connections kept (more are opened when needed).
        retries: retries of a fast failure per call.
        backoff_s, max_backoff_s: how long the daemon counts as down after a failed call
            (doubling per consecutive failure), seconds (:class:`~kvtier.tiers.backoff.Backoff`).

    Raises:
        ValueError: a URL that is not ``http(s)://host[:port]`` or ``unix:///path``, backoff
            limits that are not ``0 < backoff_s <= max_backoff_s``.
    """

    def __init__(
        self, url: str, token: str | None = None, timeout_s: float = 2.0, *, max_connections: int = 16,
        retries: int = 2, backoff_s: float = MIN_S, max_backoff_s: float = MAX_S,
    ) -> None:
        super().__init__(url, token, timeout_s, max_connections=max_connections, retries=retries,
                         backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self._specs: dict[bytes, KVSpec] = {}
        self._registered: set[bytes] = set()
        self._refused: set[bytes] = set()  # namespaces whose spec the daemon refused (400/403/413)
        self._max_batch = _DEFAULT_MAX_BATCH

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
            with call(self.timeout_s) as ctx:
                self._register(ctx, namespace, spec)
        except Failed as exc:
            if exc.reason == "conflict":
                with self._lock:
                    self._specs.pop(namespace, None)
                raise ValueError(f"daemon {self.url} knows namespace {namespace_hex(namespace)} with another "
                                 f"block shape or dtype than {spec_to_wire(spec)}") from None
            self._count(exc.reason)

    def lookup(self, namespace: bytes, block_hashes: Sequence[BlockHash]) -> int:
        """Leading ``block_hashes`` the daemon holds (0 when it cannot be reached or does not
        answer within ``timeout_s``)."""
        check_namespace(namespace)
        hashes = check_block_hashes(block_hashes)
        num_hit = 0
        try:
            with call(self.timeout_s) as ctx:
                for start in range(0, len(hashes), self._max_batch):
                    part = hashes[start : start + self._max_batch]
                    reply = self._small_call(ctx, namespace, "lookup", {"block_hashes": part},
                                             cap=(64 << 10) + 16 * len(part))
                    n = reply.get("num_blocks")
                    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(part):
                        raise Failed("protocol")
                    num_hit += n
                    if n < len(part):
                        break
        except Failed as exc:
            self._count(exc.reason)
            return 0
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
        except Failed as exc:
            self._count(exc.reason)
        return acks + [False] * (len(hashes) - len(acks))

    def clear_namespace(self, namespace: bytes) -> int | None:
        """Empty ``namespace`` on the daemon, every tier; it stays registered
        (``TieredStore.reset`` calls it). Returns the blocks it held, or ``None`` when it
        could not be emptied within 30 s: the daemon cannot be reached, or refused (a reset
        needs an admin token: ``--token`` or an admin of ``--token-file``). Never raises for
        those; logged."""
        check_namespace(namespace)
        spec = self._specs.get(namespace)
        try:
            if spec is not None and namespace not in self._registered:  # a restarted daemon reopens
                with call(self.timeout_s) as ctx:  # it from DISK on registration: empty that too
                    self._ensure_session(ctx)
                    self._register(ctx, namespace, spec)
            blocks = self._admin("POST", self._admin_path(namespace, None) + "/reset",
                                 timeout_s=RESET_ONE_TIMEOUT_S).get("blocks")
        except LookupError:  # the daemon has no such namespace: it holds nothing of it
            return 0
        except (Failed, PermissionError, RuntimeError) as exc:
            self._warn("reset", "could not empty namespace %s on %s: %s", namespace_hex(namespace), self.url,
                       getattr(exc, "reason", exc))
            return None
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
            self._count("protocol")
            return None
        return blocks

    # -- calls ------------------------------------------------------------------------------------
    def _small_call(self, ctx: Call, namespace: bytes, op: str, obj: dict, cap: int) -> dict:
        """An idempotent call with a small reply (lookup): on the daemon's lookup channel when
        it offers one (a WebSocket: kvtier.server.channel), else over HTTP, where an open
        pooled connection skips urllib3 (kvtier.tiers.transport.quick_request)."""
        reply = self._channel_call(ctx, namespace, op, obj, cap)
        if reply is not None:
            return reply
        response = self._call(ctx, namespace, "POST", op, pack(obj), MSGPACK, quick_cap=cap)
        try:
            return unpack_map(read_capped(response, cap, ctx), op)
        except ValueError:
            raise Failed("protocol") from None

    def _channel_call(self, ctx: Call, namespace: bytes, op: str, obj: dict, cap: int) -> dict | None:
        """``op`` on the lookup channel, with the HTTP route's rules (a namespace registered
        first when this client knows its spec, again after a 404; an error frame's status
        counted as the HTTP status would be). ``None``: no channel now (go over HTTP)."""
        if self._channel_path is None:
            return None
        if namespace in self._refused:
            raise Failed("rejected")
        self._ensure_session(ctx)
        payload = pack({"op": op, "namespace": namespace_hex(namespace), **obj})
        for attempt in range(2):
            spec = self._specs.get(namespace)
            if spec is not None and namespace not in self._registered:
                self._register(ctx, namespace, spec)
            data = self._channel_exchange(ctx, payload, cap)
            if data is None:
                return None
            try:
                reply = unpack_map(data, op)
            except ValueError:
                raise Failed("protocol") from None
            if "error" not in reply:
                return reply
            status = reply.get("status")
            if status == 404 and attempt == 0 and spec is not None:
                self._forget(namespace)
                continue
            reason = {401: "unauthorized", 403: "unauthorized", 404: "unregistered"}.get(status, "rejected")
            self._warn(f"HTTP {status}", "daemon %s answered %s: %s", self.url, status, str(reply["error"])[:300])
            raise Failed(reason)
        raise AssertionError("unreachable")

    def _get_part(self, namespace, hashes, outs, expected, statuses, offset) -> int:
        """One get call; fills ``statuses[offset:]``; returns the blocks read OK."""
        nbytes = sum(out.numel() * out.element_size() for out in outs)
        with call(self.timeout_s + nbytes / _MIN_RATE_BYTES_PER_S) as ctx:
            try:
                response = self._call(ctx, namespace, "POST", "get", pack({"block_hashes": hashes}), MSGPACK)
            except Failed as exc:
                self._count(exc.reason)
                statuses[offset] = _STATUS_OF.get(exc.reason, ReadStatus.UNAVAILABLE)
                return 0
            reader = Reader(response, ctx)
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
            except Failed as exc:
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
        body = _PutBody(namespace, hashes, blocks, fingerprints)
        nbytes = body.nbytes
        with call(self.timeout_s + nbytes / _MIN_RATE_BYTES_PER_S) as ctx:
            response = self._call(ctx, namespace, "POST", "put", body, FRAMES, headers={"Content-Length": str(nbytes)})
            try:
                stored = unpack_map(read_capped(response, (64 << 10) + 2 * len(hashes), ctx), "put").get("stored")
            except ValueError:
                raise Failed("protocol") from None
        if not isinstance(stored, list) or len(stored) != len(hashes) or not all(isinstance(s, bool) for s in stored):
            raise Failed("protocol")
        return stored

    def _register(self, ctx: Call, namespace: bytes, spec: KVSpec) -> None:
        self._ensure_session(ctx)
        response = self._request(ctx, "PUT", self._base + namespace_hex(namespace), pack(spec_to_wire(spec)), MSGPACK)
        if response.status == 409:
            discard(response, drop=True)
            raise Failed("conflict")
        if response.status in (400, 403, 413):  # this spec or namespace will not be taken: stop asking
            with self._lock:
                self._refused.add(namespace)
        self._check_status(response, ctx)
        try:
            reply = unpack_map(read_capped(response, SMALL_REPLY_NBYTES, ctx), "register")
        except ValueError:
            raise Failed("protocol") from None
        limit = reply.get("max_batch_blocks")
        self._offer_channel(reply.get("channel"))
        with self._lock:
            self._registered.add(namespace)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                self._max_batch = min(limit, 4096)

    def _call(self, ctx: Call, namespace: bytes, method: str, op: str, body: Any, content_type: str, *,
              headers: dict | None = None, quick_cap: int | None = None):
        """A call on ``namespace`` that returned 200; registers it first (again after a 404)
        when this client knows its spec. Raises :class:`Failed`."""
        if namespace in self._refused:
            raise Failed("rejected")
        self._ensure_session(ctx)
        for attempt in range(2):
            spec = self._specs.get(namespace)
            if spec is not None and namespace not in self._registered:
                self._register(ctx, namespace, spec)
            path = f"{self._base}{namespace_hex(namespace)}/{op}"
            response = self._request(ctx, method, path, body, content_type, headers=headers, quick_cap=quick_cap)
            if response.status == 404 and attempt == 0 and spec is not None:
                discard(response, drop=True)
                with self._lock:
                    self._registered.discard(namespace)
                continue
            self._check_status(response, ctx)
            return response
        raise AssertionError("unreachable")

    def _forget(self, namespace: bytes) -> None:
        with self._lock:
            self._registered.discard(namespace)

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


def _read_frame(
    reader: Reader, namespace: bytes, block_hash: bytes, out: torch.Tensor, fingerprint: bytes | None
) -> ReadStatus:
    """One frame into ``out``: ``OK``, ``MISSING`` (the stream ended: the daemon has no more
    of the prefix), ``CORRUPT``, ``OTHER_VERSION`` or ``TOKEN_MISMATCH`` (the block is not
    ``fingerprint``'s, when given). Raises :class:`Failed` when the stream breaks."""
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


class _PutBody:
    """The frames of a put, made as they are sent: each block's record header (its xxh3 over
    the payload) is computed just before the block goes out, so the client hashes block
    ``i + 1`` while the daemon receives and verifies block ``i`` (computing every header before
    the first byte left kept the daemon idle for a sixteenth of each 16-block put: issue 17,
    bench/results/2026-12-02-daemon-3). Re-iterable: urllib3 sends it again on a retry.
    ``nbytes``: the body's length (its ``Content-Length``)."""

    def __init__(self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor],
                 fingerprints: Sequence[bytes]) -> None:
        self.namespace, self.hashes, self.blocks, self.fingerprints = namespace, hashes, blocks, fingerprints
        self.nbytes = sum(frame_nbytes(h, b.numel() * b.element_size()) for h, b in zip(hashes, blocks)) + len(END)

    def __iter__(self):
        return _coalesce(self._pieces())

    def _pieces(self):
        for h, block, fingerprint in zip(self.hashes, self.blocks, self.fingerprints):
            yield frame_prefix(h) + encode_header(self.namespace, block, 0, fingerprint)
            yield block_bytes(block)
        yield END


def _coalesce(pieces):
    """Join runs of small pieces (headers, small blocks) into one bytes each."""
    run: list = []
    run_nbytes = 0
    for piece in pieces:
        if len(piece) >= _COALESCE_NBYTES:
            if run:
                yield b"".join(run)
                run, run_nbytes = [], 0
            yield piece
        else:
            run.append(piece)
            run_nbytes += len(piece)
            if run_nbytes >= 1 << 20:
                yield b"".join(run)
                run, run_nbytes = [], 0
    if run:
        yield b"".join(run)
