"""The HF connector's gather of loaded blocks into cache tensors (kvtier.connectors.hf_cache):
every layout and slot order lands each token's K/V at its position, bit for bit, and the
cache built from the tensors holds them without a copy."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors.hf_cache import (
    HostHitBuffer,
    LayerGather,
    block_places,
    block_views,
    cache_from_layers,
    cache_layers,
    gather_into,
    new_layer_tensors,
    scatter_from_layers,
)
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


# -- the head-major layout and the host hit path -------------------------------------------------
HEAD_MAJOR = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BLOCK, dtype=torch.float32, head_major=True)


def test_head_major_layer_views_read_heads_outer_in_each_block() -> None:
    """Independent of layer_views: token t, head h of layer l's K in slot b is pool[b, l, 0, h, t]."""
    pool = torch.randn(5, *HEAD_MAJOR.block_shape)
    assert HEAD_MAJOR.block_shape == (3, 2, 2, BLOCK, 8)
    for layer, (k, v) in enumerate(HEAD_MAJOR.layer_views(pool)):
        assert k.shape == (5, BLOCK, 2, 8) and v.shape == (5, BLOCK, 2, 8)
        for b, t, h in ((0, 0, 0), (4, BLOCK - 1, 1), (2, 1, 1)):
            assert torch.equal(k[b, t, h], pool[b, layer, 0, h, t]) and torch.equal(v[b, t, h], pool[b, layer, 1, h, t])


