"""Checks of the public inputs of :mod:`kvtier.kernels`; every failure is a ``ValueError``.

Messages read "expected ..., got ...". Shape, dtype and device checks are free; the range and
distinctness checks of block ids read the ids back to the host (one device sync per id tensor),
so callers on a hot CUDA path may skip them with ``check_ids=False``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_contiguous",
    "check_id_values",
    "check_ids",
    "check_paged",
    "check_pool",
    "check_staging",
    "expect",
]


def expect(ok: bool, expected: str, got: object) -> None:
    """Raise ``ValueError(f"expected {expected}, got {got}")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"expected {expected}, got {got}")


def check_pool(pool: torch.Tensor) -> None:
    """``pool`` is a ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` tensor."""
    expect(isinstance(pool, torch.Tensor), "pool to be a torch.Tensor", type(pool).__name__)
    expect(
        pool.dim() == 6 and pool.shape[2] == 2,
        "pool of shape [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]",
        f"shape {tuple(pool.shape)}",
    )


def check_ids(name: str, ids: torch.Tensor, device: torch.device) -> None:
    """``ids`` is a 1-D int64 tensor on ``device``."""
    expect(isinstance(ids, torch.Tensor), f"{name} to be a torch.Tensor", type(ids).__name__)
    expect(ids.dim() == 1, f"{name} to be 1-D", f"shape {tuple(ids.shape)}")
    expect(ids.dtype == torch.int64, f"{name} of dtype torch.int64", ids.dtype)
    expect(ids.device == device, f"{name} on {device}", ids.device)


def check_id_values(name: str, ids: torch.Tensor, bound: int, *, distinct: bool) -> None:
    """Every id is in ``[0, bound)`` and, if ``distinct`` (the ids of a copy's destination),
    none repeats. Reads the ids back to the host: one device sync."""
    if ids.numel() == 0:
        return
    lo, hi = ids.aminmax()
    stats = [lo, hi]
    if distinct:
        ordered = ids.sort().values
        stats.append((ordered[1:] == ordered[:-1]).any().to(torch.int64))
    lo, hi, *repeated = torch.stack(stats).tolist()
    expect(0 <= lo and hi < bound, f"{name} in [0, {bound})", f"ids from {lo} to {hi}")
    expect(not any(repeated), f"distinct {name} (they name the copy's destination)", "a repeated id")


def _check_like_pool(name: str, tensor: torch.Tensor, pool: torch.Tensor) -> None:
    expect(isinstance(tensor, torch.Tensor), f"{name} to be a torch.Tensor", type(tensor).__name__)
    expect(tensor.dtype == pool.dtype, f"{name} of the pool's dtype {pool.dtype}", tensor.dtype)
    expect(tensor.device == pool.device, f"{name} on the pool's device {pool.device}", tensor.device)


def _check_layer_count(name: str, tensors: Sequence[torch.Tensor], num_layers: int) -> None:
    expect(
        isinstance(tensors, Sequence) and len(tensors) == num_layers,
        f"{name} to be a sequence of num_layers={num_layers} tensors",
        f"{type(tensors).__name__} of length {len(tensors) if isinstance(tensors, Sequence) else '?'}",
    )


def check_contiguous(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    start_token: int,
    *,
    to_pool: bool,
    check_values: bool = True,
) -> None:
    """Inputs of ``gather_blocks_to_contiguous`` / ``scatter_contiguous_to_blocks``."""
    check_pool(pool)
    num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    check_ids("block_ids", block_ids, pool.device)
    expect(
        isinstance(start_token, int) and not isinstance(start_token, bool) and start_token >= 0,
        "start_token to be an int >= 0",
        repr(start_token),
    )
    min_seq_len = start_token + block_ids.numel() * block_size
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        _check_layer_count(name, caches, num_layers)
        for layer, cache in enumerate(caches):
            _check_like_pool(f"{name}[{layer}]", cache, pool)
            expect(
                cache.dim() == 4
                and cache.shape[0] == 1
                and cache.shape[1] == num_kv_heads
                and cache.shape[3] == head_dim
                and cache.shape[2] >= min_seq_len,
                f"{name}[{layer}] of shape [1, {num_kv_heads}, seq_len >= {min_seq_len}, {head_dim}]",
                f"shape {tuple(cache.shape)}",
            )
    if check_values:  # last, so a malformed call fails before it syncs
        check_id_values("block_ids", block_ids, num_blocks, distinct=to_pool)


def check_paged(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    paged_block_ids: torch.Tensor,
    *,
    to_pool: bool,
    check_values: bool = True,
) -> None:
    """Inputs of ``gather_blocks_to_paged`` / ``scatter_paged_to_blocks``: every K and V cache
    ``[num_paged_blocks, block_size, num_kv_heads, head_dim]``, ``num_paged_blocks`` that of
    ``key_caches[0]``."""
    check_pool(pool)
    num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    check_ids("block_ids", block_ids, pool.device)
    check_ids("paged_block_ids", paged_block_ids, pool.device)
    expect(
        paged_block_ids.numel() == block_ids.numel(),
        f"paged_block_ids as long as block_ids ({block_ids.numel()})",
        f"length {paged_block_ids.numel()}",
    )
    num_paged_blocks = -1
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        _check_layer_count(name, caches, num_layers)
        for layer, cache in enumerate(caches):
            _check_like_pool(f"{name}[{layer}]", cache, pool)
            first = num_paged_blocks < 0
            if first and cache.dim() == 4:
                num_paged_blocks = cache.shape[0]
            expect(
                tuple(cache.shape) == (num_paged_blocks, block_size, num_kv_heads, head_dim),
                f"{name}[{layer}] of shape [num_paged_blocks, {block_size}, {num_kv_heads}, {head_dim}]"
                + ("" if first else f" with num_paged_blocks={num_paged_blocks} as in key_caches[0]"),
                f"shape {tuple(cache.shape)}",
            )
    if check_values:
        check_id_values("block_ids", block_ids, num_blocks, distinct=to_pool)
        check_id_values("paged_block_ids", paged_block_ids, num_paged_blocks, distinct=not to_pool)


def check_staging(
    pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, *, to_pool: bool, check_values: bool = True
) -> None:
    """Inputs of ``pack_blocks`` / ``unpack_blocks``."""
    check_pool(pool)
    check_ids("block_ids", block_ids, pool.device)
    _check_like_pool("staging", staging, pool)
    expected_shape = (block_ids.numel(), *pool.shape[1:])
    expect(
        tuple(staging.shape) == expected_shape,
        f"staging of shape [n, *block_shape] = {list(expected_shape)}",
        f"shape {tuple(staging.shape)}",
    )
    if check_values:
        check_id_values("block_ids", block_ids, pool.shape[0], distinct=to_pool)
