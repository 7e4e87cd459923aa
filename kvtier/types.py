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

- **layer group**: layers that share an attention kind (full, sliding window, chunked,
  MLA) and per-token K/V shapes (:class:`LayerGroup`).

Block layout (``KVSpec.block_shape``), one block, when every layer has the same heads and
K and V have the same head dim (*uniform*: Llama, Qwen, Mistral, Gemma, gpt-oss)::

    [num_layers, 2, block_size, num_kv_heads, head_dim]   # 2 = (K, V)

so a GPU/CPU pool tensor is ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (the per-token ``[block_size, num_kv_heads, head_dim]`` inner layout is the one
vLLM's paged caches use, so a block moves to and from them with one gather per layer).
Otherwise (MLA as transformers caches it: a K "latent" of ``kv_lora_rank`` and a V of the
RoPE dim; groups with other head counts) a block is one flat run of ``block_numel``
elements, layer after layer, each layer ``K [block_size, num_kv_heads, k_head_dim]`` then
``V [block_size, num_kv_heads, v_head_dim]``; :meth:`KVSpec.layer_views` gives per-layer K
and V views of a pool in either layout. Tiers only move a block's bytes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal, NewType, Sequence

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

    __repr__ = __str__  # print(plan.sources) -> [CPU, CPU, DISK], not [<Medium.CPU: 'CPU'>, ...]


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
KV_LAYOUT_HEAD_MAJOR = "LKVHTD"
"""Name of the head-major uniform layout (``KVSpec(..., head_major=True)``): a block is
``[num_layers, 2, num_kv_heads, block_size, head_dim]``, so each head of a layer is one run
of ``block_size * head_dim`` elements, the order of transformers' caches (``[batch,
num_kv_heads, seq_len, head_dim]``): the HF connector's layout (a hit is gathered into its
cache in runs of whole blocks per head, at memcpy speed, instead of runs of one head_dim).
Part of the namespace like :data:`KV_LAYOUT`: a block of one layout never serves the other."""


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of ``dtype``; raises ``ValueError`` for a dtype kvtier does not store."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"expected one of {sorted(DTYPE_NAMES.values())}, got dtype {dtype}") from None


AttentionKind = Literal["full", "sliding", "chunked", "mla"]
ATTENTION_KINDS: tuple[str, ...] = ("full", "sliding", "chunked", "mla")
_WINDOWED_KINDS = ("sliding", "chunked")


def positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not a ``bool``) above 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"expected {name} to be a positive int, got {value!r}")


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one attention kind whose tokens have the same K and V shapes.

    Every kind stores every position's K/V (a sliding layer's block is valid for any later
    cut; the model's mask does the windowing: docs/architecture.md, "Layer groups").

    Attributes:
        kind: ``"full"``; ``"sliding"`` (a token attends to the last ``window`` positions:
            Mistral, the local layers of Gemma 2/3 and gpt-oss, Qwen2 ``layer_types``);
            ``"chunked"`` (a token attends within its ``window``-token chunk: Llama 4);
            ``"mla"`` (multi-head latent attention, DeepSeek-V2/V3: transformers caches the
            compressed latent, ``kv_lora_rank``, as K and the RoPE key, ``qk_rope_head_dim``,
            as V, one head each).
        layers: model layer indices, ascending.
        num_kv_heads: K/V heads per layer (per tensor-parallel rank).
        k_head_dim: elements per head of K.
        v_head_dim: elements per head of V.
        window: tokens of the window (sliding) or chunk (chunked); ``None`` for other kinds.
    """

    kind: AttentionKind
    layers: tuple[int, ...]
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"expected kind in {ATTENTION_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.layers):
            raise ValueError(f"expected non-empty non-negative int layer indices, got {self.layers!r}")
        if list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"expected ascending distinct layer indices, got {self.layers!r}")
        for name in ("num_kv_heads", "k_head_dim", "v_head_dim"):
            positive_int(name, getattr(self, name))
        if self.kind in _WINDOWED_KINDS:
            positive_int(f"window of a {self.kind} group", self.window)
        elif self.window is not None:
            raise ValueError(f"expected no window for a {self.kind} group, got {self.window!r}")

    @property
    def token_numel(self) -> int:
        """Elements of K and V of one token in one layer."""
        return self.num_kv_heads * (self.k_head_dim + self.v_head_dim)

    def describe(self) -> str:
        """Canonical text, e.g. ``sliding(4096):0-3,6:h8k128v128`` (part of layout names)."""
        kind = f"{self.kind}({self.window})" if self.window is not None else self.kind
        return f"{kind}:{_ranges(self.layers)}:h{self.num_kv_heads}k{self.k_head_dim}v{self.v_head_dim}"

    def _same_shape(self, other: "LayerGroup") -> bool:
        return (self.kind, self.window, self.num_kv_heads, self.k_head_dim, self.v_head_dim) == (
            other.kind, other.window, other.num_kv_heads, other.k_head_dim, other.v_head_dim
        )


def _ranges(layers: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][1] + 1 == i:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


@dataclass(frozen=True)
class KVSpec:
    """Shape of one block of K/V, the unit every tier stores.

    ``KVSpec(num_layers, num_kv_heads, head_dim, block_size, dtype)`` is full attention in
    every layer. ``groups`` describes models with other attention kinds or unequal K/V
    shapes (use :meth:`from_groups`); it is normalised (groups of the same kind and shapes
    merged, ordered by first layer, a single full group dropped), so two specs of the same
    layout compare equal.

    Attributes:
        num_layers: attention layers of the model.
        num_kv_heads: K/V heads per layer (after GQA), per tensor-parallel rank; 0 when the
            layers differ (see ``groups``).
        head_dim: elements per head of K and of V; 0 when the layers differ.
        block_size: tokens per block.
        dtype: element type of the K/V tensors (the model's cache dtype).
        groups: the layer groups, partitioning ``range(num_layers)``; ``()`` = all full.
        head_major: a uniform spec's block is ``[num_layers, 2, num_kv_heads, block_size,
            head_dim]`` (:data:`KV_LAYOUT_HEAD_MAJOR`) instead of ``[.., block_size,
            num_kv_heads, head_dim]``; another layout name, so another namespace.

    Raises:
        ValueError: a non-positive size, groups that do not partition the layers,
            ``num_kv_heads``/``head_dim`` that disagree with them, or ``head_major`` for a
            spec that is not uniform.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    groups: tuple[LayerGroup, ...] = ()
    head_major: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size"):
            positive_int(name, getattr(self, name))
        dtype_name(self.dtype)
        if self.groups:
            object.__setattr__(self, "groups", _normalise_groups(self.groups, self.num_layers))
        groups = self.groups
        if not isinstance(self.head_major, bool):
            raise ValueError(f"expected head_major to be a bool, got {self.head_major!r}")
        if not groups:
            positive_int("num_kv_heads", self.num_kv_heads)
            positive_int("head_dim", self.head_dim)
            return
        uniform = _uniform_shape(groups)
        expected = uniform if uniform is not None else (0, 0)
        if (self.num_kv_heads, self.head_dim) != expected:
            raise ValueError(
                f"expected num_kv_heads, head_dim = {expected} for groups {self.layout_name}, "
                f"got {(self.num_kv_heads, self.head_dim)}"
            )
        if self.head_major and uniform is None:
            raise ValueError(f"expected a uniform spec for head_major, got groups {self.layout_name}")

    @classmethod
    def from_groups(
        cls, groups: Sequence[LayerGroup], block_size: int, dtype: torch.dtype, head_major: bool = False
    ) -> "KVSpec":
        """The spec of a model whose layers are ``groups`` (together ``0 .. num_layers - 1``);
        ``head_major``: the head-major layout if the groups are uniform (else ignored)."""
        if not groups or not all(isinstance(g, LayerGroup) for g in groups):
            raise ValueError(f"expected a non-empty sequence of LayerGroup, got {groups!r}")
        num_layers = sum(len(g.layers) for g in groups)
        num_kv_heads, head_dim = _uniform_shape(groups) or (0, 0)
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype, tuple(groups), head_major and num_kv_heads > 0)

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """``groups``, or the one full-attention group of a spec without groups."""
        if self.groups:
            return self.groups
        return (LayerGroup("full", tuple(range(self.num_layers)), self.num_kv_heads, self.head_dim, self.head_dim),)

    @property
    def is_uniform(self) -> bool:
        """Every layer has ``num_kv_heads`` heads and K and V of ``head_dim``: the
        ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` block layout."""
        return self.num_kv_heads > 0

    @property
    def layout_name(self) -> str:
        """Canonical name of the block layout, part of the namespace: ``LKVTHD`` (full
        attention, uniform: unchanged from earlier releases), ``LKVTHD[<groups>]`` (uniform,
        other kinds), ``LKTHD+VTHD[<groups>]`` (flat); ``LKVHTD`` / ``LKVHTD[<groups>]`` for
        the head-major uniform layout."""
        uniform = KV_LAYOUT_HEAD_MAJOR if self.head_major else KV_LAYOUT
        if not self.groups:
            return uniform
        described = ";".join(g.describe() for g in self.groups)
        return f"{uniform}[{described}]" if self.is_uniform else f"LKTHD+VTHD[{described}]"

    @property
    def block_shape(self) -> tuple[int, ...]:
        """``(num_layers, 2, block_size, num_kv_heads, head_dim)`` if uniform (``(num_layers,
        2, num_kv_heads, block_size, head_dim)`` if also ``head_major``), else ``(block_numel,)``."""
        if self.head_major:
            return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)
        if self.is_uniform:
            return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return (self.block_numel,)

    @property
    def block_numel(self) -> int:
        return self.block_size * sum(len(g.layers) * g.token_numel for g in self.layer_groups)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block."""
        return self.block_numel * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.block_nbytes // self.block_size

    def layer_shapes(self) -> list[tuple[int, int, int]]:
        """``(num_kv_heads, k_head_dim, v_head_dim)`` of each layer, in layer order."""
        shapes: list[tuple[int, int, int]] = [(0, 0, 0)] * self.num_layers
        for g in self.layer_groups:
            for layer in g.layers:
                shapes[layer] = (g.num_kv_heads, g.k_head_dim, g.v_head_dim)
        return shapes

    def layer_ranges(self) -> list[tuple[int, int]]:
        """``(start, stop)`` element offsets of each layer's K and V within a block (layers
        are contiguous in both layouts: a layer of a block is one slab)."""
        ranges, offset = [], 0
        for heads, k_dim, v_dim in self.layer_shapes():
            size = self.block_size * heads * (k_dim + v_dim)
            ranges.append((offset, offset + size))
            offset += size
        return ranges

    def layer_views(self, pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K and V views of blocks in this layout (no copy).

        Args:
            pool: ``[num_blocks, *block_shape]`` of ``dtype``, contiguous blocks.

        Returns:
            for each layer ``(K, V)``: ``[num_blocks, block_size, num_kv_heads, k_head_dim]``
            and ``[num_blocks, block_size, num_kv_heads, v_head_dim]``, views of ``pool``
            (strided: heads outer in memory, for a head-major spec).
        """
        assert tuple(pool.shape[1:]) == self.block_shape, f"expected [n, *{self.block_shape}], got {tuple(pool.shape)}"
        n, size = pool.shape[0], self.block_size
        if self.head_major:
            return [(pool[:, layer, 0].transpose(1, 2), pool[:, layer, 1].transpose(1, 2)) for layer in range(self.num_layers)]
        if self.is_uniform:
            return [(pool[:, layer, 0], pool[:, layer, 1]) for layer in range(self.num_layers)]
        views, offset = [], 0
        for heads, k_dim, v_dim in self.layer_shapes():
            k_numel, v_numel = size * heads * k_dim, size * heads * v_dim
            k = pool[:, offset : offset + k_numel].view(n, size, heads, k_dim)
            v = pool[:, offset + k_numel : offset + k_numel + v_numel].view(n, size, heads, v_dim)
            views.append((k, v))
            offset += k_numel + v_numel
        return views


