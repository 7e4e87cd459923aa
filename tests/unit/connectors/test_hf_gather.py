"""The HF connector's gather of loaded blocks into cache tensors (kvtier.connectors.hf_cache):
every layout and slot order lands each token's K/V at its position, bit for bit, and the
cache built from the tensors holds them without a copy."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors.hf_cache import LayerGather, cache_from_layers, cache_layers, new_layer_tensors
from kvtier.types import KVSpec, LayerGroup

BLOCK = 4
UNIFORM = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BLOCK, dtype=torch.float32)
MIXED = KVSpec.from_groups(  # MLA-like layer (1 head, K 16 / V 4) beside a full one: per-layer shapes
    [LayerGroup("full", (0,), 2, 8, 8), LayerGroup("mla", (1,), 1, 16, 4)], BLOCK, torch.float32
)


def expected_layer(spec: KVSpec, pool: torch.Tensor, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: position ``i * block_size + t`` holds token ``t`` of block ``ids[i]``."""
    k_view, v_view = spec.layer_views(pool)[layer]
    out = []
    for view in (k_view, v_view):
        tokens = [view[slot, t] for slot in ids for t in range(spec.block_size)]  # each [heads, dim]
        out.append(torch.stack(tokens, dim=1).unsqueeze(0))  # [1, heads, n * block_size, dim]
    return out[0], out[1]


@pytest.mark.parametrize("spec", [UNIFORM, MIXED], ids=["uniform", "per-layer shapes"])
@pytest.mark.parametrize(
    "ids", [[3, 4, 5, 6], [6, 2, 3, 0], [5], [1, 2, 7, 8, 9, 0]], ids=["one run", "scattered", "one block", "two runs"]
)
def test_layer_gather_puts_every_token_at_its_position(spec: KVSpec, ids: list[int]) -> None:
    torch.manual_seed(0)
    pool = torch.randn(10, *spec.block_shape)
    keys, values = new_layer_tensors(spec, len(ids) * BLOCK, pool.device)
    gather = LayerGather(spec, pool, ids)
    for layer in range(spec.num_layers):
        gather.layer(layer, keys[layer], values[layer])
        want_k, want_v = expected_layer(spec, pool, ids, layer)
        assert torch.equal(keys[layer], want_k) and torch.equal(values[layer], want_v)
        assert keys[layer].is_contiguous() and values[layer].is_contiguous()


def test_layer_gather_writes_the_head_of_a_longer_tensor_only() -> None:
    pool = torch.randn(6, *UNIFORM.block_shape)
    keys, values = new_layer_tensors(UNIFORM, 3 * BLOCK, pool.device)
    for t in (*keys, *values):
        t.fill_(7.0)
    LayerGather(UNIFORM, pool, [4, 1]).layer(0, keys[0], values[0])
    want_k, want_v = expected_layer(UNIFORM, pool, [4, 1], 0)
    assert torch.equal(keys[0][:, :, : 2 * BLOCK], want_k) and torch.equal(values[0][:, :, : 2 * BLOCK], want_v)
    assert bool((keys[0][:, :, 2 * BLOCK :] == 7.0).all()) and bool((values[0][:, :, 2 * BLOCK :] == 7.0).all())


def test_cache_from_layers_holds_the_tensors_themselves_and_grows_by_update() -> None:
    keys = [torch.randn(1, 2, 8, 4) for _ in range(3)]
    values = [torch.randn(1, 2, 8, 4) for _ in range(3)]
    cache = cache_from_layers(keys, values)
    got_k, got_v = cache_layers(cache)
    assert [t.data_ptr() for t in got_k] == [t.data_ptr() for t in keys]  # no copy
    assert [t.data_ptr() for t in got_v] == [t.data_ptr() for t in values]
    assert cache.get_seq_length() == 8
    new_k, new_v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    k, v = cache.update(new_k, new_v, 1)  # the suffix prefill appends after the cached positions
    assert torch.equal(k, torch.cat([keys[1], new_k], dim=-2)) and torch.equal(v, torch.cat([values[1], new_v], dim=-2))
    assert cache.get_seq_length(1) == 11 and cache.get_seq_length(0) == 8
