"""Factories for the SGLang backend tests: SGLang's own storage config, host pools with SGLang's
own page methods (tests/sglang/sglang_source.py), the backend created by SGLang's factory.

Nothing here imports SGLang at collection time: without it (the project venv) the tests that
need it skip; `.ci/sglang-tests` runs them in a venv that has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

PAGE_SIZE = 4
NUM_LAYERS = 2
BACKEND_CONFIG = {"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage"}


def storage_config(data_dir: Path | str, *, is_mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   model_name: str = "org/model", **extra: Any):
    """SGLang's ``HiCacheStorageConfig`` as its controller builds it for a dynamic backend."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    extra_config = {**BACKEND_CONFIG, "interface_v1": 1, "data_dir": str(data_dir), "cpu_bytes": "1MiB",
                    "disk_bytes": "64MiB", "num_io_threads": 1, **extra}
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model_name, extra_config=extra_config,
    )


def new_host_pool(kind: str = "MHA", layout: str = "layer_first", num_pages: int = 16,
                  dtype: torch.dtype = torch.float32, **geometry: Any):
    """A host pool with SGLang's own layout code, every element NaN (a page never written
    shows up as NaN, never as plausible zeros)."""
    from tests.sglang.sglang_source import host_pool

    pool = host_pool(kind, layout, num_pages=num_pages, page_size=PAGE_SIZE, num_layers=NUM_LAYERS, dtype=dtype,
                     **geometry)
    pool.kv_buffer.fill_(float("nan"))
    return pool


def fill_random(pool, host_indices: torch.Tensor, seed: int) -> None:
    """Random (never zero) values in the pages at ``host_indices``, through SGLang's own
    ``set_from_flat_data_page``."""
    g = torch.Generator().manual_seed(seed)
    ps = pool.page_size
    for start in host_indices.reshape(-1)[::ps].tolist():
        numel = pool.get_dummy_flat_data_page().numel()
        pool.set_from_flat_data_page(start, (torch.rand(numel, generator=g) + 0.5).to(pool.dtype))


def pages(pool, host_indices: torch.Tensor) -> list[torch.Tensor]:
    """The pages at ``host_indices``, as SGLang's own ``get_data_page`` reads them (copies)."""
    return [pool.get_data_page(s, flat=True).clone() for s in host_indices.reshape(-1)[:: pool.page_size].tolist()]


def page_keys(num_pages: int, start: int = 0) -> list[str]:
    """SGLang's own page keys (``get_hash_str``) of ``num_pages`` pages of token ids."""
    from sglang.srt.mem_cache.utils import get_hash_str

    return get_hash_str(list(range(start, start + num_pages * PAGE_SIZE)), None, page_size=PAGE_SIZE)


@pytest.fixture
def make_backend(tmp_path):
    """``make_backend(host_pool, data_dir=None, **config_kwargs)`` -> the backend, created by
    SGLang's ``StorageBackendFactory`` and attached as its controller does; closed at teardown."""
    backends = []

    def factory(host, data_dir: Path | None = None, **kwargs: Any):
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        config = storage_config(data_dir or tmp_path / "kvtier", **kwargs)
        backend = StorageBackendFactory.create_backend("dynamic", config, host)
        backends.append(backend)
        backend.register_mem_pool_host(host)
        backend.on_host_pools_registered()
        return backend

    yield factory
    for backend in backends:
        backend.close()
