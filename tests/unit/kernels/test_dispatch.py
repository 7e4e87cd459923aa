"""The public layer of kvtier.kernels: backend choice (KVTIER_KERNELS) and input validation."""

from __future__ import annotations

import pytest
import torch
from tests.unit.kernels.kernel_cases import (
    BLOCK_IDS,
    PAGED_BLOCK_IDS,
    SPECS,
    assert_same,
    ids,
    make_hf_caches,
    make_paged_caches,
    make_pool,
    make_staging,
    num_written,
)

import kvtier.kernels as kernels

SPEC = SPECS[1]  # block_size 1, 3 heads, head_dim 80, fp16, strided pool
N = len(BLOCK_IDS)


@pytest.fixture
def pool() -> torch.Tensor:
    return make_pool(SPEC, "cpu")


# --- backend choice --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["torch", "auto"])
def test_cpu_tensors_use_torch_unless_triton_forced(
    monkeypatch: pytest.MonkeyPatch, pool: torch.Tensor, mode: str
) -> None:
    monkeypatch.setenv("KVTIER_KERNELS", mode)
    assert kernels.use_triton(pool) is False


def test_default_mode_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_KERNELS", raising=False)
    assert kernels.kernel_mode() == "auto"


def test_unknown_mode_raises(monkeypatch: pytest.MonkeyPatch, pool: torch.Tensor) -> None:
    monkeypatch.setenv("KVTIER_KERNELS", "cuda")
    with pytest.raises(ValueError, match="expected KVTIER_KERNELS in"):
        kernels.use_triton(pool)


def test_forced_triton_on_cpu_runs_interpreter_kernels(monkeypatch: pytest.MonkeyPatch, pool: torch.Tensor) -> None:
    triton_kv = pytest.importorskip("kvtier.kernels.triton_kv")
    if not triton_kv.INTERPRETED:
        pytest.skip("kernels are compiled: CPU tensors cannot use them")
    monkeypatch.setenv("KVTIER_KERNELS", "triton")
    assert kernels.use_triton(pool) is True
    staging = make_staging(SPEC, N, "cpu", poisoned=True)
    kernels.pack_blocks(pool, ids(BLOCK_IDS, "cpu"), staging)
    assert_same([staging], [pool[BLOCK_IDS]])


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_public_functions_agree_across_modes(monkeypatch: pytest.MonkeyPatch, pool: torch.Tensor, mode: str) -> None:
    monkeypatch.setenv("KVTIER_KERNELS", mode)
    block_ids, paged_ids = ids(BLOCK_IDS, "cpu"), ids(PAGED_BLOCK_IDS, "cpu")
    keys, values = kernels.gather_blocks_to_layers(pool, block_ids)
    for layer in range(SPEC.num_layers):  # [1, H, n * block_size, D], block i at tokens i * block_size
        for kv, caches in enumerate((keys, values)):
            expected = pool[BLOCK_IDS, layer, kv].flatten(0, 1).transpose(0, 1).unsqueeze(0)
            assert_same([caches[layer]], [expected])
    hf_keys, hf_values, _ = make_hf_caches(SPEC, N * SPEC.block_size + 1, "cpu", poisoned=True)
    kernels.gather_blocks_to_contiguous(pool, block_ids, hf_keys, hf_values, start_token=1)
    paged_keys, paged_values, _ = make_paged_caches(SPEC, "cpu", poisoned=True)
    kernels.gather_blocks_to_paged(pool, block_ids, paged_keys, paged_values, paged_ids)
    for write_back in (
        lambda p: kernels.scatter_contiguous_to_blocks(hf_keys, hf_values, p, block_ids, start_token=1),
        lambda p: kernels.scatter_paged_to_blocks(paged_keys, paged_values, paged_ids, p, block_ids),
    ):
        back = make_pool(SPEC, "cpu", poisoned=True)
        write_back(back)
        assert_same([back[BLOCK_IDS]], [pool[BLOCK_IDS]])
        assert num_written([back]) == N * SPEC.block_shape[0] * 2 * SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim


def test_empty_block_ids_are_a_no_op(pool: torch.Tensor) -> None:
    staging = make_staging(SPEC, 0, "cpu", poisoned=True)
    kernels.pack_blocks(pool, ids([], "cpu"), staging)
    keys, values = kernels.gather_blocks_to_layers(pool, ids([], "cpu"))
    assert keys[0].shape == (1, SPEC.num_kv_heads, 0, SPEC.head_dim)


# --- validation ------------------------------------------------------------------------------


def _staging(n: int = N) -> torch.Tensor:
    return make_staging(SPEC, n, "cpu", poisoned=True)


@pytest.mark.parametrize(
    ("block_ids", "message"),
    [
        (torch.tensor(BLOCK_IDS, dtype=torch.int32), "block_ids of dtype torch.int64"),
        (torch.tensor([BLOCK_IDS]), "block_ids to be 1-D"),
        ([5, 0, 3], "block_ids to be a torch.Tensor"),
        (torch.tensor([5, 0, 7]), r"block_ids in \[0, 7\)"),
        (torch.tensor([5, -1, 3]), r"block_ids in \[0, 7\)"),
    ],
)
def test_bad_block_ids_raise(pool: torch.Tensor, block_ids: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"expected {message}"):
        kernels.pack_blocks(pool, block_ids, _staging())  # type: ignore[arg-type]


