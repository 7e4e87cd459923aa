"""CPU_ATTN's block layout, measured with vLLM's own kernel, and kvtier's copies through
:func:`paged_view` checked against plain torch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
from kvtier.kernels import gather_blocks_to_paged, scatter_paged_to_blocks
from vllm import _custom_ops as ops

from kvtier.connectors.vllm.layout import VERIFIED_ISAS, kv_spec_for_caches, paged_view

NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM = 6, 3, 32, 64


def reference_layout(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Where CPU_ATTN puts token ``i``'s K/V, in plain torch: per (block, head) K as
    ``[head_dim, block_size]`` then V as ``[block_size, head_dim]``."""
    cache = torch.zeros(NUM_BLOCKS, HEADS, 2, BLOCK * HEAD_DIM, dtype=key.dtype)
    k = cache[:, :, 0].view(NUM_BLOCKS, HEADS, HEAD_DIM, BLOCK)
    v = cache[:, :, 1].view(NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM)
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK)
        k[block, :, :, offset] = key[i]
        v[block, :, offset] = value[i]
    return cache.view(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)


@pytest.mark.parametrize("isa", VERIFIED_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attn_writes_k_transposed_then_v(isa: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    num_tokens = 70
    key = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
    value = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:num_tokens]
    cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype)
    key_cache, value_cache = cache.view(NUM_BLOCKS, HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    assert torch.equal(cache, reference_layout(key, value, slots))


def test_paged_view_block_is_the_vllm_block_bytes_in_memory_order() -> None:
    cache = torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    view = paged_view(cache, BLOCK)
    assert view.shape == (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    assert view.data_ptr() == cache.data_ptr()
    for b in range(NUM_BLOCKS):
        assert view[:, b].is_contiguous()
        assert torch.equal(view[:, b].reshape(-1), cache[b].reshape(-1))


def test_kernels_round_trip_exact_bytes_through_the_view() -> None:
    g = torch.Generator().manual_seed(1)
    num_layers = 3
    caches = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=g) for _ in range(num_layers)]
    spec = kv_spec_for_caches(caches, BLOCK)
    pool = torch.full((5, *spec.block_shape), float("nan"))
    src_ids, pool_ids = torch.tensor([4, 1, 2]), torch.tensor([0, 3, 2])
    for layer, cache in enumerate(caches):
        view = paged_view(cache, BLOCK)
        scatter_paged_to_blocks([view[0]], [view[1]], src_ids, pool[:, layer : layer + 1], pool_ids)
    for src, slot in zip(src_ids.tolist(), pool_ids.tolist()):
        for layer, cache in enumerate(caches):
            assert torch.equal(pool[slot, layer].reshape(-1), cache[src].reshape(-1))  # verbatim
    # back into another engine's caches, other slots: exact bytes; untouched blocks keep their poison
    targets = [torch.full_like(c, -7.0) for c in caches]
    dst_ids = torch.tensor([0, 5, 3])
    for layer, target in enumerate(targets):
        view = paged_view(target, BLOCK)
        gather_blocks_to_paged(pool[:, layer : layer + 1], pool_ids, [view[0]], [view[1]], dst_ids)
    for layer, (cache, target) in enumerate(zip(caches, targets)):
        assert torch.equal(target[dst_ids], cache[src_ids])
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids.tolist()]
        assert bool((target[untouched] == -7.0).all())


def test_kv_spec_for_caches_reads_heads_and_head_dim() -> None:
    caches = [torch.zeros(4, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    spec = kv_spec_for_caches(caches, BLOCK)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype) == (
        2, HEADS, HEAD_DIM, BLOCK, torch.bfloat16,
    )


@pytest.mark.parametrize(
    "cache, message",
    [
        (torch.zeros(4, HEADS, BLOCK, HEAD_DIM, 2), "2 \\* head_dim"),
        (torch.zeros(4, HEADS, 16, 2 * HEAD_DIM), "32, 2 \\* head_dim"),
        (torch.zeros(4, HEADS, BLOCK, 2 * HEAD_DIM + 1), "32, 2 \\* head_dim"),
        (torch.zeros(HEADS, 4, BLOCK, 2 * HEAD_DIM).transpose(0, 1), "contiguous"),
    ],
)
def test_paged_view_rejects_other_layouts(cache: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paged_view(cache, BLOCK)


def test_kv_spec_for_caches_rejects_mixed_layers() -> None:
    with pytest.raises(ValueError, match="like layer 0"):
        kv_spec_for_caches([torch.zeros(4, 2, BLOCK, 128), torch.zeros(4, 3, BLOCK, 128)], BLOCK)
    with pytest.raises(ValueError, match="at least one"):
        kv_spec_for_caches([], BLOCK)
