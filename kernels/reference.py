"""Plain-torch block copies: the CPU path in production and the oracle for the Triton kernels.

Two copies serve every engine layout, for every layer at once:

- :func:`gather`: pool blocks -> the engine's per-layer K and V *block views*;
- :func:`scatter`: the engine's block views -> pool blocks.

A block view is a ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor, any strides,
usually a view into the engine's cache that :mod:`kvtier.kernels` builds: HF caches
``[1, num_kv_heads, seq_len, head_dim]`` cut at ``start_token`` and split into blocks (block
``i`` of the request is view block ``i``), or a paged cache's K or V (vLLM, transformers'
paged cache), whose blocks are named by ``other_ids``. :func:`pack_blocks` /
:func:`unpack_blocks` copy whole blocks to and from one staging buffer
``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` (one large DMA).

The pool is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (``2`` = K, V;
see :mod:`kvtier.types`). All tensors share the pool's dtype and device. These functions do not
validate their inputs (``kvtier.kernels`` does, at the public boundary); a bad id raises
whatever torch's indexing raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["gather", "pack_blocks", "scatter", "unpack_blocks"]


def gather(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    key_blocks: Sequence[torch.Tensor],
    value_blocks: Sequence[torch.Tensor],
    other_ids: torch.Tensor | None,
) -> None:
    """Copy ``pool[block_ids[i], l]`` into view block ``other_ids[i]`` (``i`` when ``None``) of
    ``key_blocks[l]`` / ``value_blocks[l]`` for every layer ``l``.

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64, pool blocks to read (repeats allowed).
        key_blocks: ``num_layers`` block views ``[m, block_size, num_kv_heads, head_dim]``, any
            strides (``m == n`` when ``other_ids`` is ``None``); written.
        value_blocks: like ``key_blocks``, for V.
        other_ids: ``[n]`` int64, distinct view blocks to write, or ``None``.
    """
    blocks = pool.index_select(0, block_ids)  # [n, num_layers, 2, block_size, heads, head_dim]
    for layer in range(pool.shape[1]):
        for kv, views in enumerate((key_blocks, value_blocks)):
            if other_ids is None:
                views[layer].copy_(blocks[:, layer, kv])
            else:
                views[layer].index_copy_(0, other_ids, blocks[:, layer, kv])


def scatter(
    key_blocks: Sequence[torch.Tensor],
    value_blocks: Sequence[torch.Tensor],
    other_ids: torch.Tensor | None,
    pool: torch.Tensor,
    block_ids: torch.Tensor,
) -> None:
    """Copy view block ``other_ids[i]`` (``i`` when ``None``) of ``key_blocks[l]`` /
    ``value_blocks[l]`` into ``pool[block_ids[i], l]`` for every layer ``l`` (inverse of
    :func:`gather`); other pool blocks are untouched.

    Args:
        key_blocks: ``num_layers`` block views ``[m, block_size, num_kv_heads, head_dim]``, any
            strides (``m == n`` when ``other_ids`` is ``None``).
        value_blocks: like ``key_blocks``, for V.
        other_ids: ``[n]`` int64, view blocks to read (repeats allowed), or ``None``.
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; written.
        block_ids: ``[n]`` int64, distinct pool blocks to write.
    """
    for layer in range(pool.shape[1]):
        for kv, views in enumerate((key_blocks, value_blocks)):
            source = views[layer] if other_ids is None else views[layer].index_select(0, other_ids)
            pool[block_ids, layer, kv] = source


def pack_blocks(pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy ``pool[block_ids[i]]`` into ``staging[i]``.

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64, pool blocks to read (repeats allowed).
        staging: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``, pool dtype, usually
            contiguous (one buffer, one DMA); written.
    """
    if staging.is_contiguous():
        torch.index_select(pool, 0, block_ids, out=staging)
    else:
        staging.copy_(pool.index_select(0, block_ids))


def unpack_blocks(staging: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Copy ``staging[i]`` into ``pool[block_ids[i]]``.

    Args:
        staging: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``, pool dtype.
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; written.
        block_ids: ``[n]`` int64, distinct pool blocks to write.
    """
    pool.index_copy_(0, block_ids, staging)
