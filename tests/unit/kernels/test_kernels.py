"""The Triton kernels against the torch reference: bit-exact, poisoned outputs, odd strides.

Each check calls the public functions of ``kvtier.kernels`` twice, with
``KVTIER_KERNELS=triton`` and ``=torch``, so the block views they build for each layout are
exercised too. On CPU the kernels run in the Triton interpreter (conftest sets
``TRITON_INTERPRET=1``); ``TestOnCuda`` runs the same checks compiled on a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from tests.unit.kernels.kernel_cases import (
    BLOCK_IDS,
    PAGED_BLOCK_IDS,
    SMALL_SPECS,
    SPECS,
    Spec,
    assert_same,
    ids,
    make_hf_caches,
    make_paged_caches,
    make_pool,
    make_staging,
    num_written,
)

import kvtier.kernels as kernels

triton_kv = pytest.importorskip("kvtier.kernels.triton_kv")

needs_interpreter = pytest.mark.skipif(
    not triton_kv.INTERPRETED, reason="kernels are compiled (TRITON_INTERPRET unset): see TestOnCuda"
)
specs = pytest.mark.parametrize("spec", SPECS, ids=str)
small_specs = pytest.mark.parametrize("spec", SMALL_SPECS, ids=str)
MODES = ("triton", "torch")  # the kernels first, then the reference they must equal


@contextlib.contextmanager
def backend(mode: str, pool: torch.Tensor) -> Iterator[None]:
    """Run the public functions on ``mode`` (``KVTIER_KERNELS``), checking it is the one used."""
    saved = os.environ.get("KVTIER_KERNELS")
    os.environ["KVTIER_KERNELS"] = mode
    try:
        assert kernels.use_triton(pool) is (mode == "triton")
        yield
    finally:
        if saved is None:
            del os.environ["KVTIER_KERNELS"]
        else:
            os.environ["KVTIER_KERNELS"] = saved


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor a view was cut from, pad columns included."""
    return t if t._base is None else t._base


def _copied_elements(spec: Spec) -> int:
    """Elements of K and V in ``len(BLOCK_IDS)`` blocks."""
    return len(BLOCK_IDS) * spec.num_layers * 2 * spec.block_size * spec.num_kv_heads * spec.head_dim


def check_gather_contiguous(spec: Spec, device: str, start_token: int) -> None:
    pool, block_ids = make_pool(spec, device), ids(BLOCK_IDS, device)
    seq_len = start_token + len(BLOCK_IDS) * spec.block_size + 2
    outputs = []
    for mode in MODES:
        keys, values, backing = make_hf_caches(spec, seq_len, device, poisoned=True)
        with backend(mode, pool):
            kernels.gather_blocks_to_contiguous(pool, block_ids, keys, values, start_token)
        outputs.append(backing)
    assert_same(*outputs)
    assert num_written(outputs[0]) == _copied_elements(spec)


def check_scatter_contiguous(spec: Spec, device: str, start_token: int) -> None:
    seq_len = start_token + len(BLOCK_IDS) * spec.block_size + 2
    keys, values, _ = make_hf_caches(spec, seq_len, device, poisoned=False)
    block_ids = ids(BLOCK_IDS, device)
    outputs = []
    for mode in MODES:
        pool = make_pool(spec, device, poisoned=True)
        with backend(mode, pool):
            kernels.scatter_contiguous_to_blocks(keys, values, pool, block_ids, start_token)
        outputs.append([_storage(pool)])
    assert_same(*outputs)
    assert num_written(outputs[0]) == _copied_elements(spec)


def check_gather_paged(spec: Spec, device: str) -> None:
    pool, block_ids, paged_ids = make_pool(spec, device), ids(BLOCK_IDS, device), ids(PAGED_BLOCK_IDS, device)
    outputs = []
    for mode in MODES:
        keys, values, backing = make_paged_caches(spec, device, poisoned=True)
        with backend(mode, pool):
            kernels.gather_blocks_to_paged(pool, block_ids, keys, values, paged_ids)
        outputs.append(backing)
    assert_same(*outputs)
    assert num_written(outputs[0]) == _copied_elements(spec)


def check_scatter_paged(spec: Spec, device: str) -> None:
    keys, values, _ = make_paged_caches(spec, device, poisoned=False)
    block_ids, paged_ids = ids(BLOCK_IDS, device), ids(PAGED_BLOCK_IDS, device)
    outputs = []
    for mode in MODES:
        pool = make_pool(spec, device, poisoned=True)
        with backend(mode, pool):
            kernels.scatter_paged_to_blocks(keys, values, paged_ids, pool, block_ids)
        outputs.append([_storage(pool)])
    assert_same(*outputs)
    assert num_written(outputs[0]) == _copied_elements(spec)


def check_pack(spec: Spec, device: str) -> None:
    pool, block_ids = make_pool(spec, device), ids(BLOCK_IDS, device)
    outputs = []
    for mode in MODES:
        staging = make_staging(spec, len(BLOCK_IDS), device, poisoned=True)
        with backend(mode, pool):
            kernels.pack_blocks(pool, block_ids, staging)
        outputs.append([staging])
    assert_same(*outputs)
    assert num_written(outputs[0]) == _copied_elements(spec)


