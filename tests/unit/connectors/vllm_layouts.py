"""vLLM 0.32's per-layer KV caches on CUDA (FLASH_ATTN, FLASHINFER), reproduced in plain torch
so that the layout code is tested without vLLM; ``tests/vllm/test_flash_contract.py`` checks
every function here against the real package.

Sources (vLLM 0.32.0, ``site-packages/vllm``):

- ``v1/kv_cache_layout.py`` ``KVCacheLayout``: six stride permutations of the logical
  ``[L, B, H, N, C]`` (layers, blocks, K/V heads, tokens, content = K then V of a head).
- ``v1/kv_cache_interface.py`` ``compute_layer_kv_cache_shape_bytes``,
  ``compute_layout_strides``, ``create_kv_cache_views``: one dense backing allocation viewed
  per layer as ``[B, H, N, C]`` with the strides of the layout; with kernel blocks (a backend
  block smaller than vLLM's), ``B`` counts kernel blocks and ``N`` is the kernel block size.
- ``v1/core/kv_cache_utils.py`` ``get_kv_cache_config_from_groups``: block-outermost layouts
  pack every layer's page of a block together (the cross-layer layout), others give each layer
  its own region.
- ``v1/attention/backends/flash_attn.py`` and ``flashinfer.py`` ``do_kv_cache_update``:
  ``key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)`` then
  ``reshape_and_cache_flash`` (token ``i`` at slot ``s`` -> ``key_cache[s // N, s % N]``);
  ``flashinfer.py`` ``forward``: ``kv_cache.permute(*layout.layer_view_order)`` then
  ``.split(head_size, dim=-1)``.
"""

from __future__ import annotations

import math

import torch

LAYOUTS: dict[str, tuple[int, ...]] = {  # KVCacheLayout: logical [L, B, H, N, C] -> memory order
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
CROSS_LAYER = ("BLHNC", "BLNHC", "BHLNC")
"""Block outermost: a block of every layer is one contiguous run (never split into kernel blocks)."""


def layer_view_order(layout: str) -> tuple[int, ...]:
    """``KVCacheLayout.layer_view_order``: memory order of a 4-D per-layer view ``[B, H, N, C]``."""
    return tuple(i - 1 for i in LAYOUTS[layout] if i != 0)


def layer_caches(
    layout: str, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_size: int,
    dtype: torch.dtype = torch.bfloat16, kernel_block_size: int | None = None, fill: str | float = "randn",
) -> list[torch.Tensor]:
    """The per-layer caches vLLM registers with a connector: ``[B * r, H, N / r, 2 * head_size]``
    views of one dense allocation in ``layout``'s memory order (``r`` = ``block_size //
    kernel_block_size``, 1 by default). ``fill``: ``"randn"``, ``"arange"`` (every element
    distinct in float32), ``"nan"`` or a value."""
    kernel = kernel_block_size or block_size
    ratio = block_size // kernel
    assert ratio * kernel == block_size and (ratio == 1 or layout not in CROSS_LAYER)
    logical = (num_layers, num_blocks * ratio, num_kv_heads, kernel, 2 * head_size)
    order = LAYOUTS[layout]
    numel = math.prod(logical)
    if fill == "arange":
        flat = torch.arange(numel, dtype=torch.float32).to(dtype)
    elif fill == "nan" or isinstance(fill, (int, float)):
        flat = torch.full((numel,), float(fill), dtype=dtype)
    else:
        flat = torch.randn(numel).to(dtype)
    physical = flat.view([logical[d] for d in order])
    inverse = [order.index(d) for d in range(5)]
    view = physical.permute(*inverse)  # logical [L, B, H, N, C] over memory in `order`
    return [view[layer] for layer in range(num_layers)]


def flash_split(cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``do_kv_cache_update`` of FLASH_ATTN and FLASHINFER: the K and V the kernels write."""
    key, value = cache.transpose(1, 2).split(head_size, dim=-1)
    return key, value


def flashinfer_read_split(cache: torch.Tensor, layout: str, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FLASHINFER's ``forward``: K and V as its kernels read them, in memory order (``[B, N, H, D]``
    for token-major layouts ``NHD``, ``[B, H, N, D]`` for head-major ``HND``)."""
    key, value = cache.permute(*layer_view_order(layout)).split(head_size, dim=-1)
    return key, value


def reshape_and_cache_flash(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """``reshape_and_cache_flash`` in torch: token ``i`` (``[H, D]``) to slot ``slots[i]`` of
    ``key_cache``/``value_cache`` ``[num_blocks, block_size, H, D]`` (any strides)."""
    block_size = key_cache.shape[1]
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[i]
        value_cache[block, offset] = value[i]
