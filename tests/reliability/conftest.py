"""Shared pieces of the reliability tests: a tiny spec, content that is a function of the
block hash (so any block served can be checked against what must have been stored), stores
with capacities in blocks, and the hypothesis profiles.

Profiles: ``kvtier-ci`` (default; bounded for CI) and ``kvtier-long`` (many more examples and
steps, for manual runs)::

    pytest tests/reliability --hypothesis-profile=kvtier-long
    KVTIER_HYPOTHESIS_PROFILE=kvtier-long pytest tests/reliability   # same, from any directory

(``--hypothesis-profile`` needs this conftest loaded before pytest configures hypothesis:
pass ``tests/reliability`` or a file in it, or use the environment variable.)
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from kvtier.config import StoreConfig
from kvtier.hashing import KeyContext
from kvtier.store import TieredStore
from kvtier.types import BlockHash, KVSpec

from tests.conftest import config_in_blocks  # noqa: E402

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)  # 64-byte blocks
NS = KeyContext(model_id="reliability", block_size=SPEC.block_size).namespace()

settings.register_profile(
    "kvtier-ci", max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "kvtier-long", max_examples=3000, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def reliability_settings() -> settings:
    """The kvtier-long profile when it was loaded (``--hypothesis-profile``) or named in
    ``KVTIER_HYPOTHESIS_PROFILE``; kvtier-ci otherwise (other tests keep their own)."""
    name = os.environ.get("KVTIER_HYPOTHESIS_PROFILE") or settings.get_current_profile_name()
    return settings.get_profile("kvtier-long" if name == "kvtier-long" else "kvtier-ci")


_CONTENT: dict[tuple[bytes, KVSpec], torch.Tensor] = {}


def content(block_hash: BlockHash, spec: KVSpec = SPEC) -> torch.Tensor:
    """The one block ever stored under ``block_hash``: ``[*spec.block_shape]``, random, never
    zero, a function of the hash (so a block served for another hash never matches)."""
    key = (bytes(block_hash), spec)
    block = _CONTENT.get(key)
    if block is None:
        g = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little") & ((1 << 63) - 1))
        block = torch.randn(spec.block_shape, generator=g).to(spec.dtype) + 10.0
        _CONTENT[key] = block
    return block


def contents(block_hashes, spec: KVSpec = SPEC) -> torch.Tensor:
    """``[len(block_hashes), *spec.block_shape]``."""
    if not block_hashes:
        return torch.empty((0, *spec.block_shape), dtype=spec.dtype)
    return torch.stack([content(h, spec) for h in block_hashes])


def store_config(data_dir, gpu=2, cpu=2, disk=6, spec: KVSpec = SPEC, **kwargs) -> StoreConfig:
    """Capacities in blocks (DISK: in record footprints)."""
    return config_in_blocks(data_dir, gpu, cpu, disk, spec, **kwargs)


def open_store(data_dir, gpu=2, cpu=2, disk=6, spec: KVSpec = SPEC, namespace: bytes = NS, remote=None,
               **kwargs) -> TieredStore:
    config = store_config(data_dir, gpu, cpu, disk, spec, **kwargs)
    if remote is None:
        return TieredStore(spec, config, namespace, device="cpu", emulate_gpu=True)
    return TieredStore(spec, config, namespace, device="cpu", remote=remote, emulate_gpu=True)


def loaded_bytes(store: TieredStore, result) -> torch.Tensor:
    """Copy of the blocks a LoadResult holds in the top pool: ``[n, *block_shape]``."""
    ids = torch.tensor(result.block_ids, dtype=torch.long)
    return store.top.tensor[ids].clone()


@pytest.fixture
def stores():
    """``stores(store)`` registers a store to close at teardown (errors there are ignored:
    the test says what it expects)."""
    opened: list[TieredStore] = []
    yield lambda store: opened.append(store) or store
    for store in opened:
        try:
            store.close()
        except Exception:  # noqa: BLE001 - teardown of a store a fault left broken
            pass
