"""Options, namespaces, key mapping and layout checks of the SGLang backend (no SGLang needed:
these run in the project venv too)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.connectors.sglang.keys import block_hashes, namespace_context
from kvtier.connectors.sglang.layout import PageLayout, page_layout_for
from kvtier.connectors.sglang.options import BackendOptions

pytestmark = pytest.mark.sglang

KEY = "a" * 64
MHA = PageLayout("MHA", "layer_first", num_layers=2, page_size=4, num_heads=2, head_dim=8, dtype=torch.float32)
MLA = PageLayout("MLA", "layer_first", num_layers=2, page_size=4, num_heads=1, head_dim=24, dtype=torch.float32)


def config(**changes):
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1)
    return SimpleNamespace(**{**fields, **changes})


def namespace(layout=MHA, model="m", revision="", salt=None, **changes) -> bytes:
    return namespace_context(config(**changes), layout, model, revision, salt).namespace()


def test_options_defaults_env_and_strictness() -> None:
    o = BackendOptions.from_extra_config({"backend_name": "kvtier", "interface_v1": 1, "disk_bytes": "1GiB"}, environ={})
    assert (o.store.gpu_bytes, o.store.cpu_bytes, o.store.disk_bytes) == (0, 256 << 20, 1 << 30)
    assert o.store.write_policy == "write_through" and o.model_id is None and o.model_revision == ""
    assert BackendOptions.from_extra_config({}, environ={"KVTIER_CPU_BYTES": "8MiB"}).store.cpu_bytes == 8 << 20
    with pytest.raises(ValueError, match=r"unknown kvtier keys \['disk_byte'\]"):
        BackendOptions.from_extra_config({"disk_byte": "1GiB"}, environ={})
    for key, value in (("block_size", 16), ("gpu_bytes", 1), ("hash_name", "xxh3_128")):
        with pytest.raises(ValueError, match="expected no"):
            BackendOptions.from_extra_config({key: value}, environ={})
    with pytest.raises(ValueError, match="model_id"):
        BackendOptions.from_extra_config({"model_id": ""}, environ={})
    with pytest.raises(ValueError, match="byte size"):
        BackendOptions.from_extra_config({"cpu_bytes": "lots"}, environ={})


def test_every_field_that_changes_the_bytes_changes_the_namespace() -> None:
    base = namespace()
    variants = [
        namespace(model="m2"), namespace(revision="r2"), namespace(salt="tenant"),
        namespace(tp_rank=1, tp_size=2), namespace(tp_size=2), namespace(pp_rank=1, pp_size=2),
        namespace(attn_cp_rank=1, attn_cp_size=2), namespace(MLA),
        namespace(PageLayout("MHA", "layer_first", 2, 4, 2, 8, torch.bfloat16)),
        namespace(PageLayout("MHA", "layer_first", 2, 8, 2, 8, torch.float32)),
        namespace(PageLayout("MHA", "layer_first", 3, 4, 2, 8, torch.float32)),
        namespace(PageLayout("MHA", "layer_first", 2, 4, 1, 16, torch.float32)),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # the host layout is normalised away: engines with different --hicache-mem-layout share pages
    assert namespace(PageLayout("MHA", "page_head", 2, 4, 2, 8, torch.float32)) == base
    # MLA pages are the same on every TP rank
    assert namespace(MLA, tp_rank=3, tp_size=4) == namespace(MLA)


def test_block_hashes_are_stable_namespaced_and_checked() -> None:
    ns_a, ns_b = namespace(), namespace(model="other")
    a = block_hashes(ns_a, [KEY, "b" * 64])
    assert a == block_hashes(ns_a, [KEY, "b" * 64]) and all(len(h) == 32 for h in a) and a[0] != a[1]
    assert block_hashes(ns_b, [KEY]) != a[:1]
    for bad in (b"bytes", None, "", "x" * 1025):
        with pytest.raises(ValueError, match="page keys"):
            block_hashes(ns_a, [bad])


def host(layout="layer_first", kv_shape=(2, 2, 16, 2, 8), is_mla=False, **attrs):
    base = dict(layout=layout, page_size=4, layer_num=2, kv_buffer=torch.zeros(kv_shape))
    base.update(dict(kv_cache_dim=kv_shape[-1]) if is_mla else dict(head_num=2, head_dim=8, v_head_dim=8))
    return SimpleNamespace(**{**base, **attrs})


def test_layout_checks_refuse_what_cannot_be_served_exactly() -> None:
    assert page_layout_for(host(), is_mla=False) == MHA
    assert page_layout_for(host(kv_shape=(2, 16, 1, 24), is_mla=True), is_mla=True) == MLA
    with pytest.raises(ValueError, match="host layouts"):
        page_layout_for(host(layout="page_head"), is_mla=True)
    with pytest.raises(ValueError, match="even MLA"):
        page_layout_for(host(kv_shape=(2, 16, 1, 23), is_mla=True), is_mla=True)
    with pytest.raises(ValueError, match="v_head_dim"):
        page_layout_for(host(v_head_dim=4), is_mla=False)
    with pytest.raises(ValueError, match="whose page is"):
        page_layout_for(host(kv_shape=(2, 2, 16, 3, 8)), is_mla=False)
    with pytest.raises(ValueError, match="whose page is"):
        page_layout_for(host(kv_shape=(2, 64)), is_mla=False)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        page_layout_for(host(kv_buffer=torch.zeros(2, 16, 2, 2, 8).transpose(1, 2)), is_mla=False)
    with pytest.raises(ValueError, match="dtype"):
        page_layout_for(host(kv_buffer=torch.zeros((2, 2, 16, 2, 8), dtype=torch.int32)), is_mla=False)


def test_mla_page_is_stored_as_the_same_bytes() -> None:
    block = torch.arange(MLA.spec.block_numel, dtype=torch.float32).reshape(MLA.spec.block_shape)
    page = MLA.block(block)
    assert page.shape == (2, 4, 1, 24) and page.data_ptr() == block.data_ptr()
    assert torch.equal(page.reshape(-1), block.reshape(-1))
