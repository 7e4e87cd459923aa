"""The vLLM connector's FLASH_ATTN / FLASHINFER layout code on the CPU, without vLLM: block views
of caches in each of vLLM 0.32's six KV cache layouts (exact shapes and strides, reproduced in
``vllm_layouts``; checked against the real package by ``tests/vllm/test_flash_contract.py``),
and the staged copies (chunks, runs, two staging buffers) between the CPU pool and those views."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors.vllm.copies import PagedCopies
from kvtier.connectors.vllm.layout import block_views, flash_block_views, kv_spec_for_caches
from kvtier.kernels import gather_blocks_to_paged, scatter_paged_to_blocks
from tests.unit.connectors.vllm_layouts import (
    LAYOUTS,
    flash_split,
    flashinfer_read_split,
    layer_caches,
    layer_view_order,
    reshape_and_cache_flash,
)

LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 7, 2, 16, 8
SENTINEL = 1e4
layouts = pytest.mark.parametrize("layout", list(LAYOUTS))


def caches_in(layout: str, fill: str = "randn", dtype=torch.bfloat16, **kwargs) -> list[torch.Tensor]:
    return layer_caches(layout, LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD, dtype=dtype, fill=fill, **kwargs)


@layouts
def test_views_are_the_tensors_the_backends_write(layout: str) -> None:
    for cache in caches_in(layout, fill="arange", dtype=torch.float32):
        key, value = flash_block_views(cache, BLOCK, HEAD)
        assert key.shape == value.shape == (NUM_BLOCKS, BLOCK, HEADS, HEAD)
        written_k, written_v = flash_split(cache, HEAD)
        assert torch.equal(key, written_k) and torch.equal(value, written_v)
        assert key.data_ptr() == cache.data_ptr()  # views, no copy
        # FLASHINFER reads the same elements through its own permutation of the cache
        order = layer_view_order(layout)
        back = [order.index(d) for d in range(4)]  # its [memory order] view -> [B, H, N, D] -> [B, N, H, D]
        read_k, read_v = (t.permute(*back).transpose(1, 2) for t in flashinfer_read_split(cache, layout, HEAD))
        assert torch.equal(key, read_k) and torch.equal(value, read_v)


@layouts
def test_tokens_written_by_reshape_and_cache_flash_come_out_of_the_views(layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    cache = caches_in(layout, fill="nan")[1]
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:40]
    key = torch.randn(40, HEADS, HEAD, generator=g).to(cache.dtype)
    value = torch.randn(40, HEADS, HEAD, generator=g).to(cache.dtype)
    reshape_and_cache_flash(key, value, *flash_split(cache, HEAD), slots)
    k_view, v_view = flash_block_views(cache, BLOCK, HEAD)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_view[slot // BLOCK, slot % BLOCK], key[i])
        assert torch.equal(v_view[slot // BLOCK, slot % BLOCK], value[i])


@pytest.mark.parametrize("src_layout, dst_layout", [("LBHNC", "BLNHC"), ("BHLNC", "LBNHC"), ("LHBNC", "BLHNC")])
def test_blocks_are_plain_kv_whatever_the_layout(src_layout: str, dst_layout: str) -> None:
    """Scatter out of one layout, gather into another: the K/V of every token arrive."""
    src, dst = caches_in(src_layout), caches_in(dst_layout, fill="nan")
    src_views = [flash_block_views(c, BLOCK, HEAD) for c in src]
    dst_views = [flash_block_views(c, BLOCK, HEAD) for c in dst]
    spec = kv_spec_for_caches(src, BLOCK)
    pool = torch.full((5, *spec.block_shape), SENTINEL, dtype=spec.dtype)
    paged, slots, targets = torch.tensor([6, 0, 3]), torch.tensor([4, 1, 2]), torch.tensor([2, 5, 1])
    scatter_paged_to_blocks([k for k, _ in src_views], [v for _, v in src_views], paged, pool, slots)
    for slot, block in zip(slots.tolist(), paged.tolist()):
        for layer, (k, v) in enumerate(src_views):
            assert torch.equal(pool[slot, layer, 0], k[block]) and torch.equal(pool[slot, layer, 1], v[block])
    assert bool((pool[[0, 3]] == SENTINEL).all())
    gather_blocks_to_paged(pool, slots, [k for k, _ in dst_views], [v for _, v in dst_views], targets)
    for (sk, sv), (dk, dv) in zip(src_views, dst_views):
        assert torch.equal(dk[targets], sk[paged]) and torch.equal(dv[targets], sv[paged])
        untouched = [b for b in range(NUM_BLOCKS) if b not in targets.tolist()]
        assert bool(dk[untouched].isnan().all())


def test_kernel_blocks_merge_when_tokens_are_outermost_in_a_page() -> None:
    """FLASHINFER's kernel block of 16 under vLLM blocks of 32 (LBNHC): kernel blocks 2b, 2b+1
    are vLLM block b."""
    cache = layer_caches("LBNHC", 1, 4, HEADS, 32, HEAD, dtype=torch.float32, kernel_block_size=16, fill="arange")[0]
    assert cache.shape == (8, HEADS, 16, 2 * HEAD)
    key, value = flash_block_views(cache, 32, HEAD)
    kernel_k, kernel_v = flash_split(cache, HEAD)
    assert key.shape == (4, 32, HEADS, HEAD)
    for b in range(4):
        assert torch.equal(key[b], torch.cat([kernel_k[2 * b], kernel_k[2 * b + 1]]))
        assert torch.equal(value[b], torch.cat([kernel_v[2 * b], kernel_v[2 * b + 1]]))


def test_kernel_blocks_that_no_view_can_merge_are_refused() -> None:
    cache = layer_caches("LBHNC", 1, 4, HEADS, 32, HEAD, kernel_block_size=16)[0]
    with pytest.raises(ValueError, match="LBNHC.*--block-size 16"):
        flash_block_views(cache, 32, HEAD)


@pytest.mark.parametrize(
    "shape, block_size, message",
    [
        ((4, HEADS, BLOCK, 2 * HEAD + 2), BLOCK, "equal head size"),  # K and V head sizes differ
        ((4, HEADS, BLOCK, HEAD, 2), BLOCK, "got \\(4, 2, 16, 8, 2\\)"),
        ((4, HEADS, 24, 2 * HEAD), BLOCK, "split vLLM's 16-token blocks"),
        ((5, HEADS, 8, 2 * HEAD), BLOCK, "split vLLM's 16-token blocks"),  # 5 kernel blocks, pairs expected
    ],
)
def test_other_shapes_are_refused(shape, block_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        flash_block_views(torch.zeros(shape), block_size, HEAD)


def test_backends_other_than_cpu_flash_and_flashinfer_are_refused() -> None:
    cache = caches_in("LBHNC")[0]
    assert all(torch.equal(a, b) for a, b in zip(block_views("FLASHINFER", cache, BLOCK, HEAD), flash_split(cache, HEAD)))
    with pytest.raises(NotImplementedError, match="TRITON_ATTN"):
        block_views("TRITON_ATTN", cache, BLOCK, HEAD)


# -- staged copies on the CPU --------------------------------------------------------------------
def staged(layout: str, blocks_per_buffer: int, fill: str = "randn") -> tuple[PagedCopies, list[torch.Tensor]]:
    caches = caches_in(layout, fill=fill)
    views = [flash_block_views(c, BLOCK, HEAD) for c in caches]
    spec = kv_spec_for_caches(caches, BLOCK)
    pool = torch.full((12, *spec.block_shape), SENTINEL, dtype=spec.dtype)
    copies = PagedCopies(pool, [k for k, _ in views], [v for _, v in views],
                         staging_bytes=2 * blocks_per_buffer * spec.block_nbytes, staged=True)
    assert copies.staged and copies.staging_blocks == blocks_per_buffer
    return copies, caches


@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
@pytest.mark.parametrize("blocks_per_buffer", [1, 2, 16])
def test_staged_save_then_load_moves_exact_blocks(layout: str, blocks_per_buffer: int) -> None:
    copies, caches = staged(layout, blocks_per_buffer)
    pool_ids, paged_ids = [3, 4, 5, 9, 0, 1], [6, 2, 0, 5, 1, 3]  # runs 3-5 and 0-1 in the pool
    fence = copies.save(paged_ids, pool_ids)
    assert fence.done()  # synchronous on the CPU
    for slot, block in zip(pool_ids, paged_ids):
        for layer in range(LAYERS):
            assert torch.equal(copies.pool[slot, layer, 0], copies.keys[layer][block])
            assert torch.equal(copies.pool[slot, layer, 1], copies.values[layer][block])
    assert bool((copies.pool[[2, 6, 7, 8, 10, 11]] == SENTINEL).all())  # other slots untouched

    into, into_caches = staged("BHLNC", blocks_per_buffer, fill="nan")
    into.pool.copy_(copies.pool)
    targets = [4, 1, 6, 0, 3, 2]
    assert into.load(pool_ids, targets).done()
    for layer in range(LAYERS):
        assert torch.equal(into.keys[layer][targets], copies.keys[layer][paged_ids])
        assert torch.equal(into.values[layer][targets], copies.values[layer][paged_ids])
        assert bool(into.keys[layer][5].isnan().all())  # the one block not loaded


def test_direct_copies_per_layer_equal_the_staged_ones() -> None:
    copies, _ = staged("LBNHC", 2)
    direct = PagedCopies(copies.pool.clone(), copies.keys, copies.values, staged=False)
    assert not direct.staged
    ids, paged = torch.tensor([7, 2, 3]), torch.tensor([1, 4, 0])
    for layer in range(LAYERS):
        direct.save_layer(layer, paged, ids)
    copies.save(paged.tolist(), ids.tolist())
    assert torch.equal(direct.pool, copies.pool)


def test_views_that_do_not_fit_the_pool_are_refused() -> None:
    copies, _ = staged("LBHNC", 1)
    with pytest.raises(ValueError, match="expected 3 keys views"):
        PagedCopies(copies.pool, copies.keys[:2], copies.values[:2])
    with pytest.raises(ValueError, match="of torch.bfloat16"):
        PagedCopies(copies.pool, [k.float() for k in copies.keys], copies.values)
