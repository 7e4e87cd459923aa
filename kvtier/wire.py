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
Redis's ``kvtier:<ns>:spec`` key (:func:`pack_spec` / :func:`unpack_spec`). A spec with layer
groups (kvtier.types.LayerGroup: sliding windows, MLA, ...) adds ``"block_size"`` and
``"groups": [{"kind", "layers", "num_kv_heads", "k_head_dim", "v_head_dim", "window"}, ...]``,
and its ``block_shape`` is the spec's (``[block_numel]`` for a flat layout); an all-full spec
is encoded exactly as before, so older clients and daemons still agree on it.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from kvtier.records import HEADER_NBYTES
from kvtier.types import DTYPE_NAMES, DTYPES_BY_NAME, KV_LAYOUT, KV_LAYOUT_HEAD_MAJOR, KVSpec, LayerGroup, positive_int

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
    """``{"block_shape": [num_layers, 2, block_size, num_kv_heads, head_dim], "dtype": name}``,
    plus ``"block_size"`` and ``"groups"`` for a spec with layer groups, and ``"layout":
    "LKVHTD"`` for a head-major one (its block_shape ``[num_layers, 2, num_kv_heads,
    block_size, head_dim]``; a reader without the key would take the shape as token-major
    and still move the same bytes)."""
    wire: dict = {"block_shape": list(spec.block_shape), "dtype": DTYPE_NAMES[spec.dtype]}
    if spec.groups:
        wire.update(block_size=spec.block_size, groups=groups_to_wire(spec))
    if spec.head_major:
        wire["layout"] = KV_LAYOUT_HEAD_MAJOR
    return wire


def spec_from_wire(obj: Any) -> KVSpec:
    """Inverse of :func:`spec_to_wire`; raises ``ValueError`` with what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a map with block_shape and dtype, got {type(obj).__name__}")
    shape, dtype = obj.get("block_shape"), obj.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES_BY_NAME:
        raise ValueError(f"expected dtype in {sorted(DTYPES_BY_NAME)}, got {dtype!r}")
    layout = obj.get("layout", KV_LAYOUT)
    if layout not in (KV_LAYOUT, KV_LAYOUT_HEAD_MAJOR):
        raise ValueError(f"expected layout {KV_LAYOUT!r} or {KV_LAYOUT_HEAD_MAJOR!r}, got {layout!r:.80}")
    head_major = layout == KV_LAYOUT_HEAD_MAJOR
    if "groups" in obj:
        spec = spec_from_groups_wire(obj["groups"], obj.get("block_size"), DTYPES_BY_NAME[dtype], head_major)
        if head_major and not spec.head_major:
            raise ValueError(f"expected uniform groups for layout {layout!r}, got {spec.layout_name}")
        if shape != list(spec.block_shape):
            raise ValueError(f"expected block_shape {list(spec.block_shape)} for these groups, got {shape!r}")
        return spec
    if (
        not isinstance(shape, list)
        or len(shape) != 5
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 1 << 31 for d in shape)
        or shape[1] != 2
    ):
        raise ValueError(
            f"expected block_shape [num_layers, 2, block_size, num_kv_heads, head_dim] of positive ints, got {shape!r}"
        )
    if head_major:
        num_layers, _, num_kv_heads, block_size, head_dim = shape
    else:
        num_layers, _, block_size, num_kv_heads, head_dim = shape
    return KVSpec(num_layers, num_kv_heads, head_dim, block_size, DTYPES_BY_NAME[dtype], head_major=head_major)


_GROUP_KEYS = ("kind", "layers", "num_kv_heads", "k_head_dim", "v_head_dim", "window")
_MAX_WIRE_GROUPS = 256
_MAX_WIRE_LAYERS = 1 << 12


def groups_to_wire(spec: KVSpec) -> list[dict]:
    """``spec.groups`` as plain maps (msgpack/JSON): ``[{"kind", "layers", "num_kv_heads",
    "k_head_dim", "v_head_dim", "window"}, ...]``; ``[]`` for a full-attention spec."""
    return [{key: list(g.layers) if key == "layers" else getattr(g, key) for key in _GROUP_KEYS} for g in spec.groups]


def spec_from_groups_wire(obj: object, block_size: object, dtype: torch.dtype, head_major: bool = False) -> KVSpec:
    """Inverse of :func:`groups_to_wire` (with the spec's block_size and dtype), parsed
    strictly: a list of at most 256 maps with exactly the keys above, ints in range, at most
    4096 layers in all.

    Raises:
        ValueError: anything else, saying what is wrong.
    """
    if not isinstance(obj, list) or not obj or len(obj) > _MAX_WIRE_GROUPS:
        got = f"a list of {len(obj)}" if isinstance(obj, list) else type(obj).__name__
        raise ValueError(f"expected groups as a list of 1..{_MAX_WIRE_GROUPS} maps, got {got}")
    positive_int("block_size", block_size)
    groups, num_layers = [], 0
    for item in obj:
        if not isinstance(item, dict) or set(item) != set(_GROUP_KEYS):
            got = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise ValueError(f"expected a group map with keys {sorted(_GROUP_KEYS)}, got {got}")
        layers = item["layers"]
        num_layers += len(layers) if isinstance(layers, list) else 0
        if not isinstance(layers, list) or num_layers > _MAX_WIRE_LAYERS:
            raise ValueError(f"expected layers as lists of at most {_MAX_WIRE_LAYERS} ints in all, got {layers!r:.80}")
        for key in ("num_kv_heads", "k_head_dim", "v_head_dim", "window"):
            value = item[key]
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value >= 1 << 31):
                raise ValueError(f"expected {key} as an int below 2**31, got {value!r}")
        groups.append(LayerGroup(item["kind"], tuple(layers), item["num_kv_heads"], item["k_head_dim"],
                                 item["v_head_dim"], item["window"]))
    return KVSpec.from_groups(groups, block_size, dtype, head_major)  # type: ignore[arg-type]


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
    layout = f" {spec.layout_name}" if spec.groups or spec.head_major else ""
    return f"block_shape {list(spec.block_shape)} {DTYPE_NAMES[spec.dtype]}{layout}"


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
