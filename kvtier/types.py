"""Core types and the glossary kvtier uses everywhere.

Glossary (the terms of vLLM v1 core and nano-vllm, used the same way in every module):

- **block**: ``block_size`` consecutive tokens of K and V for every layer of the model.
- **block_hash**: content key of a block, chained over the prompt's blocks and rooted in
  the namespace (:mod:`kvtier.hashing`). A :class:`BlockHash` is ``bytes`` (32 bytes for
  SHA-256, 16 for xxh3-128).
- **fingerprint**: a 32-byte SHA-256 of the tokens a block covers (its parent's fingerprint,
  its token ids, its extra keys; :mod:`kvtier.hashing`). Every tier keeps it with the block
  and a load checks it against the request's: the hash decides where to look, the
  fingerprint what may be served (:data:`NO_FINGERPRINT`: stored without tokens).
- **namespace**: digest of everything that changes the K/V bytes (model, weights revision,
  dtype, KV layout, block_size, TP rank/size, LoRA, tenant ``cache_salt``).
- **block_id**: a slot in a tier's preallocated pool tensor (GPU or CPU medium).
- **block_table**: a request's block ids, in prompt order.
- **num_computed_tokens / num_cached_tokens**: tokens whose K/V exist before prefill.
- **medium / tier**: ``GPU``, ``CPU``, ``DISK``, ``REMOTE``, top to bottom. Moving down is
  *offload* (or *spill*, when an eviction forces it); moving up is *load* (*promotion* when
  the copy lands in the GPU pool); *prefetch* is an early, asynchronous load; *evict* drops
  one tier's copy of a block.
- **pin / lease**: a pinned block cannot be evicted from any tier; every pin is released
  exactly once, through its :class:`~kvtier.store.Lease`.
- **ref_cnt**: number of live pins on a block hash.

Block layout (``KVSpec.block_shape``), one block::

    [num_layers, 2, block_size, num_kv_heads, head_dim]   # 2 = (K, V)

so a GPU/CPU pool tensor is ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (the per-token ``[block_size, num_kv_heads, head_dim]`` inner layout is the one
vLLM's paged caches use, so a block moves to and from them with one gather per layer).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NewType

import torch

BlockHash = NewType("BlockHash", bytes)
Fingerprint = NewType("Fingerprint", bytes)
NO_FINGERPRINT = Fingerprint(bytes(32))
"""The fingerprint of a block stored without its tokens (the store API called without
fingerprints): it never matches a real fingerprint, so such a block never serves a load that
checks its tokens."""


class Medium(str, enum.Enum):
    """Where a copy of a block lives, fastest first."""

    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"
    REMOTE = "REMOTE"

    def __str__(self) -> str:  # "GPU", not "Medium.GPU", in tables and JSON
        return self.value


# Canonical dtype names: used in keys, DISK record headers and config.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.uint8: "uint8",
    torch.int8: "int8",
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPE_NAMES[torch.float8_e4m3fn] = "float8_e4m3fn"
    DTYPE_NAMES[torch.float8_e5m2] = "float8_e5m2"
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}

KV_LAYOUT = "LKVTHD"
"""Name of the block layout above (layer, K/V, token, head, head_dim); part of the namespace."""


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of ``dtype``; raises ``ValueError`` for a dtype kvtier does not store."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"expected one of {sorted(DTYPE_NAMES.values())}, got dtype {dtype}") from None


@dataclass(frozen=True)
class KVSpec:
    """Shape of one block of K/V, the unit every tier stores.

    Attributes:
        num_layers: attention layers of the model.
        num_kv_heads: K/V heads per layer (after GQA), per tensor-parallel rank.
        head_dim: elements per head.
        block_size: tokens per block.
        dtype: element type of the K/V tensors (the model's cache dtype).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        dtype_name(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        return math.prod(self.block_shape)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block."""
        return self.block_numel * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.block_nbytes // self.block_size
