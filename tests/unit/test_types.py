"""KV layout per layer group (kvtier.types.LayerGroup, KVSpec.groups): normal form, names,
shapes, per-layer views, and blocks of every layout through the store's tiers."""

from __future__ import annotations

import pytest
import torch

from kvtier.types import KV_LAYOUT, KVSpec, LayerGroup, Medium
from tests.conftest import chain

F32 = torch.float32


def hybrid() -> KVSpec:
    """Gemma-like: sliding layers 0, 2 and full layers 1, 3, 2 heads of 16."""
    return KVSpec.from_groups(
        [LayerGroup("sliding", (0, 2), 2, 16, 16, window=8), LayerGroup("full", (1, 3), 2, 16, 16)], 4, F32
    )


def mla() -> KVSpec:
    """DeepSeek-like as transformers caches it: a latent K of 32 and a RoPE V of 8, one head."""
    return KVSpec.from_groups([LayerGroup("mla", (0, 1, 2), 1, 32, 8)], 4, F32)


def test_full_uniform_groups_are_the_plain_spec_and_keep_its_layout_name():
    grouped = KVSpec.from_groups([LayerGroup("full", (1,), 2, 16, 16), LayerGroup("full", (0,), 2, 16, 16)], 4, F32)
    plain = KVSpec(2, 2, 16, 4, F32)
    assert grouped == plain and grouped.groups == () and grouped.layout_name == KV_LAYOUT == "LKVTHD"
    assert plain.block_shape == (2, 2, 4, 2, 16)


def test_hybrid_spec_keeps_the_uniform_block_shape_under_its_own_layout_name():
    spec = hybrid()
    assert spec.is_uniform and spec.block_shape == (4, 2, 4, 2, 16)
    assert spec.layout_name == "LKVTHD[sliding(8):0,2:h2k16v16;full:1,3:h2k16v16]"
    assert spec.block_nbytes == KVSpec(4, 2, 16, 4, F32).block_nbytes
    # the same groups listed in another order or split are the same spec
    split = KVSpec.from_groups(
        [LayerGroup("full", (3,), 2, 16, 16), LayerGroup("sliding", (2,), 2, 16, 16, window=8),
         LayerGroup("full", (1,), 2, 16, 16), LayerGroup("sliding", (0,), 2, 16, 16, window=8)], 4, F32,
    )
    assert split == spec and hash(split) == hash(spec)


def test_windows_and_kinds_name_distinct_layouts():
    names = {
        KVSpec.from_groups([LayerGroup(kind, (0,), 2, 16, 16, window=w)], 4, F32).layout_name
        for kind, w in (("full", None), ("sliding", 8), ("sliding", 16), ("chunked", 8), ("mla", None))
    }
    assert len(names) == 5


def test_mla_spec_is_one_flat_run_of_each_layers_k_then_v():
    spec = mla()
    assert not spec.is_uniform and (spec.num_kv_heads, spec.head_dim) == (0, 0)
    assert spec.block_shape == (3 * 4 * (32 + 8),) and spec.bytes_per_token == 3 * 40 * 4
    assert spec.layout_name == "LKTHD+VTHD[mla:0-2:h1k32v8]"
    pool = torch.arange(2 * spec.block_numel, dtype=F32).view(2, -1)
    views = spec.layer_views(pool)
    k1, v1 = views[1]
    assert k1.shape == (2, 4, 1, 32) and v1.shape == (2, 4, 1, 8)
    assert k1[0, 0, 0, 0].item() == 160 and v1[0, 0, 0, 0].item() == 160 + 128  # layer 1 starts at 4*40
    assert k1[1, 0, 0, 0].item() == spec.block_numel + 160
    assert spec.layer_ranges() == [(0, 160), (160, 320), (320, 480)]
    k1.fill_(-1.0)  # views write through
    assert (pool[:, 160:288] == -1).all() and (pool[:, 288:320] != -1).all()


def test_uniform_views_and_ranges_match_the_lkvthd_block():
    spec = hybrid()
    pool = torch.randn(3, *spec.block_shape)
    k, v = spec.layer_views(pool)[2]
    assert torch.equal(k, pool[:, 2, 0]) and torch.equal(v, pool[:, 2, 1])
    start, stop = spec.layer_ranges()[2]
    assert torch.equal(pool[1].view(-1)[start:stop], pool[1, 2].reshape(-1))


