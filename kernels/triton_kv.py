"""Triton kernels for the block copies of :mod:`.reference` (same functions, same signatures).

One kernel, ``_copy_block_slabs_kernel``, does every copy. It moves *slabs*: the
``[block_size, num_kv_heads, head_dim]`` K or V tokens of one block in one layer. The pool side
of a slab is ``pool[block_id, layer, kv]``; the other side (HF cache, paged cache or staging
buffer) is described by a base address and four strides (block, token, head, head_dim).

Per-layer tensors: one launch covers every layer through a *slab table*, an int64
``[num_slabs, 2]`` device tensor of ``(layer * 2 + kv, data address of that slab's other-side
tensor)``; the kernel loads the address and casts it to a pointer of the pool's element type.
This was chosen over one launch per layer because a model has 20-100 layers and a transfer of a
few blocks is launch-bound; the Triton interpreter (``TRITON_INTERPRET=1``) handles pointer
tables for CPU tensors, so the tests run this same path. Slabs whose strides differ (a K cache
that is a transposed view next to a contiguous V cache, layers of different shapes) are grouped
by strides and each group gets one launch; in the usual case that is one launch in total.
Under the interpreter only CPU tensors work (the table holds host addresses).

Grid: ``(n, num_slabs, cdiv(block_size * num_kv_heads, BLOCK_R))``; a program copies one tile of
``BLOCK_R`` (token, head) rows by ``BLOCK_D`` (``head_dim`` rounded up to a power of two, masked).
The block count is on axis 0, whose limit is 2**31 - 1 (axes 1 and 2 stop at 65535).

These wrappers assert internal invariants only; ``kvtier.kernels`` validates public inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .reference import _new_layer_caches

__all__ = [
    "INTERPRETED",
    "gather_blocks_to_contiguous",
    "gather_blocks_to_layers",
    "gather_blocks_to_paged",
    "pack_blocks",
    "scatter_contiguous_to_blocks",
    "scatter_paged_to_blocks",
    "unpack_blocks",
]

_TILE_ELEMENTS = 4096  # BLOCK_R * BLOCK_D per program: 8 KiB of fp16, enough in flight per SM
_TABLE_CACHE_SIZE = 256


@triton.jit
def _copy_block_slabs_kernel(
    pool_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    block_ids_ptr,  # [n] int64, pool block of copy i
    other_ids_ptr,  # [n] int64, other-side block of copy i (read only if HAS_OTHER_IDS)
    slab_table_ptr,  # [num_slabs, 2] int64: (layer * 2 + kv, address of the other-side slab base)
    other_token_offset,  # tokens skipped at the start of every other-side slab
    block_size,
    num_kv_heads,
    head_dim,
    # strides
    stride_pool_block,
    stride_pool_layer,
    stride_pool_kv,
    stride_pool_token,
    stride_pool_head,
    stride_pool_d,
    stride_other_block,
    stride_other_token,
    stride_other_head,
    stride_other_d,
    HAS_OTHER_IDS: tl.constexpr,  # False: other-side block of copy i is i
    TO_POOL: tl.constexpr,  # True: other side -> pool; False: pool -> other side
    ALIGNED_16: tl.constexpr,  # every slab address is a multiple of 16 bytes
    BLOCK_R: tl.constexpr,  # (token, head) rows per program
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    copy_idx = tl.program_id(0).to(tl.int64)
    slab = tl.program_id(1).to(tl.int64)
    row_tile = tl.program_id(2)

    block_id = tl.load(block_ids_ptr + copy_idx)
    if HAS_OTHER_IDS:
        other_id = tl.load(other_ids_ptr + copy_idx)
    else:
        other_id = copy_idx
    layer_kv = tl.load(slab_table_ptr + slab * 2)
    other_addr = tl.load(slab_table_ptr + slab * 2 + 1)
    other_ptr = other_addr.to(tl.pointer_type(pool_ptr.dtype.element_ty))
    if ALIGNED_16:  # the hint must sit on the pointer: it does not pass through int_to_ptr
        other_ptr = tl.multiple_of(other_ptr, 16)

    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)  # row = token * num_kv_heads + head
    tokens = (rows // num_kv_heads).to(tl.int64)
    heads = (rows % num_kv_heads).to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (rows < block_size * num_kv_heads)[:, None] & (dims < head_dim)[None, :]

    pool_offs = (
        block_id * stride_pool_block
        + (layer_kv // 2) * stride_pool_layer
        + (layer_kv % 2) * stride_pool_kv
        + (tokens * stride_pool_token + heads * stride_pool_head)[:, None]
        + dims[None, :] * stride_pool_d
    )
    other_offs = (
        other_id * stride_other_block
        + ((other_token_offset + tokens) * stride_other_token + heads * stride_other_head)[:, None]
        + dims[None, :] * stride_other_d
    )
    if TO_POOL:
        values = tl.load(other_ptr + other_offs, mask=mask)
        tl.store(pool_ptr + pool_offs, values, mask=mask)
    else:
        values = tl.load(pool_ptr + pool_offs, mask=mask)
        tl.store(other_ptr + other_offs, values, mask=mask)


try:  # the interpreter wraps kernels in InterpretedFunction instead of JITFunction
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction

    INTERPRETED = isinstance(_copy_block_slabs_kernel, _InterpretedFunction)
except ImportError:  # pragma: no cover - older triton layouts
    INTERPRETED = False
"""True when the kernels run in the Triton interpreter (CPU tensors only), False when compiled."""

# A slab of the other side: (layer * 2 + kv, data address, (block, token, head, d) strides).
_Slab = tuple[int, int, tuple[int, int, int, int]]
_table_cache: dict[tuple[object, ...], torch.Tensor] = {}


def _slab_table(device: torch.device, entries: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``[len(entries), 2]`` int64 table on ``device``, cached: caches are long-lived tensors.

    The key holds the current CUDA stream, so a table is only read on the stream it was
    allocated on and the caching allocator cannot reuse its memory under a running kernel.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream, entries)
    table = _table_cache.get(key)
    if table is None:
        if len(_table_cache) >= _TABLE_CACHE_SIZE:
            _table_cache.pop(next(iter(_table_cache)))
        table = torch.tensor(entries, dtype=torch.int64).to(device)
        _table_cache[key] = table
    return table


def _launch(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    other_ids: torch.Tensor | None,
    slabs: list[_Slab],
    other_token_offset: int,
    to_pool: bool,
) -> None:
    """Copy every slab of ``slabs`` for every block: one launch per group of equal strides."""
    n = block_ids.numel()
    if n == 0:
        return
    _, _, _, block_size, num_kv_heads, head_dim = pool.shape
    assert block_ids.dtype == torch.int64 and block_ids.device == pool.device, "block_ids: int64 on pool device"
    block_d = triton.next_power_of_2(head_dim)
    block_r = min(triton.next_power_of_2(block_size * num_kv_heads), max(1, _TILE_ELEMENTS // block_d))
    row_tiles = triton.cdiv(block_size * num_kv_heads, block_r)
    groups: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
    for layer_kv, addr, strides in slabs:
        groups.setdefault(strides, []).append((layer_kv, addr))
    with torch.cuda.device(pool.device) if pool.is_cuda else contextlib.nullcontext():
        for strides, entries in groups.items():
            table = _slab_table(pool.device, tuple(entries))
            aligned = all(addr % 16 == 0 for _, addr in entries)
            _copy_block_slabs_kernel[(n, len(entries), row_tiles)](
                pool,
                block_ids,
                block_ids if other_ids is None else other_ids,
                table,
                other_token_offset,
                block_size,
                num_kv_heads,
                head_dim,
                *pool.stride(),
                *strides,
                HAS_OTHER_IDS=other_ids is not None,
                TO_POOL=to_pool,
                ALIGNED_16=aligned,
                BLOCK_R=block_r,
                BLOCK_D=block_d,
            )


def _contiguous_slabs(
    pool: torch.Tensor, key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]
) -> list[_Slab]:
    """Slabs of HF caches ``[1, num_kv_heads, seq_len, head_dim]``: block i starts at token i * block_size."""
    block_size = pool.shape[3]
    slabs = []
    for layer in range(pool.shape[1]):
        for kv, cache in enumerate((key_caches[layer], value_caches[layer])):
            _, stride_head, stride_token, stride_d = cache.stride()
            strides = (block_size * stride_token, stride_token, stride_head, stride_d)
            slabs.append((layer * 2 + kv, cache.data_ptr(), strides))
    return slabs


def _paged_slabs(pool: torch.Tensor, paged_caches: Sequence[torch.Tensor]) -> list[_Slab]:
    """Slabs of paged caches ``[2, num_paged_blocks, block_size, num_kv_heads, head_dim]``."""
    slabs = []
    for layer in range(pool.shape[1]):
        cache = paged_caches[layer]
        stride_kv, *strides = cache.stride()
        for kv in range(2):
            slabs.append((layer * 2 + kv, cache.data_ptr() + kv * stride_kv * cache.element_size(), tuple(strides)))
    return slabs


def _staging_slabs(pool: torch.Tensor, staging: torch.Tensor) -> list[_Slab]:
    """Slabs of a staging buffer ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``."""
    stride_block, stride_layer, stride_kv, *inner = staging.stride()
    strides = (stride_block, *inner)
    slabs = []
    for layer in range(pool.shape[1]):
        for kv in range(2):
            offset = (layer * stride_layer + kv * stride_kv) * staging.element_size()
            slabs.append((layer * 2 + kv, staging.data_ptr() + offset, strides))
    return slabs


def gather_blocks_to_contiguous(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    start_token: int = 0,
) -> None:
    """Triton :func:`.reference.gather_blocks_to_contiguous` (same shapes and dtypes)."""
    _launch(pool, block_ids, None, _contiguous_slabs(pool, key_caches, value_caches), start_token, to_pool=False)


def gather_blocks_to_layers(
    pool: torch.Tensor, block_ids: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Triton :func:`.reference.gather_blocks_to_layers` (same shapes and dtypes)."""
    keys, values = _new_layer_caches(pool, block_ids.numel())
    gather_blocks_to_contiguous(pool, block_ids, keys, values)
    return keys, values


