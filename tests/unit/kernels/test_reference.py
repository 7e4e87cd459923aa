"""The torch reference (the kernels' oracle) against element-by-block Python loops, through
the public functions with ``KVTIER_KERNELS=torch`` (so the block views of each layout too)."""

from __future__ import annotations

import pytest
import torch
from tests.unit.kernels.kernel_cases import (
    BLOCK_IDS,
    PAGED_BLOCK_IDS,
    SENTINEL,
    SPECS,
    Spec,
    ids,
    make_hf_caches,
    make_paged_caches,
    make_pool,
    make_staging,
)

import kvtier.kernels as kernels

specs = pytest.mark.parametrize("spec", [SPECS[1], SPECS[3]], ids=str)  # 1 and 3 heads, strided pools


@pytest.fixture(autouse=True)
def torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_KERNELS", "torch")


@specs
def test_gather_contiguous_places_block_i_at_token_start_plus_i_block_size(spec: Spec) -> None:
    start_token, bs = 4, spec.block_size
    pool = make_pool(spec, "cpu")
    keys, values, _ = make_hf_caches(spec, start_token + len(BLOCK_IDS) * bs + 2, "cpu", poisoned=True)
    kernels.gather_blocks_to_contiguous(pool, ids(BLOCK_IDS, "cpu"), keys, values, start_token)
    for layer in range(spec.num_layers):
        for kv, caches in enumerate((keys, values)):
            cache = caches[layer][0]  # [H, seq_len, D]
            for i, block_id in enumerate(BLOCK_IDS):
                tokens = cache[:, start_token + i * bs : start_token + (i + 1) * bs]
                assert torch.equal(tokens, pool[block_id, layer, kv].transpose(0, 1))
            assert (cache[:, :start_token] == SENTINEL).all()
            assert (cache[:, start_token + len(BLOCK_IDS) * bs :] == SENTINEL).all()


@specs
def test_scatter_contiguous_inverts_gather(spec: Spec) -> None:
    start_token, bs = 2, spec.block_size
    keys, values, _ = make_hf_caches(spec, start_token + len(BLOCK_IDS) * bs, "cpu", poisoned=False)
    pool = make_pool(spec, "cpu", poisoned=True)
    kernels.scatter_contiguous_to_blocks(keys, values, pool, ids(BLOCK_IDS, "cpu"), start_token)
    for i, block_id in enumerate(BLOCK_IDS):
        for layer in range(spec.num_layers):
            for kv, caches in enumerate((keys, values)):
                tokens = caches[layer][0, :, start_token + i * bs : start_token + (i + 1) * bs]
                assert torch.equal(pool[block_id, layer, kv], tokens.transpose(0, 1))
    untouched = [b for b in range(pool.shape[0]) if b not in BLOCK_IDS]
    assert (pool[untouched] == SENTINEL).all()


@specs
def test_paged_copies_match_slots(spec: Spec) -> None:
    pool = make_pool(spec, "cpu")
    keys, values, _ = make_paged_caches(spec, "cpu", poisoned=True)
    kernels.gather_blocks_to_paged(pool, ids(BLOCK_IDS, "cpu"), keys, values, ids(PAGED_BLOCK_IDS, "cpu"))
    for layer in range(spec.num_layers):
        for kv, caches in enumerate((keys, values)):
            for block_id, slot in zip(BLOCK_IDS, PAGED_BLOCK_IDS):
                assert torch.equal(caches[layer][slot], pool[block_id, layer, kv])
            others = [s for s in range(caches[layer].shape[0]) if s not in PAGED_BLOCK_IDS]
            assert (caches[layer][others] == SENTINEL).all()
    pool_back = make_pool(spec, "cpu", poisoned=True)
    kernels.scatter_paged_to_blocks(keys, values, ids(PAGED_BLOCK_IDS, "cpu"), pool_back, ids(BLOCK_IDS, "cpu"))
    assert torch.equal(pool_back[BLOCK_IDS], pool[BLOCK_IDS])


@specs
def test_pack_unpack_order(spec: Spec) -> None:
    pool = make_pool(spec, "cpu")
    staging = make_staging(spec, len(BLOCK_IDS), "cpu", poisoned=True)
    kernels.pack_blocks(pool, ids(BLOCK_IDS, "cpu"), staging)
    for i, block_id in enumerate(BLOCK_IDS):
        assert torch.equal(staging[i], pool[block_id])
    strided_staging = make_staging(spec, 2 * len(BLOCK_IDS), "cpu", poisoned=True)[::2]
    kernels.pack_blocks(pool, ids(BLOCK_IDS, "cpu"), strided_staging)
    assert torch.equal(strided_staging, staging)
    pool_back = make_pool(spec, "cpu", poisoned=True)
    kernels.unpack_blocks(staging, pool_back, ids(BLOCK_IDS, "cpu"))
    assert torch.equal(pool_back[BLOCK_IDS], pool[BLOCK_IDS])
    assert (pool_back[[b for b in range(pool.shape[0]) if b not in BLOCK_IDS]] == SENTINEL).all()


def test_gather_to_layers_shapes() -> None:
    spec = SPECS[1]
    keys, values = kernels.gather_blocks_to_layers(make_pool(spec, "cpu"), ids(BLOCK_IDS, "cpu"))
    shape = (1, spec.num_kv_heads, len(BLOCK_IDS) * spec.block_size, spec.head_dim)
    assert [t.shape for t in keys + values] == [shape] * (2 * spec.num_layers)
    assert all(t.is_contiguous() and t.dtype == spec.dtype for t in keys + values)