@pytest.mark.parametrize(
    "groups, match",
    [
        ([LayerGroup("full", (0, 2), 2, 16, 16)], "covering layers 0..2"),
        ([LayerGroup("full", (0, 1), 2, 16, 16), LayerGroup("sliding", (1,), 2, 16, 16, window=4)], "once each"),
    ],
)
def test_groups_must_partition_the_layers(groups, match):
    with pytest.raises(ValueError, match=match):
        KVSpec(3 if "0..2" in match else 2, 2, 16, 4, F32, tuple(groups))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="sliding", window=None), "window of a sliding group"),
        (dict(kind="full", window=8), "no window"),
        (dict(kind="local"), "kind in"),
        (dict(layers=(1, 0)), "ascending"),
        (dict(layers=()), "non-empty"),
        (dict(k_head_dim=0), "k_head_dim"),
    ],
)
def test_bad_groups_raise_value_error(kwargs, match):
    fields = dict(kind="full", layers=(0,), num_kv_heads=1, k_head_dim=8, v_head_dim=8, window=None) | kwargs
    with pytest.raises(ValueError, match=match):
        LayerGroup(**fields)


def test_head_fields_must_agree_with_the_groups():
    with pytest.raises(ValueError, match="expected num_kv_heads, head_dim = \\(0, 0\\)"):
        KVSpec(3, 1, 32, 4, F32, mla().groups)
    with pytest.raises(ValueError, match="expected num_kv_heads, head_dim = \\(2, 16\\)"):
        KVSpec(4, 2, 8, 4, F32, hybrid().groups)


@pytest.mark.parametrize("make", [hybrid, mla, lambda: KVSpec(4, 2, 16, 4, F32, head_major=True)],
                         ids=["hybrid", "mla", "head-major"])
def test_blocks_of_every_layout_round_trip_through_cpu_and_disk(make, make_store, namespace):
    spec = make()
    blocks = torch.randn(6, *spec.block_shape)
    hashes = chain(6, spec, namespace)
    store = make_store(gpu_blocks=2, cpu_blocks=2, disk_blocks=8, spec=spec)
    assert store.store(hashes, blocks) == 6
    store.close()
    reopened = make_store(gpu_blocks=6, disk_blocks=8, spec=spec)
    loaded = reopened.load(hashes)
    with loaded.lease:
        assert len(loaded.block_ids) == 6 and set(loaded.sources) == {Medium.DISK}
        assert torch.equal(reopened.top.tensor[torch.tensor(loaded.block_ids)], blocks)


def test_head_major_layout_has_its_own_name_shape_and_wire_form():
    from kvtier.types import KV_LAYOUT_HEAD_MAJOR
    from kvtier.wire import pack_spec, spec_from_wire, spec_to_wire, unpack_spec

    token = KVSpec(4, 2, 16, 8, F32)
    head = KVSpec(4, 2, 16, 8, F32, head_major=True)
    assert head != token and head.layout_name == KV_LAYOUT_HEAD_MAJOR and token.layout_name == KV_LAYOUT
    assert head.block_shape == (4, 2, 2, 8, 16) and head.block_nbytes == token.block_nbytes
    sliding = KVSpec.from_groups(hybrid().groups, 4, F32, head_major=True)
    assert sliding.head_major and sliding.layout_name.startswith(KV_LAYOUT_HEAD_MAJOR + "[")
    assert not KVSpec.from_groups(mla().groups, 4, F32, head_major=True).head_major  # not uniform: token-major
    for spec in (head, sliding, token, hybrid(), mla()):
        assert spec_from_wire(spec_to_wire(spec)) == spec and unpack_spec(pack_spec(spec)) == spec
    assert "layout" not in spec_to_wire(token)  # unchanged for the layouts before it
    with pytest.raises(ValueError, match="expected a uniform spec for head_major"):
        KVSpec(3, 0, 0, 4, F32, mla().groups, head_major=True)
    with pytest.raises(ValueError, match="expected layout"):
        spec_from_wire({**spec_to_wire(head), "layout": "HDTKVL"})
    with pytest.raises(ValueError, match="expected uniform groups"):
        spec_from_wire({**spec_to_wire(mla()), "layout": KV_LAYOUT_HEAD_MAJOR})
