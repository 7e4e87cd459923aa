"""The daemon's wire format, shared by the server (kvtier.server.app) and its client
(kvtier.tiers.remote). No aiohttp here: the client imports it.

Bodies of the small calls (register, lookup, get request) are msgpack maps
(``application/msgpack``); block hashes are msgpack ``bin`` of 16 or 32 bytes.

Block transfers (the ``get`` response and the ``put`` request) are a stream of frames
(``application/x-kvtier-frames``), so neither side ever holds a whole batch::

    frame = hash_len u8 (16 or 32) | block_hash | record (kvtier.records: 96-byte header
            with payload_nbytes and checksum, then payload_nbytes raw block bytes)
    body  = frame* | 0x00                  (a zero hash_len ends the stream)

The end byte tells a complete stream from one cut short (a daemon killed mid-response). A
``get`` response holds the leading blocks present, in request order; a ``put`` request any
blocks, each verified (namespace, block shape and dtype, checksum) before it is stored.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from kvtier.types import DTYPE_NAMES, DTYPES_BY_NAME, BlockHash, KVSpec

MSGPACK = "application/msgpack"
FRAMES = "application/x-kvtier-frames"
HASH_NBYTES = (16, 32)
"""Block hash sizes the daemon accepts: xxh3-128 and SHA-256 (kvtier.hashing)."""
END = b"\x00"
API_PREFIX = "/v1/namespaces/"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_map(body: bytes, what: str) -> dict:
    """A msgpack map; raises ``ValueError`` ("expected ..., got ...") for anything else."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"expected a msgpack map as the {what} body, got undecodable bytes ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a msgpack map as the {what} body, got {type(obj).__name__}")
    return obj


def namespace_hex(namespace: bytes) -> str:
    return namespace.hex()


def parse_namespace(ns_hex: str) -> bytes:
    """The 32-byte namespace named by 64 lowercase or uppercase hex digits in a URL."""
    if len(ns_hex) != 64:
        raise ValueError(f"expected the namespace as 64 hex digits, got {len(ns_hex)} characters")
    try:
        return bytes.fromhex(ns_hex)
    except ValueError:
        raise ValueError(f"expected the namespace as 64 hex digits, got {ns_hex[:80]!r}") from None


def check_hashes(values: Any, max_blocks: int) -> list[BlockHash]:
    """``values`` as block hashes: a list of at most ``max_blocks`` ``bytes`` of 16 or 32
    bytes. Raises ``ValueError`` otherwise (``OverflowError``, a ``ValueError``, when the
    list is too long: the server answers 413 for it)."""
    if not isinstance(values, list):
        raise ValueError(f"expected block_hashes as a list of bin, got {type(values).__name__}")
    if len(values) > max_blocks:
        raise BatchTooLarge(f"expected at most {max_blocks} block hashes per call (--max-batch-blocks), got {len(values)}")
    for i, h in enumerate(values):
        if not isinstance(h, bytes) or len(h) not in HASH_NBYTES:
            got = f"{len(h)} bytes" if isinstance(h, (bytes, str)) else type(h).__name__
            raise ValueError(f"expected block_hashes[{i}] as bin of 16 or 32 bytes, got {got}")
    return [BlockHash(h) for h in values]


class BatchTooLarge(ValueError):
    """A batch over the configured limit (HTTP 413)."""


def spec_to_wire(spec: KVSpec) -> dict:
    """``{"block_shape": [num_layers, 2, block_size, num_kv_heads, head_dim], "dtype": name}``."""
    return {"block_shape": list(spec.block_shape), "dtype": DTYPE_NAMES[spec.dtype]}


def spec_from_wire(obj: Any) -> KVSpec:
    """Inverse of :func:`spec_to_wire`; raises ``ValueError`` with what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a map with block_shape and dtype, got {type(obj).__name__}")
    shape, dtype = obj.get("block_shape"), obj.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES_BY_NAME:
        raise ValueError(f"expected dtype in {sorted(DTYPES_BY_NAME)}, got {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) != 5
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 1 << 31 for d in shape)
        or shape[1] != 2
    ):
        raise ValueError(
            f"expected block_shape [num_layers, 2, block_size, num_kv_heads, head_dim] of positive ints, got {shape!r}"
        )
    num_layers, _, block_size, num_kv_heads, head_dim = shape
    return KVSpec(num_layers, num_kv_heads, head_dim, block_size, DTYPES_BY_NAME[dtype])


def frame_prefix(block_hash: bytes) -> bytes:
    """``hash_len | block_hash``: what precedes a record in a frame."""
    return bytes((len(block_hash),)) + block_hash


def frame_nbytes(block_hash: bytes, payload_nbytes: int) -> int:
    from kvtier.records import HEADER_NBYTES

    return 1 + len(block_hash) + HEADER_NBYTES + payload_nbytes


def max_frames_nbytes(max_batch_blocks: int, max_block_bytes: int) -> int:
    """Largest valid frame stream: ``max_batch_blocks`` frames of 32-byte hashes and blocks
    of ``max_block_bytes``, plus the end byte."""
    return max_batch_blocks * frame_nbytes(b"\0" * 32, max_block_bytes) + len(END)


def block_bytes(block: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 too)."""
    return memoryview(block.view(torch.uint8).numpy()).cast("B")


def same_spec(a: KVSpec, b: KVSpec) -> bool:
    return a.block_shape == b.block_shape and a.dtype == b.dtype


def describe(spec: KVSpec) -> str:
    return f"block_shape {list(spec.block_shape)} {DTYPE_NAMES[spec.dtype]}"

