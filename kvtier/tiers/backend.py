"""The REMOTE tier's contract: a shared block store below DISK that many engine processes
(and machines) read and write. Two implementations: :class:`kvtier.tiers.remote.RemoteTier`
(HTTP client of a ``kvtier serve`` daemon) and :class:`kvtier.tiers.redis.RedisTier`
(Redis or Redis Cluster).

Values are block records (:mod:`kvtier.records`: header + checksum + payload, with the
block's token fingerprint in the header), keyed by ``(namespace, block_hash)``; every read
is verified before a byte is handed over, by the reading client itself: against the
caller's expected fingerprints too (a REMOTE server cannot be trusted to check them).

Failure model (the store relies on it): a backend never raises from ``lookup``, ``get_into``
or ``put`` for a remote-side problem (down, slow, restarting, protocol error, corrupt value).
Such a problem is a miss (``lookup`` -> fewer blocks, ``get_into`` -> a non-OK status,
``put`` -> False), counted in ``errors`` by reason; the next call tries again (reconnects).
They raise ``ValueError``/``TypeError`` only for caller bugs (bad hash, wrong tensor).
Calls are blocking and thread-safe: the store calls them from its I/O threads, outside its
lock, each bounded by the configured timeout.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol, Sequence, runtime_checkable

import torch

from kvtier.records import ReadStatus
from kvtier.types import BlockHash, KVSpec


@runtime_checkable
class RemoteBackend(Protocol):
    errors: Counter
    """Remote-side failures by reason (``timeout``, ``unavailable``, ``corrupt``, ...)."""

    def register(self, namespace: bytes, spec: KVSpec) -> None:
        """Declare the block shape/dtype of ``namespace`` (idempotent). Raises ``ValueError``
        if the remote already knows ``namespace`` with another spec; a remote that is down
        is not an error (registration is retried on the next call)."""

    def lookup(self, namespace: bytes, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading ``block_hashes`` present remotely (0 when unreachable)."""

    def get_into(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], outs: Sequence[torch.Tensor],
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[ReadStatus]:
        """Read each block into ``outs[i]`` (contiguous CPU tensor of ``spec.block_shape``
        and dtype); one status per block. ``fingerprints[i]``: the token fingerprint block
        ``i`` must carry (``None``: not checked); a record of other tokens is
        ``TOKEN_MISMATCH``. ``outs[i]`` holds the block's exact bytes iff its status is
        ``OK``; after a non-OK block, later ones may be skipped (``MISSING``)."""

    def put(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor],
        fingerprints: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Write blocks (contiguous CPU tensors), each with its token fingerprint (default
        :data:`~kvtier.types.NO_FINGERPRINT`); ``True`` for each block the remote
        acknowledged as stored. Idempotent: a block already present stays as it is."""

    def close(self) -> None:
        """Release connections. Idempotent."""

    # Optional (not part of the runtime check, so that a backend without it still is one):
    # ``clear_namespace(namespace) -> int | None`` deletes every block of ``namespace`` (it
    # stays registered) and returns how many, or ``None`` when the remote could not be
    # reached; ``TieredStore.reset`` calls it when present (RedisTier, MemoryRemote, and
    # RemoteTier: the daemon empties a namespace for an admin token only).


def make_remote(url: str, token: str | None = None, timeout_s: float = 2.0) -> RemoteBackend:
    """Backend for a ``remote_url``: ``http(s)://`` and ``unix:///path`` -> RemoteTier (the
    daemon), ``redis://``, ``rediss://``, ``redis+cluster://`` -> RedisTier. Raises
    ``ValueError`` on another scheme."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("http", "https", "unix"):
        from kvtier.tiers.remote import RemoteTier

        return RemoteTier(url, token=token, timeout_s=timeout_s)
    if scheme in ("redis", "rediss", "redis+cluster"):
        from kvtier.tiers.redis import RedisTier

        return RedisTier(url, timeout_s=timeout_s)
    raise ValueError(f"expected an http://, unix://, redis:// or redis+cluster:// remote_url, got {url!r}")