@pytest.mark.parametrize(
    "ids", [[3, 4, 5, 6], [6, 2, 3, 0], [5], [1, 2, 7, 8, 9, 0]], ids=["one run", "scattered", "one block", "two runs"]
)
def test_layer_gather_of_a_head_major_pool_puts_every_token_at_its_position(ids: list[int]) -> None:
    pool = torch.randn(10, *HEAD_MAJOR.block_shape)
    keys, values = new_layer_tensors(HEAD_MAJOR, len(ids) * BLOCK, pool.device)
    gather = LayerGather(HEAD_MAJOR, pool, ids)
    for layer in range(3):
        gather.layer(layer, keys[layer], values[layer])
        want_k, want_v = expected_layer(HEAD_MAJOR, pool, ids, layer)
        assert torch.equal(keys[layer], want_k) and torch.equal(values[layer], want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("spec", [UNIFORM, HEAD_MAJOR], ids=["token-major", "head-major"])
@pytest.mark.parametrize(
    "chunks", [[[0, 1, 2, 3]], [[2, 3], [0, 1]], [[0], [3], [1, 2]]], ids=["at once", "two chunks", "out of order"]
)
def test_gather_into_writes_each_chunk_at_its_positions(spec: KVSpec, chunks: list[list[int]], dtype) -> None:
    """Chunks as PrefetchHandle.landed yields them (any order): every layer's K/V of every
    block lands at its request position, bit for bit, whatever the slots and dtype (the
    copies run on byte views: numpy has no bfloat16)."""
    pool = torch.randn(12, *spec.block_shape).to(dtype)
    ids = [7, 8, 2, 10]  # positions 0, 1 consecutive slots; 2, 3 not
    out = torch.full((3, 2, 2, 4 * BLOCK, 8), float("nan"), dtype=dtype)
    for chunk in chunks:
        gather_into(spec, pool, out, [ids[i] for i in chunk], chunk)
    for layer in range(3):
        want_k, want_v = expected_layer(spec, pool, ids, layer)
        assert torch.equal(out[layer, 0].unsqueeze(0), want_k) and torch.equal(out[layer, 1].unsqueeze(0), want_v)


@pytest.mark.parametrize("spec", [UNIFORM, HEAD_MAJOR], ids=["token-major", "head-major"])
def test_block_views_are_where_gather_into_writes_each_block(spec: KVSpec) -> None:
    """block_views(spec, out)[i] written with slot ids[i] gives out what gather_into gives."""
    pool = torch.randn(6, *spec.block_shape)
    ids = [4, 1, 5]
    want = torch.empty(3, 2, 2, 3 * BLOCK, 8)
    gather_into(spec, pool, want, ids, [0, 1, 2])
    out = torch.full_like(want, float("nan"))
    views = block_views(spec, out)
    assert len(views) == 3 and all(tuple(v.shape) == spec.block_shape for v in views)
    for view, slot in zip(views, ids):
        view.copy_(pool[slot])
    assert torch.equal(out, want)


@pytest.mark.parametrize("spec", [UNIFORM, HEAD_MAJOR], ids=["token-major", "head-major"])
def test_scatter_then_gather_gives_back_the_cache_bytes(spec: KVSpec) -> None:
    keys = [torch.randn(1, 2, 3 * BLOCK + 2, 8) for _ in range(3)]
    values = [torch.randn(1, 2, 3 * BLOCK + 2, 8) for _ in range(3)]
    pool = torch.zeros(8, *spec.block_shape)
    scatter_from_layers(spec, keys, values, pool, torch.tensor([5, 1]), BLOCK)  # tokens BLOCK .. 3 * BLOCK
    out = torch.empty(3, 2, 2, 2 * BLOCK, 8)
    gather_into(spec, pool, out, [5, 1], [0, 1])
    for layer in range(3):
        assert torch.equal(out[layer, 0], keys[layer][0, :, BLOCK : 3 * BLOCK])
        assert torch.equal(out[layer, 1], values[layer][0, :, BLOCK : 3 * BLOCK])


def test_hit_buffer_is_reused_only_once_nothing_else_holds_it() -> None:
    buffer = HostHitBuffer(HEAD_MAJOR, 1 << 20)
    kv = buffer.take(2 * BLOCK)
    assert kv.shape == (3, 2, 2, 2 * BLOCK, 8) and kv.is_contiguous()
    first = kv.data_ptr()
    cropped = kv[0, 0].unsqueeze(0)[:, :, :3]  # a cache layer cropped by the caller: a view of a view
    del kv
    assert buffer.take(2 * BLOCK) is None, "handed out memory a live view still reads"
    del cropped
    assert buffer.take(BLOCK).data_ptr() == first  # free and large enough: reused (a shorter hit too)
    grown = buffer.take(4 * BLOCK)  # free but too small: replaced by a larger one
    assert grown.shape == (3, 2, 2, 4 * BLOCK, 8)
    ptr = grown.data_ptr()
    del grown
    assert buffer.take(2 * BLOCK).data_ptr() == ptr


def test_hit_buffer_keeps_nothing_above_keep_bytes() -> None:
    one_block = (3 * 2 * 2 * BLOCK * 8) * 4  # one block's worth of this spec, fp32
    buffer = HostHitBuffer(HEAD_MAJOR, one_block)
    first = buffer.take(BLOCK)
    ptr = first.data_ptr()
    del first
    assert buffer.take(2 * BLOCK) is None  # larger than keep_bytes: the caller allocates per layer
    assert buffer.take(BLOCK).data_ptr() == ptr
    with pytest.raises(ValueError):
        HostHitBuffer(HEAD_MAJOR, -1)
    assert HostHitBuffer(HEAD_MAJOR, 0).take(BLOCK) is None


def test_hit_buffer_taken_from_many_threads_at_once_is_handed_to_one_only() -> None:
    """Two hits at once must never be given the same memory (each would overwrite the other's
    K/V): of the takes racing on a free buffer, exactly one gets it, the rest get ``None``."""
    import threading

    for _ in range(50):
        buffer = HostHitBuffer(HEAD_MAJOR, 1 << 20)
        buffer.take(BLOCK)  # allocated (the view is dropped at once: free again)
        start, taken = threading.Barrier(8), []

        def take() -> None:
            start.wait()
            taken.append(buffer.take(BLOCK))

        threads = [threading.Thread(target=take) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(kv is not None for kv in taken) == 1, [kv is not None for kv in taken]


def test_cache_layers_are_shallow_copies_of_the_template_holding_the_given_tensors():
    import copy

    from kvtier.connectors.hf_cache import _layer_copier, cache_from_layers

    keys = [torch.randn(1, 2, 5, 4) for _ in range(3)]
    values = [torch.randn(1, 2, 5, 4) for _ in range(3)]
    cache = cache_from_layers(keys, values)
    assert [layer.keys is k and layer.values is v for layer, k, v in zip(cache.layers, keys, values)] == [True] * 3
    assert len({id(layer) for layer in cache.layers}) == 3 and cache.get_seq_length() == 5
    first = cache.layers[0]
    copied = _layer_copier(first)()
    assert type(copied) is type(first) and copied is not first and vars(copied) == vars(copy.copy(first))

    class Custom:  # a class that copies itself its own way goes through copy.copy
        def __init__(self):
            self.copies = 0

        def __copy__(self):
            new = Custom()
            new.copies = self.copies + 1
            return new

    assert _layer_copier(Custom())().copies == 1


@pytest.mark.parametrize("spec", [UNIFORM, HEAD_MAJOR], ids=["token-major", "head-major"])
def test_block_places_are_the_block_views(spec: KVSpec) -> None:
    """block_places(spec, out)[i] is block_views(spec, out)[i]: same shape, strides and
    address; a subset keeps the order asked for; addresses() are the views' data_ptrs."""
    out = torch.randn(3, 2, 2, 5 * BLOCK, 8)
    views, places = block_views(spec, out), block_places(spec, out)
    assert len(places) == len(views) == 5
    for view, place in zip(views, [places[i] for i in range(5)]):
        assert (place.shape, place.stride(), place.data_ptr()) == (view.shape, view.stride(), view.data_ptr())
    subset = places.subset([4, 0, 2])
    assert [v.data_ptr() for v in (subset[0], subset[1], subset[2])] == [views[i].data_ptr() for i in (4, 0, 2)]
    assert subset.addresses().tolist() == [views[i].data_ptr() for i in (4, 0, 2)]