def _normalise_groups(groups: Sequence[LayerGroup], num_layers: int) -> tuple[LayerGroup, ...]:
    """Merge groups of one kind and shape, order them by first layer, drop a lone full
    uniform group; check they partition ``range(num_layers)``."""
    if not all(isinstance(g, LayerGroup) for g in groups):
        raise ValueError(f"expected LayerGroup instances, got {[type(g).__name__ for g in groups]}")
    layers = sorted(i for g in groups for i in g.layers)
    if layers != list(range(num_layers)):
        raise ValueError(f"expected groups covering layers 0..{num_layers - 1} once each, got {layers}")
    merged: list[LayerGroup] = []
    for g in groups:
        same = next((m for m in merged if m._same_shape(g)), None)
        if same is None:
            merged.append(g)
        else:
            merged[merged.index(same)] = LayerGroup(
                g.kind, tuple(sorted(same.layers + g.layers)), g.num_kv_heads, g.k_head_dim, g.v_head_dim, g.window
            )
    merged.sort(key=lambda g: g.layers[0])
    if len(merged) == 1 and merged[0].kind == "full" and merged[0].k_head_dim == merged[0].v_head_dim:
        return ()
    return tuple(merged)


def _uniform_shape(groups: Sequence[LayerGroup]) -> tuple[int, int] | None:
    """``(num_kv_heads, head_dim)`` shared by every group with K and V of one head dim, else ``None``."""
    shapes = {(g.num_kv_heads, g.k_head_dim, g.v_head_dim) for g in groups}
    if len(shapes) != 1:
        return None
    heads, k_dim, v_dim = shapes.pop()
    return (heads, k_dim) if k_dim == v_dim else None