def scatter_contiguous_to_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    start_token: int = 0,
) -> None:
    """Triton :func:`.reference.scatter_contiguous_to_blocks` (same shapes and dtypes)."""
    _launch(pool, block_ids, None, _contiguous_slabs(pool, key_caches, value_caches), start_token, to_pool=True)


def gather_blocks_to_paged(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    paged_caches: Sequence[torch.Tensor],
    paged_block_ids: torch.Tensor,
) -> None:
    """Triton :func:`.reference.gather_blocks_to_paged` (same shapes and dtypes)."""
    _launch(pool, block_ids, paged_block_ids, _paged_slabs(pool, paged_caches), 0, to_pool=False)


def scatter_paged_to_blocks(
    paged_caches: Sequence[torch.Tensor],
    paged_block_ids: torch.Tensor,
    pool: torch.Tensor,
    block_ids: torch.Tensor,
) -> None:
    """Triton :func:`.reference.scatter_paged_to_blocks` (same shapes and dtypes)."""
    _launch(pool, block_ids, paged_block_ids, _paged_slabs(pool, paged_caches), 0, to_pool=True)


def pack_blocks(pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Triton :func:`.reference.pack_blocks` (same shapes and dtypes)."""
    _launch(pool, block_ids, None, _staging_slabs(pool, staging), 0, to_pool=False)


def unpack_blocks(staging: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Triton :func:`.reference.unpack_blocks` (same shapes and dtypes)."""
    _launch(pool, block_ids, None, _staging_slabs(pool, staging), 0, to_pool=True)
