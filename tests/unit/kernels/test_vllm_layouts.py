"""The Triton gather/scatter on vLLM 0.32's FLASH_ATTN / FLASHINFER caches, in each of its six
KV cache layouts (exact shapes and strides: ``tests/connectors/vllm_layouts.py``), through the
block views the connector builds (``flash_block_views``), against the torch reference.

On CPU the kernels run in the Triton interpreter; ``test_on_cuda`` runs them compiled."""

from __future__ import annotations

import os

import pytest
import torch

import kvtier.kernels as kernels
from kvtier.connectors.vllm.layout import flash_block_views, kv_spec_for_caches
from tests.unit.connectors.vllm_layouts import LAYOUTS, layer_caches

triton_kv = pytest.importorskip("kvtier.kernels.triton_kv")

LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 6, 2, 16, 64
POOL_IDS, PAGED_IDS = [4, 0, 2], [5, 1, 3]


def run(mode: str, fn, *args) -> None:
    saved = os.environ.get("KVTIER_KERNELS")
    os.environ["KVTIER_KERNELS"] = mode
    try:
        fn(*args)
    finally:
        os.environ.pop("KVTIER_KERNELS") if saved is None else os.environ.__setitem__("KVTIER_KERNELS", saved)


def views(caches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    pairs = [flash_block_views(c, BLOCK, HEAD) for c in caches]
    return [k for k, _ in pairs], [v for _, v in pairs]


def check_layout(layout: str, device: str) -> None:
    torch.manual_seed(0)
    source = _to_device(layer_caches(layout, LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD), device)
    spec = kv_spec_for_caches(source, BLOCK)
    pool_ids = torch.tensor(POOL_IDS, device=device)
    paged_ids = torch.tensor(PAGED_IDS, device=device)
    pools = []
    for mode in ("triton", "torch"):
        pool = torch.full((5, *spec.block_shape), 1e4, dtype=spec.dtype, device=device)
        run(mode, kernels.scatter_paged_to_blocks, *views(source), paged_ids, pool, pool_ids)
        pools.append(pool)
    assert torch.equal(pools[0], pools[1])
    assert bool((pools[0][[1, 3]] == 1e4).all()) and not bool((pools[0][POOL_IDS] == 1e4).any())
    outputs = []
    for mode in ("triton", "torch"):
        target = _to_device(layer_caches(layout, LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD, fill="nan"), device)
        run(mode, kernels.gather_blocks_to_paged, pools[0], pool_ids, *views(target), torch.tensor([0, 2, 4], device=device))
        outputs.append(target)
    for got, want, src in zip(*outputs, source):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
        k_got, _ = flash_block_views(got, BLOCK, HEAD)
        k_src, _ = flash_block_views(src, BLOCK, HEAD)
        assert torch.equal(k_got[[0, 2, 4]], k_src[PAGED_IDS]) and bool(k_got[[1, 3, 5]].isnan().all())


def _to_device(caches: list[torch.Tensor], device: str) -> list[torch.Tensor]:
    """The caches moved to ``device`` with their strides (one backing allocation, as vLLM's)."""
    if device == "cpu":
        return caches
    base = caches[0]._base if caches[0]._base is not None else caches[0]
    moved = base.to(device)
    return [torch.as_strided(moved, c.shape, c.stride(), c.storage_offset()) for c in caches]


@pytest.mark.skipif(not triton_kv.INTERPRETED, reason="kernels are compiled: see test_on_cuda")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_interpreted(layout: str) -> None:
    check_layout(layout, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_on_cuda(layout: str) -> None:
    check_layout(layout, "cuda")
