"""Plain-torch block copies: the CPU path in production and the oracle for the Triton kernels.

Every function copies whole blocks between a kvtier block pool and one of three outside
layouts, for every layer at once:

- *contiguous*: HF-transformers caches, one ``[1, num_kv_heads, seq_len, head_dim]`` tensor per
  layer for K and one for V; a request's blocks sit at consecutive token positions.
- *paged*: vLLM-style paged caches, one ``[2, num_paged_blocks, block_size, num_kv_heads,
  head_dim]`` tensor per layer; blocks sit in slots named by ``paged_block_ids``.
- *staging*: one ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` buffer, the blocks
  in order, so a tier transfer is one large DMA.

The pool is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (``2`` = K, V;
see :mod:`kvtier.types`). All tensors share the pool's dtype and device; any of them may be a
non-contiguous view. These functions do not validate their inputs (``kvtier.kernels`` does, at
the public boundary); a bad id raises whatever torch's indexing raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "gather_blocks_to_contiguous",
    "gather_blocks_to_layers",
    "gather_blocks_to_paged",
    "pack_blocks",
    "scatter_contiguous_to_blocks",
    "scatter_paged_to_blocks",
    "unpack_blocks",
]


def gather_blocks_to_contiguous(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    start_token: int = 0,
) -> None:
    """Copy blocks, in order, into per-layer HF caches at consecutive token positions.

    Block ``block_ids[i]`` lands at tokens ``start_token + i * block_size`` .. ``+ block_size``
    of ``key_caches[l]`` / ``value_caches[l]`` for every layer ``l``; other tokens are untouched.

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64, pool blocks to read (repeats allowed).
        key_caches: ``num_layers`` tensors ``[1, num_kv_heads, seq_len, head_dim]``, pool dtype,
            with ``seq_len >= start_token + n * block_size``; written in place.
        value_caches: like ``key_caches``, for V.
        start_token: first token position written.
    """
    _, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    num_tokens = block_ids.numel() * block_size
    blocks = pool.index_select(0, block_ids)  # [n, num_layers, 2, block_size, heads, head_dim]
    for layer in range(num_layers):
        for kv, caches in enumerate((key_caches, value_caches)):
            tokens = blocks[:, layer, kv].reshape(num_tokens, num_kv_heads, head_dim)
            caches[layer][0, :, start_token : start_token + num_tokens].copy_(tokens.transpose(0, 1))


def gather_blocks_to_layers(
    pool: torch.Tensor, block_ids: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy blocks, in order, into newly allocated per-layer HF caches.

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64, pool blocks to read (repeats allowed).

    Returns:
        ``(keys, values)``: ``num_layers`` contiguous tensors each
        ``[1, num_kv_heads, n * block_size, head_dim]``, pool dtype and device.
    """
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
    """Copy consecutive tokens of per-layer HF caches into pool blocks (inverse of the gather).

    Tokens ``start_token + i * block_size`` .. ``+ block_size`` of every layer land in
    ``pool[block_ids[i]]``; other pool blocks are untouched.

    Args:
        key_caches: ``num_layers`` tensors ``[1, num_kv_heads, seq_len, head_dim]``, pool dtype,
            with ``seq_len >= start_token + n * block_size``; may be non-contiguous views.
        value_caches: like ``key_caches``, for V.
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; written.
        block_ids: ``[n]`` int64, distinct pool blocks to write.
        start_token: first token position read.
    """
    _, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    n = block_ids.numel()
    for layer in range(num_layers):
        for kv, caches in enumerate((key_caches, value_caches)):
            tokens = caches[layer][0, :, start_token : start_token + n * block_size]  # [H, T, D]
            pool[block_ids, layer, kv] = tokens.transpose(0, 1).reshape(n, block_size, num_kv_heads, head_dim)


def gather_blocks_to_paged(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    paged_caches: Sequence[torch.Tensor],
    paged_block_ids: torch.Tensor,
) -> None:
    """Copy ``pool[block_ids[i], l]`` into ``paged_caches[l][:, paged_block_ids[i]]`` for every layer.

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64, pool blocks to read (repeats allowed).
        paged_caches: ``num_layers`` tensors ``[2, num_paged_blocks, block_size, num_kv_heads,
            head_dim]``, pool dtype; written in place.
        paged_block_ids: ``[n]`` int64, distinct paged-cache slots to write.
    """
    num_layers = pool.shape[1]
    for layer in range(num_layers):
        paged_caches[layer][:, paged_block_ids] = pool[block_ids, layer].transpose(0, 1)


def scatter_paged_to_blocks(
    paged_caches: Sequence[torch.Tensor],
    paged_block_ids: torch.Tensor,
    pool: torch.Tensor,
    block_ids: torch.Tensor,
) -> None:
    """Copy ``paged_caches[l][:, paged_block_ids[i]]`` into ``pool[block_ids[i], l]`` for every layer.

    Args:
        paged_caches: ``num_layers`` tensors ``[2, num_paged_blocks, block_size, num_kv_heads,
            head_dim]``, pool dtype.
        paged_block_ids: ``[n]`` int64, paged-cache slots to read (repeats allowed).
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; written.
        block_ids: ``[n]`` int64, distinct pool blocks to write.
    """
    num_layers = pool.shape[1]
    for layer in range(num_layers):
        pool[block_ids, layer] = paged_caches[layer][:, paged_block_ids].transpose(0, 1)


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


def _new_layer_caches(pool: torch.Tensor, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Uninitialised ``[1, num_kv_heads, n * block_size, head_dim]`` K and V tensors per layer."""
    _, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    shape = (1, num_kv_heads, n * block_size, head_dim)
    keys = [pool.new_empty(shape) for _ in range(num_layers)]
    values = [pool.new_empty(shape) for _ in range(num_layers)]
    return keys, values