def check_unpack(spec: Spec, device: str) -> None:
    staging = make_staging(spec, len(BLOCK_IDS), device, poisoned=False)
    block_ids = ids(BLOCK_IDS, device)
    outputs = []
    for mode in MODES:
        pool = make_pool(spec, device, poisoned=True)
        with backend(mode, pool):
            kernels.unpack_blocks(staging, pool, block_ids)
        outputs.append([_storage(pool)])
    assert_same(*outputs)
    assert num_written(outputs[0]) == _copied_elements(spec)


def check_gather_layers(spec: Spec, device: str) -> None:
    pool, block_ids = make_pool(spec, device), ids(BLOCK_IDS, device)
    outputs = []
    for mode in MODES:
        with backend(mode, pool):
            keys, values = kernels.gather_blocks_to_layers(pool, block_ids)
        assert all(t.is_contiguous() for t in keys + values)
        outputs.append(keys + values)
    assert_same(*outputs)


def check_round_trip(spec: Spec, device: str, start_token: int) -> None:
    """HF caches -> pool -> HF caches gives back the copied tokens, through the kernels only."""
    num_tokens = len(BLOCK_IDS) * spec.block_size
    keys, values, _ = make_hf_caches(spec, start_token + num_tokens, device, poisoned=False)
    pool, block_ids = make_pool(spec, device, poisoned=True), ids(BLOCK_IDS, device)
    with backend("triton", pool):
        kernels.scatter_contiguous_to_blocks(keys, values, pool, block_ids, start_token)
        keys_back, values_back = kernels.gather_blocks_to_layers(pool, block_ids)
    expected = [t[:, :, start_token:] for t in keys + values]
    assert_same(keys_back + values_back, expected)


@needs_interpreter
class TestInterpreted:
    @specs
    @pytest.mark.parametrize("start_token", [0, 5])
    def test_gather_contiguous(self, spec: Spec, start_token: int) -> None:
        check_gather_contiguous(spec, "cpu", start_token)

    @specs
    @pytest.mark.parametrize("start_token", [0, 5])
    def test_scatter_contiguous(self, spec: Spec, start_token: int) -> None:
        check_scatter_contiguous(spec, "cpu", start_token)

    @specs
    def test_gather_paged(self, spec: Spec) -> None:
        check_gather_paged(spec, "cpu")

    @specs
    def test_scatter_paged(self, spec: Spec) -> None:
        check_scatter_paged(spec, "cpu")

    @specs
    def test_pack(self, spec: Spec) -> None:
        check_pack(spec, "cpu")

    @specs
    def test_unpack(self, spec: Spec) -> None:
        check_unpack(spec, "cpu")

    @small_specs
    def test_gather_layers(self, spec: Spec) -> None:
        check_gather_layers(spec, "cpu")

    @small_specs
    def test_round_trip(self, spec: Spec) -> None:
        check_round_trip(spec, "cpu", start_token=3)

    def test_empty_block_ids_launch_nothing(self) -> None:
        spec = SPECS[0]
        pool = make_pool(spec, "cpu", poisoned=True)
        staging = make_staging(spec, 0, "cpu", poisoned=True)
        triton_kv.unpack_blocks(staging, pool, ids([], "cpu"))
        assert num_written([pool]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(triton_kv.INTERPRETED, reason="TRITON_INTERPRET=1 cannot follow pointer tables into device memory")
class TestOnCuda:
    @specs
    def test_contiguous(self, spec: Spec) -> None:
        for start_token in (0, 5):
            check_gather_contiguous(spec, "cuda", start_token)
            check_scatter_contiguous(spec, "cuda", start_token)

    @specs
    def test_paged(self, spec: Spec) -> None:
        check_gather_paged(spec, "cuda")
        check_scatter_paged(spec, "cuda")

    @specs
    def test_staging(self, spec: Spec) -> None:
        check_pack(spec, "cuda")
        check_unpack(spec, "cuda")

    @small_specs
    def test_layers_and_round_trip(self, spec: Spec) -> None:
        check_gather_layers(spec, "cuda")
        check_round_trip(spec, "cuda", start_token=3)

    def test_offsets_past_int32(self) -> None:
        """The last block starts past 2**31 elements: int32 offset arithmetic would wrap."""
        spec = Spec(16, 8, 128, torch.float16, num_layers=1)
        block_numel = 2 * spec.block_size * spec.num_kv_heads * spec.head_dim
        num_blocks = 2**31 // block_numel + 2  # 4 GiB of fp16, left uninitialised
        pool = torch.empty(num_blocks, *spec.block_shape, dtype=spec.dtype, device="cuda")
        far = [num_blocks - 1, 0]
        pool[far] = torch.randn(len(far), *spec.block_shape, device="cuda").to(spec.dtype)
        staging = make_staging(spec, len(far), "cuda", poisoned=True)
        triton_kv.pack_blocks(pool, ids(far, "cuda"), staging)
        assert_same([staging], [pool[far]])
        pool[far] = 0
        triton_kv.unpack_blocks(staging, pool, ids(far, "cuda"))
        assert_same([pool[far]], [staging])