def test_repeated_destination_ids_raise(pool: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="expected distinct block_ids"):
        kernels.unpack_blocks(_staging(), pool, torch.tensor([5, 0, 5]))
    keys, values, _ = make_paged_caches(SPEC, "cpu", poisoned=True)
    with pytest.raises(ValueError, match="expected distinct paged_block_ids"):
        kernels.gather_blocks_to_paged(pool, ids(BLOCK_IDS, "cpu"), keys, values, torch.tensor([2, 2, 0]))


def test_repeated_source_ids_are_allowed(pool: torch.Tensor) -> None:
    staging = _staging()
    kernels.pack_blocks(pool, torch.tensor([5, 5, 0]), staging)
    assert_same([staging], [pool[[5, 5, 0]]])


def test_check_ids_false_skips_value_checks_only(pool: torch.Tensor) -> None:
    kernels.unpack_blocks(_staging(), pool, torch.tensor([5, 0, 3]), check_ids=False)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        kernels.unpack_blocks(_staging(), pool, torch.tensor(BLOCK_IDS, dtype=torch.int32), check_ids=False)


def test_bad_pool_raises() -> None:
    with pytest.raises(ValueError, match=r"expected pool of shape \[num_blocks, num_layers, 2"):
        kernels.gather_blocks_to_layers(torch.randn(7, 2, 3, 1, 3, 80), ids(BLOCK_IDS, "cpu"))


def test_bad_staging_raises(pool: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"expected staging of shape \[n, \*block_shape\]"):
        kernels.pack_blocks(pool, ids(BLOCK_IDS, "cpu"), _staging(N + 1))
    with pytest.raises(ValueError, match="expected staging of the pool's dtype"):
        kernels.pack_blocks(pool, ids(BLOCK_IDS, "cpu"), _staging().float())


def test_bad_hf_caches_raise(pool: torch.Tensor) -> None:
    block_ids = ids(BLOCK_IDS, "cpu")
    keys, values, _ = make_hf_caches(SPEC, N * SPEC.block_size + 2, "cpu", poisoned=True)
    with pytest.raises(ValueError, match="expected key_caches to be a sequence of num_layers=2"):
        kernels.gather_blocks_to_contiguous(pool, block_ids, keys[:1], values)
    too_short = r"expected key_caches\[0\] of shape \[1, 3, seq_len >= 6, 80\], got shape \(1, 3, 5, 80\)"
    with pytest.raises(ValueError, match=too_short):
        kernels.gather_blocks_to_contiguous(pool, block_ids, keys, values, start_token=3)
    with pytest.raises(ValueError, match="expected start_token to be an int >= 0"):
        kernels.scatter_contiguous_to_blocks(keys, values, pool, block_ids, start_token=-1)
    with pytest.raises(ValueError, match=r"expected key_caches\[0\] of the pool's dtype"):
        kernels.gather_blocks_to_contiguous(pool, block_ids, [k.float() for k in keys], values)
    with pytest.raises(ValueError, match=r"expected key_caches\[0\] of shape"):
        kernels.gather_blocks_to_contiguous(pool, block_ids, [k.transpose(1, 2) for k in keys], values)


def test_bad_paged_caches_raise(pool: torch.Tensor) -> None:
    block_ids, paged_ids = ids(BLOCK_IDS, "cpu"), ids(PAGED_BLOCK_IDS, "cpu")
    keys, values, _ = make_paged_caches(SPEC, "cpu", poisoned=True)
    with pytest.raises(ValueError, match="expected paged_block_ids as long as block_ids"):
        kernels.scatter_paged_to_blocks(keys, values, paged_ids[:2], pool, block_ids)
    with pytest.raises(ValueError, match=r"expected paged_block_ids in \[0, 6\)"):
        kernels.scatter_paged_to_blocks(keys, values, torch.tensor([2, 6, 0]), pool, block_ids)
    fewer_blocks = r"expected value_caches\[1\] of shape .* with num_paged_blocks=6 as in key_caches\[0\]"
    with pytest.raises(ValueError, match=fewer_blocks):
        kernels.gather_blocks_to_paged(pool, block_ids, keys, [values[0], values[1][:5]], paged_ids)
    with pytest.raises(ValueError, match=r"expected key_caches\[0\] of shape \[num_paged_blocks, 1, 3, 80\]"):
        kernels.gather_blocks_to_paged(pool, block_ids, [k.transpose(1, 2) for k in keys], values, paged_ids)
    with pytest.raises(ValueError, match="expected value_caches to be a sequence of num_layers=2"):
        kernels.scatter_paged_to_blocks(keys, values[:1], paged_ids, pool, block_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_block_ids_on_another_device_raise() -> None:
    pool = make_pool(SPEC, "cuda")
    with pytest.raises(ValueError, match="expected block_ids on cuda"):
        kernels.pack_blocks(pool, ids(BLOCK_IDS, "cpu"), make_staging(SPEC, N, "cuda", poisoned=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_auto_mode_uses_triton_for_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    triton_kv = pytest.importorskip("kvtier.kernels.triton_kv")
    monkeypatch.delenv("KVTIER_KERNELS", raising=False)
    pool = make_pool(SPEC, "cuda")
    assert kernels.use_triton(pool) is (not triton_kv.INTERPRETED)
    assert kernels.use_triton(pool.cpu()) is False
