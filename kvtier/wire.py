"""kvtier's wire formats above the block record: the ``kvtier serve`` daemon's HTTP bodies and
block frames, and the one encoding of a :class:`~kvtier.types.KVSpec`. Shared by the daemon
(kvtier.server), its client (kvtier.tiers.remote) and Redis (kvtier.tiers.redis, spec key);
no aiohttp here. Namespaces and block hashes are checked by :mod:`kvtier.checks`.

Bodies of the small calls (register, lookup, get request) are msgpack maps
(``application/msgpack``); block hashes are msgpack ``bin`` of 16 or 32 bytes.

Block transfers (the ``get`` response and the ``put`` request) are a stream of frames
(``application/x-kvtier-frames``), so neither side ever holds a whole batch::

    frame = hash_len u8 (16 or 32) | block_hash | record (kvtier.records: 128-byte header
            with the block's token fingerprint, payload_nbytes and checksum, then
            payload_nbytes raw block bytes)
    body  = frame* | 0x00                  (a zero hash_len ends the stream)

The end byte tells a complete stream from one cut short (a daemon killed mid-response). A
``get`` response holds the leading blocks present, in request order; a ``put`` request any
blocks, each verified (namespace, block shape and dtype, checksum) before it is stored.

A KVSpec is ``{"block_shape": [num_layers, 2, block_size, num_kv_heads, head_dim], "dtype":
name}`` everywhere: the daemon's register body and replies, its ``<ns>/spec.msgpack`` files,
Redis's ``kvtier:<ns>:spec`` key (:func:`pack_spec` / :func:`unpack_spec`).
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from kvtier.records import HEADER_NBYTES
from kvtier.types import DTYPE_NAMES, DTYPES_BY_NAME, KVSpec

MSGPACK = "application/msgpack"
FRAMES = "application/x-kvtier-frames"
END = b"\x00"


# -- msgpack bodies ----------------------------------------------------------------------------
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


# -- KVSpec ------------------------------------------------------------------------------------
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


def pack_spec(spec: KVSpec) -> bytes:
    """:func:`spec_to_wire` as msgpack bytes (a spec file, a Redis spec key)."""
    return pack(spec_to_wire(spec))


def unpack_spec(data: bytes) -> KVSpec:
    """Inverse of :func:`pack_spec`; raises ``ValueError`` for anything else."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"expected a msgpack spec, got undecodable bytes ({exc})") from None
    return spec_from_wire(obj)


def describe(spec: KVSpec) -> str:
    return f"block_shape {list(spec.block_shape)} {DTYPE_NAMES[spec.dtype]}"


# -- frames ------------------------------------------------------------------------------------
def frame_prefix(block_hash: bytes) -> bytes:
    """``hash_len | block_hash``: what precedes a record in a frame."""
    return bytes((len(block_hash),)) + block_hash


def frame_nbytes(block_hash: bytes, payload_nbytes: int) -> int:
    return 1 + len(block_hash) + HEADER_NBYTES + payload_nbytes


def max_frames_nbytes(max_batch_blocks: int, max_block_bytes: int) -> int:
    """Largest valid frame stream: ``max_batch_blocks`` frames of 32-byte hashes and blocks
    of ``max_block_bytes``, plus the end byte."""
    return max_batch_blocks * frame_nbytes(b"\0" * 32, max_block_bytes) + len(END)


def block_bytes(block: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 too)."""
    return memoryview(block.view(torch.uint8).numpy()).cast("B")
