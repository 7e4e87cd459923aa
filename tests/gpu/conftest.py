"""Fixtures of the GPU ordering tests: the device, a compute stream, slow work, stores.

Every test module here carries ``pytestmark = GPU_ONLY``: marked ``gpu``, skipped without CUDA.
``KVTIER_GPU_TESTS_ON_CPU=1`` (``bench/gpu.py --device cpu`` sets it) runs them on the CPU
instead: copies are synchronous there, so that checks the tests' own steps and assertions, not
any ordering.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.hashing import KeyContext
from kvtier.store import TieredStore
from kvtier.tiers.disk import record_footprint
from kvtier.types import KVSpec

ON_CPU = os.environ.get("KVTIER_GPU_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA or ON_CPU), reason="needs CUDA (KVTIER_GPU_TESTS_ON_CPU=1 runs it on the CPU)"),
]


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(params=["default", "side"])
def compute_stream(request, device) -> Callable[[], contextlib.AbstractContextManager]:
    """``with compute_stream():`` runs the model's work on the default stream or on a
    non-default one (``torch.cuda.Stream``: non-blocking, no implicit sync with the default).
    On the CPU both are a no-op context."""
    if device.type != "cuda" or request.param == "default":
        return contextlib.nullcontext
    stream = torch.cuda.Stream(device)
    return lambda: torch.cuda.stream(stream)


@pytest.fixture(scope="session")
def slow_work(device) -> Callable[[], None]:
    """Queue ~0.5 ms of matmuls on the current stream (nothing on the CPU), so that a copy
    that does not wait for the compute stream runs before the kernel queued after them."""
    if device.type != "cuda":
        return lambda: None
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.cuda.synchronize(device)

    def slow() -> None:
        for _ in range(2):
            torch.mm(a, a, out=out)

    return slow


@pytest.fixture
def make_store(tmp_path, device) -> Iterator[Callable[..., TieredStore]]:
    """``make_store(spec, gpu_blocks=, cpu_blocks=, disk_blocks=)`` -> TieredStore with its
    GPU pool on ``device``, capacities in blocks; closed at teardown."""
    stores: list[TieredStore] = []

    def factory(spec: KVSpec, gpu_blocks: int = 0, cpu_blocks: int = 0, disk_blocks: int = 0, **kwargs) -> TieredStore:
        disk_bytes = disk_blocks * record_footprint(spec.block_nbytes) + (1 << 20) if disk_blocks else 0
        config = StoreConfig(
            gpu_bytes=gpu_blocks * spec.block_nbytes, cpu_bytes=cpu_blocks * spec.block_nbytes,
            disk_bytes=disk_bytes, block_size=spec.block_size, data_dir=tmp_path / f"kv{len(stores)}",
            flush_on_close=False, **kwargs,
        )
        namespace = KeyContext(model_id="gpu-ordering", block_size=spec.block_size).namespace()
        stores.append(TieredStore(spec, config, namespace, device=device, emulate_gpu=True))
        return stores[-1]

    yield factory
    for store in stores:
        store.close()
