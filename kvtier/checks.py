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
- **the daemon's other names** (issue 12), each one ASCII grammar, matched whole, nothing
  trimmed or case-folded (``str.isdigit`` and ``\\d`` accept unicode digits: never used here):
  a **tenant** ``[a-z0-9][a-z0-9_-]{0,31}`` (a directory name: never ``.``, ``..``, a hex
  namespace or a file of the data directory); a **display name** ``[A-Za-z0-9][A-Za-z0-9._:-]{0,63}``
  (a metrics label); a **token** 1-1024 printable ASCII characters without whitespace (an HTTP
  header value); fixed-length **lowercase hex** (:func:`parse_hex`); an **unsigned decimal**
  (:func:`parse_uint`); a **unix URL** ``unix:///absolute/path`` (:func:`parse_unix_url`).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # kvtier.types imports torch; the CLI's --help (StoreConfig's checks) must not
    from kvtier.types import BlockHash, Fingerprint

NAMESPACE_NBYTES = 32
BLOCK_HASH_NBYTES = (16, 32)
"""Block hash sizes: xxh3-128 and SHA-256 (kvtier.hashing)."""

FINGERPRINT_NBYTES = 32
"""A block's token fingerprint: SHA-256 (kvtier.hashing)."""

_NAMESPACE_HEX = re.compile(r"[0-9a-f]{64}")
_TENANT = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_DISPLAY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_TOKEN = re.compile(r"[\x21-\x7e]{1,1024}")
_UINT = re.compile(r"[0-9]{1,19}")
UNIX_PATH_MAX_NBYTES = 107
"""Longest path of a Unix socket (``sun_path`` is 108 bytes on Linux, NUL included)."""


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
        raise ValueError(f"expected the namespace as 64 lowercase hex digits, got {_got(text)}")
    return bytes.fromhex(text)


def _got(text: Any) -> str:
    return repr(text[:80]) if isinstance(text, str) else type(text).__name__


def parse_hex(text: Any, nbytes: int, what: str) -> bytes:
    """``nbytes`` bytes spelled as exactly ``2 * nbytes`` lowercase hex digits."""
    if not isinstance(text, str) or len(text) != 2 * nbytes or not re.fullmatch(r"[0-9a-f]*", text):
        raise ValueError(f"expected {what} as {2 * nbytes} lowercase hex digits, got {_got(text)}")
    return bytes.fromhex(text)


def parse_uint(text: Any, what: str, maximum: int = (1 << 63) - 1) -> int:
    """A decimal ``0 <= n <= maximum``: ASCII digits only (no sign, space, ``_`` or unicode digit)."""
    if not isinstance(text, str) or not _UINT.fullmatch(text) or int(text) > maximum:
        raise ValueError(f"expected {what} as a decimal integer in [0, {maximum}], got {_got(text)}")
    return int(text)


def parse_tenant(text: Any) -> str:
    """A tenant name: ``[a-z0-9][a-z0-9_-]{0,31}`` (it names a directory of the daemon)."""
    if not isinstance(text, str) or not _TENANT.fullmatch(text):
        raise ValueError(f"expected a tenant name of 1-32 characters a-z 0-9 _ - (not starting with _ or -), "
                         f"got {_got(text)}")
    return text


def parse_display_name(text: Any) -> str:
    """A namespace's display name: ``[A-Za-z0-9][A-Za-z0-9._:-]{0,63}`` (a metrics label)."""
    if not isinstance(text, str) or not _DISPLAY_NAME.fullmatch(text):
        raise ValueError(f"expected a display name of 1-64 characters A-Z a-z 0-9 . _ : - (starting with a "
                         f"letter or digit), got {_got(text)}")
    return text


def check_token(text: Any, min_length: int = 1) -> str:
    """A bearer token: ``min_length``-1024 printable ASCII characters, no whitespace."""
    if not isinstance(text, str) or not _TOKEN.fullmatch(text) or len(text) < min_length:
        shown = f"str of length {len(text)}" if isinstance(text, str) else type(text).__name__
        raise ValueError(f"expected a token of {min_length}-1024 printable ASCII characters without whitespace, "
                         f"got {shown}")
    return text


def parse_unix_url(url: Any) -> str:
    """The socket path of ``unix:///absolute/path`` (normalized: no ``.``/``..``/``//``, no
    query, at most :data:`UNIX_PATH_MAX_NBYTES` bytes). Raises ``ValueError``."""
    if isinstance(url, str) and url.startswith("unix://"):
        path = url[len("unix://"):]
        if (path.startswith("/") and path == posixpath.normpath(path) and not path.startswith("//")
                and path != "/" and all(c.isprintable() and c not in "?#" for c in path)
                and len(path.encode()) <= UNIX_PATH_MAX_NBYTES):
            return path
    raise ValueError(f"expected a unix socket URL like unix:///run/kvtier/kvtier.sock (an absolute, normalized "
                     f"path of at most {UNIX_PATH_MAX_NBYTES} bytes), got {_got(url)}")


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


class CheckedHashes(tuple):
    """Block hashes that :func:`checked_block_hashes` found valid: an immutable sequence, so
    they stay valid, and a store may skip checking them again (the daemon validates a
    request's hashes once at its boundary: a second check inside the store was ~2% of a
    lookup). Only :func:`checked_block_hashes` should make one; slices are plain tuples."""

    __slots__ = ()


def checked_block_hashes(values: Any, max_blocks: int | None = None) -> CheckedHashes:
    """:func:`check_block_hashes`, as a :class:`CheckedHashes`; raises like it."""
    return CheckedHashes(check_block_hashes(values, max_blocks))


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
