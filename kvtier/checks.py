"""Boundary checks: the one place where kvtier parses the namespaces and block hashes it is
handed, by a caller of the store, a REMOTE backend's caller, or a client of the daemon.

Rules (every check raises ``ValueError("expected ..., got ...")``):

- **namespace**: ``bytes`` of exactly :data:`NAMESPACE_NBYTES` (32: the SHA-256 of a
  :class:`~kvtier.hashing.KeyContext`). Spelled in a URL or a directory name, it is exactly 64
  lowercase hex digits, ``namespace.hex()``, and nothing else: no whitespace, no uppercase, no
  sign. Python's ``bytes.fromhex`` skips whitespace, so 64 characters can decode to fewer
  than 32 bytes, down to ``b""``, whose directory under the daemon's data directory is the
  data directory itself (issue 12). Every namespace that names a path goes through
  :func:`parse_namespace` or :func:`check_namespace` first.
- **block hash**: ``bytes`` of 16 (xxh3-128) or 32 (SHA-256) bytes, what
  :mod:`kvtier.hashing` makes (:data:`BLOCK_HASH_NBYTES`). One rule for the store, DISK (LMDB
  keys, at most 511 bytes), Redis keys and the daemon's frames (whose ``hash_len`` is one byte).
- **fingerprints** (:mod:`kvtier.hashing`): ``None`` (the caller does not know the tokens),
  or a sequence of ``bytes`` of exactly :data:`FINGERPRINT_NBYTES`, one per block hash
  (:func:`check_fingerprints`); the fingerprints a REMOTE read expects may also hold ``None``
  entries, blocks not checked (:func:`expected_fingerprints`).
- **a batch** of block hashes: a sequence (a msgpack array on the wire), at most
  ``max_blocks`` long when a limit is given; over the limit, :class:`BatchTooLarge` (the
  daemon answers 413).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from kvtier.types import BlockHash, Fingerprint

NAMESPACE_NBYTES = 32
BLOCK_HASH_NBYTES = (16, 32)
"""Block hash sizes: xxh3-128 and SHA-256 (kvtier.hashing)."""

FINGERPRINT_NBYTES = 32
"""A block's token fingerprint: SHA-256 (kvtier.hashing)."""

_NAMESPACE_HEX = re.compile(r"[0-9a-f]{64}")


class BatchTooLarge(ValueError):
    """A batch of block hashes over the configured limit (HTTP 413)."""


def _describe(value: Any) -> str:
    """``"7 bytes"``, ``"str of length 3"``, ``"int"``: what a check got, for its message."""
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    if hasattr(value, "__len__"):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__


def check_namespace(namespace: Any) -> bytes:
    """``namespace`` if it is ``bytes`` of 32 bytes; raises ``ValueError`` otherwise."""
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_NBYTES:
        raise ValueError(f"expected a namespace of {NAMESPACE_NBYTES} bytes, got {_describe(namespace)}")
    return namespace


def namespace_hex(namespace: bytes) -> str:
    """The spelling of a namespace in URLs and directory names: 64 lowercase hex digits."""
    return check_namespace(namespace).hex()


def parse_namespace(text: Any) -> bytes:
    """The 32-byte namespace spelled by ``text``: exactly 64 lowercase hex digits (the
    inverse of :func:`namespace_hex`). Raises ``ValueError`` for anything else."""
    if not isinstance(text, str) or not _NAMESPACE_HEX.fullmatch(text):
        got = repr(text[:80]) if isinstance(text, str) else type(text).__name__
        raise ValueError(f"expected the namespace as 64 lowercase hex digits, got {got}")
    return bytes.fromhex(text)


def check_block_hashes(values: Any, max_blocks: int | None = None) -> list[BlockHash]:
    """``values`` as a list of block hashes (``values`` itself when it is a list).

    Args:
        values: a sequence (list or tuple) of ``bytes`` of 16 or 32 bytes.
        max_blocks: the most hashes allowed, or ``None`` for no limit.

    Raises:
        BatchTooLarge: more than ``max_blocks`` hashes.
        ValueError: anything else that is not such a sequence.
    """
    if not isinstance(values, (list, tuple)):
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
            raise ValueError(f"expected block hashes as a list of bytes, got {type(values).__name__}")
        values = list(values)
    if max_blocks is not None and len(values) > max_blocks:
        raise BatchTooLarge(f"expected at most {max_blocks} block hashes per call, got {len(values)}")
    for h in values:  # the store's hot path: no enumerate
        if not isinstance(h, bytes) or len(h) not in BLOCK_HASH_NBYTES:
            i = next(i for i, x in enumerate(values) if x is h)
            raise ValueError(f"expected block hashes as bytes of 16 or 32 bytes, got {_describe(h)} at index {i}")
    return values if isinstance(values, list) else list(values)


def check_fingerprints(values: Any, num_blocks: int) -> list[Fingerprint] | None:
    """``values`` as a list of ``num_blocks`` fingerprints, or ``None`` when it is ``None``.

    Raises:
        ValueError: not a sequence of ``num_blocks`` ``bytes`` of 32 bytes.
    """
    if values is None:
        return None
    if not isinstance(values, (list, tuple)):
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
            raise ValueError(f"expected fingerprints as a list of bytes, got {type(values).__name__}")
        values = list(values)
    if len(values) != num_blocks:
        raise ValueError(f"expected one fingerprint per block hash ({num_blocks}), got {len(values)}")
    for fp in values:
        if not isinstance(fp, bytes) or len(fp) != FINGERPRINT_NBYTES:
            i = next(i for i, x in enumerate(values) if x is fp)
            raise ValueError(
                f"expected fingerprints as bytes of {FINGERPRINT_NBYTES} bytes, got {_describe(fp)} at index {i}"
            )
    return values if isinstance(values, list) else list(values)


def expected_fingerprints(values: Any, num_blocks: int) -> list[Fingerprint | None]:
    """The fingerprints a read expects, one per block: ``values`` with ``None`` entries (not
    checked) allowed; all ``None`` when ``values`` is ``None``.

    Raises:
        ValueError: not a sequence of ``num_blocks`` entries, each ``None`` or 32 bytes.
    """
    if values is None:
        return [None] * num_blocks
    if not isinstance(values, (list, tuple)) or len(values) != num_blocks:
        got = _describe(values)
        raise ValueError(f"expected a list of {num_blocks} fingerprints (or None entries), got {got}")
    for fp in values:
        if fp is not None and (not isinstance(fp, bytes) or len(fp) != FINGERPRINT_NBYTES):
            raise ValueError(
                f"expected fingerprints as bytes of {FINGERPRINT_NBYTES} bytes or None, got {_describe(fp)}"
            )
    return list(values)
