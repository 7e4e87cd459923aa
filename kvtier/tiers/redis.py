"""REMOTE tier on Redis or Redis Cluster (redis-py), shared by many engine processes.

Implements :class:`kvtier.tiers.backend.RemoteBackend`. One Redis string per block::

    key   = b"kvtier:" + namespace.hex() + b":" + block_hash.hex()
    value = block record (kvtier.records: 128-byte header + xxh3 checksum + raw block bytes)
    spec  = b"kvtier:" + namespace.hex() + b":spec" -> the namespace's KVSpec (kvtier.wire.pack_spec)

Hex keys keep ``redis-cli --scan --pattern 'kvtier:<namespace hex>:*'`` usable to inspect
or clear one namespace. Every read is verified (:func:`kvtier.records.decode_into`); a value
that fails is ``CORRUPT``, never served, and is deleted so the next put repairs it. A value
of other tokens (its fingerprint is not the one the caller expects: ``TOKEN_MISMATCH``) or
of another format version (``OTHER_VERSION``, another release's) is a miss and stays: it is
intact, and Redis's eviction (or its TTL) ages it out.

Round trips: ``lookup`` is one pipeline of ``EXISTS`` (one round trip; on a cluster one per
node, written to every node before any reply is read), ``get_into`` and ``put`` are pipelines
of ``GETRANGE key 0 <record size>`` / ``SET NX`` in chunks of at most ``max_batch_bytes``.
``GETRANGE`` rather than ``GET``: Redis itself then never sends more than one byte past a
record, so a value that is too long (written by something else) costs one record's bytes, is
``CORRUPT`` and is deleted; a missing key is an empty string.

Copies and limits: see :mod:`kvtier.tiers.redis_conn`. A put sends the record header and the
block's own memory (no record is assembled); a get's reply is one ``bytes`` object that
:func:`~kvtier.records.decode_into` copies into the caller's tensor while hashing. Every call
(``register``, ``lookup``, ``get_into``, ``put``) runs under one budget
(:func:`~kvtier.tiers.redis_conn.call_budget`): a deadline of ``timeout_s`` plus its bytes at
64 MiB/s for the whole call, connects and retries included, and a cap on what its replies may
hold (a bulk string longer than the call can need, one record but at least 1 MiB, is refused
before it is read; so are more bytes in all than its replies can take, plus 4 MiB).

Namespaces: every call needs ``register(namespace, spec)`` first (the spec validates the
caller's tensors). The spec is kept under the namespace's ``:spec`` key with ``SET NX``, so a
second process with another spec gets ``ValueError``; it is checked again after every outage
(a restarted server may have come back empty). Records carry namespace, dtype and shape in
their header, so even a spec key lost to eviction never lets a mismatched block through.

Cluster slots: keys carry no hash tag, so each block lands on its own slot and a request's
blocks spread over every primary (its reads and writes use all nodes at once, and one hot
prefix does not fill one node). The price is that multi-key commands (``MGET``, ``EXISTS k1
k2``) cannot span the keys; per-key commands in a pipeline cost the same round trips, because
redis-py's ``ClusterPipeline`` groups them by node. A hash tag per namespace would put a whole
model's cache on a single slot, i.e. one node.

Eviction is Redis's: run the server with ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` (or ``allkeys-lfu``). Under ``noeviction`` a full server
answers ``OOM`` and puts return ``False`` (counted as ``oom``). Optional TTL: ``ttl_s``
(constructor or ``?ttl_s=`` in the URL) expires a block that long after its write or its
last hit: a lookup asks ``PEXPIRE key <ttl>`` instead of ``EXISTS`` (1 when the key exists,
which it then refreshes) and a get sends ``PEXPIRE`` after each ``GETRANGE`` in the same
pipeline, so a block in use does not expire.

Failures (the backend contract): nothing here raises for a remote-side problem. A refused
connection, a timeout (the call's deadline), a cluster that is down, a reply larger than the
call can need or a protocol error is a miss counted in ``errors`` by reason
(``unavailable``, ``timeout``, ``oversize``, ``corrupt``, ``oom``, ``protocol``,
``conflict``); after one, calls return misses at once (counted as ``skipped``) for a pause of
``backoff_s`` doubling up to ``max_backoff_s`` (kvtier.tiers.backoff, the same policy as the
daemon's client), then the next call reconnects. redis-py retries a failed connection once (a
pooled socket that went stale across a server restart) within the same deadline and never
retries a timeout. On a cluster, a call whose keys include a node that is down is a miss as a
whole (redis-py fails the pipeline), until the node is back or failed over.

Emptying a namespace: :meth:`RedisTier.clear_namespace` (what ``TieredStore.reset`` calls)
deletes its block keys with ``SCAN MATCH`` + ``UNLINK`` in batches on every primary; the
spec key stays (the namespace stays registered).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import torch

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.exceptions import (
        AskError, ClusterDownError, MovedError, OutOfMemoryError, RedisClusterException, RedisError, ResponseError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry
except ImportError:  # only RedisTier needs it
    redis = None  # type: ignore[assignment]

from kvtier.checks import check_block_hashes, check_fingerprints, check_namespace, expected_fingerprints
from kvtier.records import ReadStatus, decode_into, record_nbytes
from kvtier.tiers.backoff import MAX_S, MIN_S, Backoff
from kvtier.tiers.redis_conn import ReplyTooLarge, call_budget, client_options, record_value
from kvtier.types import NO_FINGERPRINT, BlockHash, KVSpec
from kvtier.wire import describe, pack_spec, unpack_spec

logger = logging.getLogger(__name__)

KEY_PREFIX = b"kvtier:"


class RedisTier:
    """Block store on a Redis server or Redis Cluster.

    Args:
        url: ``redis://[[user]:password@]host:port[/db]``, ``rediss://...`` (TLS) or
            ``redis+cluster://[[user]:password@]host:port`` (any node of the cluster; the
            client discovers the rest). Query ``?ttl_s=SECONDS`` sets ``ttl_s``; other query
            parameters go to redis-py (but ``protocol``: RedisTier speaks RESP2).
        timeout_s: the deadline of each call, seconds, plus its bytes at 64 MiB/s (connects,
            retries and every socket read and write included).
        ttl_s: expire each block this many seconds after its write or its last hit;
            ``None``: never (Redis's eviction policy decides).
        max_batch_bytes: most record bytes in one ``GETRANGE``/``SET`` pipeline (bounds the
            memory a batch holds; a larger batch is sent in several pipelines).
        backoff_s, max_backoff_s: how long Redis counts as down after a failed call
            (doubling per consecutive failure), seconds (:class:`~kvtier.tiers.backoff.Backoff`).

    Raises:
        ValueError: a bad URL, scheme, ``ttl_s``, ``timeout_s``, ``max_batch_bytes``, backoff
            limits, or a ``protocol`` in the URL.
        ImportError: redis-py is not installed.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 2.0,
        ttl_s: float | None = None,
        max_batch_bytes: int = 64 << 20,
        *,
        backoff_s: float = MIN_S,
        max_backoff_s: float = MAX_S,
    ) -> None:
        if redis is None:
            raise ImportError("RedisTier needs redis-py: pip install redis")
        client_url, cluster, url_ttl_s = _parse_url(url)
        ttl_s = url_ttl_s if ttl_s is None else ttl_s
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0):
            raise ValueError(f"expected ttl_s > 0 seconds or None, got {ttl_s!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"expected timeout_s > 0 seconds, got {timeout_s!r}")
        if not isinstance(max_batch_bytes, int) or max_batch_bytes <= 0:
            raise ValueError(f"expected max_batch_bytes > 0, got {max_batch_bytes!r}")
        self.backoff = Backoff(backoff_s, max_backoff_s)
        self.url = _redact(url)
        self.cluster = cluster
        self.timeout_s = float(timeout_s)
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self.max_batch_bytes = max_batch_bytes
        self.errors: Counter = Counter()
        self._client_url = client_url
        self._client: Any = None  # redis.Redis | redis.cluster.RedisCluster, made on first use
        self._specs: dict[bytes, KVSpec] = {}
        self._unregistered: set[bytes] = set()  # known locally, not yet on the server
        self._conflicts: set[bytes] = set()  # the server holds another spec: never used
        self._lock = threading.Lock()  # guards the fields above
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisTier({self.url!r}, timeout_s={self.timeout_s})"

    # -- contract --------------------------------------------------------------------------
    def register(self, namespace: bytes, spec: KVSpec) -> None:
        """Declare ``namespace``'s block shape and dtype (idempotent).

        Raises:
            ValueError: a bad namespace, ``spec`` differs from an earlier registration of
                ``namespace`` (here or, through the server, in another process).
            TypeError: ``spec`` is not a :class:`KVSpec`.
        """
        check_namespace(namespace)
        if not isinstance(spec, KVSpec):
            raise TypeError(f"expected a KVSpec, got {type(spec).__name__}")
        with self._lock:
            known = self._specs.get(namespace)
            if known is not None and known != spec:
                raise ValueError(f"namespace {namespace.hex()[:16]} is registered with {describe(known)}, "
                                 f"got {describe(spec)}")
            if namespace in self._conflicts:
                raise ValueError(f"namespace {namespace.hex()[:16]} is registered on {self.url} with another spec")
            self._specs[namespace] = spec
            if known is None:
                self._unregistered.add(namespace)
        if namespace in self._unregistered:
            with call_budget(self.timeout_s):
                registered, theirs = self._register_on_server(namespace)
            if registered is False:
                with self._lock:
                    self._unregistered.discard(namespace)
                    if known is None:
                        self._specs.pop(namespace, None)  # as if never called
                    else:
                        self._conflicts.add(namespace)  # in use: later calls are misses
                raise ValueError(f"namespace {namespace.hex()[:16]} is registered on {self.url} with {theirs}, "
                                 f"got {describe(spec)}")

    def lookup(self, namespace: bytes, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading ``block_hashes`` present (0 when Redis is unreachable).

        Raises:
            ValueError: unregistered namespace or a bad block hash.
        """
        self._spec_of(namespace)
        check_block_hashes(block_hashes)
        if not block_hashes:
            return 0
        keys = [self._key(namespace, h) for h in block_hashes]
        # With a TTL, PEXPIRE is the lookup: 1 when the key exists, whose TTL it refreshes.
        commands = [("EXISTS", k) for k in keys] if self.ttl_ms is None else [("PEXPIRE", k, self.ttl_ms) for k in keys]
        with call_budget(self.timeout_s, reply_nbytes=16 * len(keys)):
            if not self._usable(namespace):
                return 0
            replies = self._pipeline(commands)
        if isinstance(replies, BaseException):
            return 0
        present = 0
        for reply in replies:
            if isinstance(reply, Exception):
                self._fail(reply)
                break
            if reply != 1:
                break
            present += 1
        return present

    def get_into(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], outs: Sequence[torch.Tensor],
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[ReadStatus]:
        """Read each block into ``outs[i]`` and verify it.

        Args:
            outs: one contiguous CPU tensor per hash, of ``spec.block_shape`` and
                ``spec.dtype`` (the registered spec).
            fingerprints: the token fingerprint each block must carry (``None`` entries, or
                ``None``: not checked).

        Returns:
            one status per block; ``outs[i]`` holds the block's exact bytes iff it is ``OK``.
            The first non-OK block ends the read: the ones after it are ``MISSING``.

        Raises:
            ValueError: unregistered namespace, bad hash, wrong number/shape/dtype of ``outs``.
        """
        spec = self._spec_of(namespace)
        check_block_hashes(block_hashes)
        expected = expected_fingerprints(fingerprints, len(block_hashes))
        _check_tensors(outs, len(block_hashes), spec, "outs")
        if not block_hashes:
            return []
        size = record_nbytes(spec.block_nbytes)
        n = len(block_hashes)
        # A reply holds at most one record and one byte (GETRANGE 0..size: a longer value is
        # seen as such, never read whole); the call reads at most n of them.
        with call_budget(self.timeout_s, n * size, max_bulk=size + 1, reply_nbytes=n * (size + 64)):
            if not self._usable(namespace):
                return [ReadStatus.UNAVAILABLE] * n
            return self._get_chunks(namespace, block_hashes, outs, expected, size)

    def _get_chunks(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], outs: Sequence[torch.Tensor],
        expected: Sequence[bytes | None], size: int,
    ) -> list[ReadStatus]:
        """``get_into``'s reads, ``max_batch_bytes`` of records per pipeline; each record's
        header fingerprint is checked against ``expected`` (``None``: not checked)."""
        statuses = [ReadStatus.MISSING] * len(block_hashes)
        chunk = max(1, self.max_batch_bytes // size)
        per_key = 1 if self.ttl_ms is None else 2  # GETRANGE [+ PEXPIRE: a hit refreshes the TTL]
        for start in range(0, len(block_hashes), chunk):
            keys = [self._key(namespace, h) for h in block_hashes[start : start + chunk]]
            commands: list[tuple] = []
            for key in keys:
                commands.append(("GETRANGE", key, 0, size))
                if per_key == 2:
                    commands.append(("PEXPIRE", key, self.ttl_ms))
            replies = self._pipeline(commands)
            if isinstance(replies, BaseException):
                statuses[start:] = [_status_of(replies)] * (len(block_hashes) - start)
                return statuses
            for i, (key, reply) in enumerate(zip(keys, replies[::per_key]), start):
                status = self._decode(namespace, key, reply, outs[i], expected[i])
                statuses[i] = status
                if status is not ReadStatus.OK:
                    return statuses
        return statuses

    def put(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor],
        fingerprints: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Write blocks with ``SET NX`` (a block already present stays as it is).

        Args:
            blocks: one contiguous CPU tensor per hash, of the registered spec's
                ``block_shape`` and dtype.
            fingerprints: each block's token fingerprint (default ``NO_FINGERPRINT``).

        Returns:
            ``True`` for each block Redis holds after the call (written now or before).

        Raises:
            ValueError: unregistered namespace, bad hash, wrong number/shape/dtype of ``blocks``.
        """
        spec = self._spec_of(namespace)
        check_block_hashes(block_hashes)
        fps = check_fingerprints(fingerprints, len(block_hashes)) or [NO_FINGERPRINT] * len(block_hashes)
        _check_tensors(blocks, len(block_hashes), spec, "blocks")
        results = [False] * len(block_hashes)
        if not block_hashes:
            return results
        size = record_nbytes(spec.block_nbytes)
        with call_budget(self.timeout_s, len(block_hashes) * size, reply_nbytes=64 * len(block_hashes)):
            if not self._usable(namespace):
                return results
            options = {"nx": True} if self.ttl_ms is None else {"nx": True, "px": self.ttl_ms}
            chunk = max(1, self.max_batch_bytes // size)
            for start in range(0, len(block_hashes), chunk):
                commands = [
                    ("SET", self._key(namespace, h), record_value(namespace, b, fp), options)
                    for h, b, fp in zip(
                        block_hashes[start : start + chunk], blocks[start : start + chunk], fps[start : start + chunk]
                    )
                ]
                replies = self._pipeline(commands)
                if isinstance(replies, BaseException):
                    return results
                for i, reply in enumerate(replies, start):
                    if isinstance(reply, Exception):
                        self._fail(reply)
                    else:
                        results[i] = True  # True: written; None: NX found it present
        return results

    def clear_namespace(self, namespace: bytes) -> int | None:
        """Delete every block of ``namespace`` (its spec key stays: it stays registered), on
        every primary of a cluster: ``SCAN MATCH kvtier:<namespace hex>:*`` in batches of
        about 1,000 keys, each batch ``UNLINK`` ed (freed by Redis in the background) in one
        pipeline, each round trip under its own ``timeout_s`` deadline.

        Returns:
            the number of blocks deleted, or ``None`` when Redis could not be reached or
            failed part way (some blocks may be left: call again).

        Raises:
            ValueError: a bad namespace.
        """
        check_namespace(namespace)
        if self._closed:
            self.errors["closed"] += 1
            return None
        pattern = b"%s%s:*" % (KEY_PREFIX, namespace.hex().encode())
        spec_key = self._spec_key(namespace)
        deleted = 0
        try:
            with call_budget(self.timeout_s):
                client = self._connect()
                nodes = [client.get_redis_connection(n) for n in client.get_primaries()] if self.cluster else [client]
            for node in nodes:
                cursor = None
                while cursor != 0:
                    with call_budget(self.timeout_s, reply_nbytes=1 << 20):
                        cursor, keys = node.scan(cursor=cursor or 0, match=pattern, count=1000)
                        keys = [k for k in keys if k != spec_key]
                        if keys:
                            pipe = node.pipeline(transaction=False)
                            for key in keys:  # one key per command: a cluster refuses cross-slot UNLINK
                                pipe.unlink(key)
                            deleted += sum(pipe.execute())
        except (RedisError, RedisClusterException, OSError) as exc:
            self._fail(exc)
            return None
        self._succeeded()
        return deleted

    def close(self) -> None:
        """Release connections. Idempotent; later calls return misses."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # a broken socket must not fail a shutdown
                logger.debug("RedisTier close: %s", exc)

    # -- namespaces ------------------------------------------------------------------------
    def _spec_of(self, namespace: bytes) -> KVSpec:
        spec = self._specs.get(namespace)
        if spec is None:
            check_namespace(namespace)
            raise ValueError(f"namespace {namespace.hex()[:16]} is not registered: call register(namespace, spec) first")
        return spec

    def _usable(self, namespace: bytes) -> bool:
        """The namespace is registered on the server and Redis is not in backoff."""
        if self._closed or namespace in self._conflicts:
            self.errors["conflict" if namespace in self._conflicts else "closed"] += 1
            return False
        if self.backoff.paused():
            self.errors["skipped"] += 1
            return False
        if namespace in self._unregistered:
            registered, theirs = self._register_on_server(namespace)
            if registered is False:
                with self._lock:
                    self._conflicts.add(namespace)
                    self._unregistered.discard(namespace)
                logger.error(
                    "RedisTier: namespace %s is registered on %s with %s, not %s; it stays a miss",
                    namespace.hex()[:16], self.url, theirs, describe(self._specs[namespace]),
                )
                self.errors["conflict"] += 1
            return bool(registered)
        return True

    def _register_on_server(self, namespace: bytes) -> tuple[bool | None, object]:
        """``SET NX`` the spec key. ``(True, _)``: registered, or the same spec was there;
        ``(False, a description of theirs)``: the server holds another spec; ``(None, _)``: the server
        could not be asked (retried on the next call)."""
        ours = pack_spec(self._specs[namespace])
        key = self._spec_key(namespace)
        replies = self._pipeline([("SET", key, ours, {"nx": True}), ("GET", key)])
        if isinstance(replies, BaseException):
            return None, None
        for reply in replies:
            if isinstance(reply, Exception):
                self._fail(reply)
                return None, None
        stored = replies[1]
        if stored != ours:
            try:
                theirs = unpack_spec(stored)
            except (ValueError, TypeError):
                return False, f"an unreadable spec of {len(stored or b'')} bytes"
            if theirs != self._specs[namespace]:
                return False, describe(theirs)
        with self._lock:
            self._unregistered.discard(namespace)
        return True, None

    # -- keys and values -------------------------------------------------------------------
    @staticmethod
    def _key(namespace: bytes, block_hash: bytes) -> bytes:
        return b"%s%s:%s" % (KEY_PREFIX, namespace.hex().encode(), block_hash.hex().encode())

    @staticmethod
    def _spec_key(namespace: bytes) -> bytes:
        return b"%s%s:spec" % (KEY_PREFIX, namespace.hex().encode())

    def _decode(
        self, namespace: bytes, key: bytes, reply: object, out: torch.Tensor, fingerprint: bytes | None
    ) -> ReadStatus:
        if reply is None or reply == b"":  # GETRANGE of a missing key: an empty string
            return ReadStatus.MISSING
        if isinstance(reply, Exception):
            self._fail(reply)
            return _status_of(reply)
        status = decode_into(memoryview(reply), namespace, out, fingerprint)
        if status in (ReadStatus.TOKEN_MISMATCH, ReadStatus.OTHER_VERSION):
            self.errors[status.value] += 1  # intact: a miss, left for Redis to age out
        elif status is ReadStatus.CORRUPT:
            self.errors["corrupt"] += 1
            logger.warning("RedisTier: corrupt value at %s on %s; deleting it", key[:40], self.url)
            self._pipeline([("DEL", key)])  # best effort: the next put writes it again
        return status

    # -- connection ------------------------------------------------------------------------
    def _pipeline(self, commands: Sequence[tuple]) -> list | BaseException:
        """Run ``commands`` (``(name, *args[, options dict])``) in one non-transactional
        pipeline: the replies (a per-command error as an exception object), or the exception
        when the whole pipeline failed (counted, backoff started)."""
        try:
            client = self._connect()
            pipe = client.pipeline(transaction=False)
            for name, *args in commands:
                options = args.pop() if args and isinstance(args[-1], dict) else {}
                if name == "SET":
                    pipe.set(*args, **options)
                else:
                    pipe.execute_command(name, *args)
            replies = pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException, OSError) as exc:
            self._fail(exc)
            return exc
        if not any(isinstance(r, Exception) and not _command_error(r) for r in replies):
            self._succeeded()  # (a cluster pipeline reports a node that is down per command)
        return replies

    def _connect(self):
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._closed:
                raise RedisConnectionError("RedisTier is closed")
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self):
        options = client_options(self.timeout_s, tls=self._client_url.startswith("rediss:"), guarded=True)
        if self.cluster:
            # Connects to discover the slot map: raises while the cluster is down (retried
            # on the next call after the backoff).
            return RedisCluster.from_url(self._client_url, retry=Retry(NoBackoff(), 1), **options)
        # One retry, on connection errors only: a pooled socket broken by a server restart.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        return redis.Redis.from_url(self._client_url, retry=retry, **options)

    def _fail(self, exc: BaseException) -> None:
        message = str(exc)
        if _command_error(exc):
            reason = "oom" if isinstance(exc, OutOfMemoryError) or message.startswith("OOM") else "protocol"
            self.errors[reason] += 1
            count = self.errors[reason]
            if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: a full server logs a few lines, not one per block
                logger.warning("RedisTier: %s from %s (%d so far): %s", reason, self.url, count, message)
            return
        reason = "timeout" if isinstance(exc, RedisTimeoutError) else "unavailable"
        self.errors["oversize" if isinstance(exc, ReplyTooLarge) else reason] += 1
        with self._lock:
            # The server may come back empty (restart without persistence, failover): check
            # the namespaces' specs again before the next use.
            self._unregistered.update(ns for ns in self._specs if ns not in self._conflicts)
        pause_s = self.backoff.failed()
        logger.warning("RedisTier: %s unreachable (%s: %s); misses for %.2f s",
                       self.url, type(exc).__name__, message, pause_s)

    def _succeeded(self) -> None:
        self.backoff.succeeded()


# -- helpers -------------------------------------------------------------------------------
def _parse_url(url: str) -> tuple[str, bool, float | None]:
    """``(url for redis-py, is cluster, ttl_s from the query)``."""
    if not isinstance(url, str):
        raise ValueError(f"expected a redis:// URL string, got {type(url).__name__}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "redis+cluster") or not parts.hostname:
        raise ValueError(f"expected redis://host:port[/db], rediss://... or redis+cluster://host:port, got {_redact(url)!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    ttl_s = None
    rest = []
    for name, value in query:
        if name == "protocol":
            raise ValueError("expected no ?protocol= in a RedisTier URL (it speaks RESP2, where replies can be bounded)")
        if name == "ttl_s":
            try:
                ttl_s = float(value)
            except ValueError:
                raise ValueError(f"expected ?ttl_s=SECONDS, got {value!r}") from None
        else:
            rest.append((name, value))
    cluster = scheme == "redis+cluster"
    client_scheme = "redis" if cluster else scheme
    return urlunsplit((client_scheme, parts.netloc, parts.path, urlencode(rest), "")), cluster, ttl_s


def _redact(url: str) -> str:
    """``url`` without its password (for logs and repr)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{netloc}", parts.path, parts.query, ""))


def _command_error(exc: BaseException) -> bool:
    """An error reply to one command (``OOM``, a wrong type): the server is up. MOVED/ASK/
    CLUSTERDOWN/TRYAGAIN also come as ResponseError subclasses, but mean a cluster that is
    changing or down."""
    return isinstance(exc, ResponseError) and not isinstance(exc, (AskError, ClusterDownError, MovedError, TryAgainError))


def _status_of(exc: BaseException | None) -> ReadStatus:
    return ReadStatus.TIMEOUT if isinstance(exc, RedisTimeoutError) else ReadStatus.UNAVAILABLE


def _check_tensors(tensors: Sequence[torch.Tensor], n: int, spec: KVSpec, name: str) -> None:
    if len(tensors) != n:
        raise ValueError(f"expected {n} {name} (one per block hash), got {len(tensors)}")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected {name} to be tensors, got {type(t).__name__}")
        if tuple(t.shape) != spec.block_shape or t.dtype != spec.dtype:
            raise ValueError(f"expected {name} of shape {spec.block_shape} and dtype {spec.dtype}, got {tuple(t.shape)} {t.dtype}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"expected {name} as contiguous CPU tensors, got device {t.device}, contiguous={t.is_contiguous()}")
