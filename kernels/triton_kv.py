"""Triton kernels for the block copies of :mod:`.reference` (same functions, same signatures).

One kernel, ``_copy_block_slabs_kernel``, does every copy. It moves *slabs*: the
``[block_size, num_kv_heads, head_dim]`` K or V tokens of one block in one layer. The pool side
of a slab is ``pool[block_id, layer, kv]``; the other side is block ``other_id`` of a block
view ``[num_blocks, block_size, num_kv_heads, head_dim]`` (an HF cache cut into blocks, a
paged cache's K or V, a staging buffer's layer), given by its data address and its four
strides (block, token, head, head_dim). So a new engine layout is a new view, not a new kernel.

Per-layer tensors: one launch covers every layer through a *slab table*, an int64
``[num_slabs, 2]`` device tensor of ``(layer * 2 + kv, data address of that slab's block
view)``; the kernel loads the address and casts it to a pointer of the pool's element type.
This was chosen over one launch per layer because a model has 20-100 layers and a transfer of a
few blocks is launch-bound; the Triton interpreter (``TRITON_INTERPRET=1``) handles pointer
tables for CPU tensors, so the tests run this same path. Views whose strides differ (a K cache
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

__all__ = ["INTERPRETED", "gather", "pack_blocks", "scatter", "unpack_blocks"]

_TILE_ELEMENTS = 4096  # BLOCK_R * BLOCK_D per program: 8 KiB of fp16, enough in flight per SM
_TABLE_CACHE_SIZE = 256


@triton.jit
def _copy_block_slabs_kernel(
    pool_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    block_ids_ptr,  # [n] int64, pool block of copy i
    other_ids_ptr,  # [n] int64, view block of copy i (read only if HAS_OTHER_IDS)
    slab_table_ptr,  # [num_slabs, 2] int64: (layer * 2 + kv, address of the block view)
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
    HAS_OTHER_IDS: tl.constexpr,  # False: view block of copy i is i
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
        + (tokens * stride_other_token + heads * stride_other_head)[:, None]
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
    key_blocks: Sequence[torch.Tensor],
    value_blocks: Sequence[torch.Tensor],
    other_ids: torch.Tensor | None,
    to_pool: bool,
) -> None:
    """Copy every layer's K and V for every block: one launch per group of equal strides."""
    n = block_ids.numel()
    if n == 0:
        return
    _, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    assert block_ids.dtype == torch.int64 and block_ids.device == pool.device, "block_ids: int64 on pool device"
    block_d = triton.next_power_of_2(head_dim)
    block_r = min(triton.next_power_of_2(block_size * num_kv_heads), max(1, _TILE_ELEMENTS // block_d))
    row_tiles = triton.cdiv(block_size * num_kv_heads, block_r)
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for layer in range(num_layers):
        for kv, view in enumerate((key_blocks[layer], value_blocks[layer])):
            groups.setdefault(view.stride(), []).append((layer * 2 + kv, view.data_ptr()))
    with torch.cuda.device(pool.device) if pool.is_cuda else contextlib.nullcontext():
        for strides, entries in groups.items():
            table = _slab_table(pool.device, tuple(entries))
            aligned = all(addr % 16 == 0 for _, addr in entries)
            _copy_block_slabs_kernel[(n, len(entries), row_tiles)](
                pool,
                block_ids,
                block_ids if other_ids is None else other_ids,
                table,
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


def gather(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    key_blocks: Sequence[torch.Tensor],
    value_blocks: Sequence[torch.Tensor],
    other_ids: torch.Tensor | None,
) -> None:
    """Triton :func:`.reference.gather` (same shapes and dtypes)."""
    _launch(pool, block_ids, key_blocks, value_blocks, other_ids, to_pool=False)


def scatter(
    key_blocks: Sequence[torch.Tensor],
    value_blocks: Sequence[torch.Tensor],
    other_ids: torch.Tensor | None,
    pool: torch.Tensor,
    block_ids: torch.Tensor,
) -> None:
    """Triton :func:`.reference.scatter` (same shapes and dtypes)."""
    _launch(pool, block_ids, key_blocks, value_blocks, other_ids, to_pool=True)


def pack_blocks(pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Triton :func:`.reference.pack_blocks` (same shapes and dtypes)."""
    gather(pool, block_ids, *_staging_views(staging), None)


def unpack_blocks(staging: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Triton :func:`.reference.unpack_blocks` (same shapes and dtypes)."""
    scatter(*_staging_views(staging), None, pool, block_ids)


def _staging_views(staging: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V block views ``[n, block_size, num_kv_heads, head_dim]`` of a staging
    buffer ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``."""
    layers = range(staging.shape[1])
    return [staging[:, layer, 0] for layer in layers], [staging[:, layer, 1] for layer in layers]
