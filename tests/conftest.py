"""Shared factories: tiny specs and stores (CPU-first; one head, small head_dim)."""

from __future__ import annotations

import lmdb
import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.hashing import KeyContext, block_hashes_for
from kvtier.records import ReadStatus
from kvtier.testing.remote import MemoryRemote as _MemoryRemote
from kvtier.store import TieredStore
from kvtier.tiers.disk import record_footprint
from kvtier.types import KVSpec

BLOCK_SIZE = 4
NS = KeyContext(model_id="test-model", block_size=BLOCK_SIZE).namespace()  # the `namespace` fixture's


def tiny_spec(block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32) -> KVSpec:
    return KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=block_size, dtype=dtype)


def random_blocks(spec: KVSpec, n: int, seed: int = 0) -> torch.Tensor:
    """``[n, *spec.block_shape]`` random (never zero) blocks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *spec.block_shape), generator=g).to(spec.dtype)


def filled_pool(n: int, spec: KVSpec | None = None, seed: int = 0):
    """A CPU BlockPool of ``n`` slots holding :func:`random_blocks` (its slots are what DISK
    writes frame: a page before slot 0)."""
    from kvtier.tiers.pool import BlockPool
    from kvtier.types import Medium

    spec = spec or tiny_spec()
    pool = BlockPool(Medium.CPU, spec, n * spec.block_nbytes)
    pool.tensor.copy_(random_blocks(spec, n, seed=seed))
    return pool


def map_full_at(monkeypatch, n: int) -> list[bytes]:
    """Make the ``n``-th DISK record put (``kvtier.tiers.disk.put_record``) raise
    ``lmdb.MapFullError``; returns the keys put so far (the failing one included)."""
    from kvtier.tiers import disk

    real, puts = disk.put_record, []

    def flaky(txn, key, *a, **k):
        puts.append(key)
        if len(puts) == n:
            raise lmdb.MapFullError("injected")
        return real(txn, key, *a, **k)

    monkeypatch.setattr(disk, "put_record", flaky)
    return puts


def chain(n_blocks: int, spec: KVSpec, namespace: bytes, start: int = 0) -> list:
    tokens = list(range(start, start + n_blocks * spec.block_size))
    return block_hashes_for(tokens, namespace, spec.block_size)


def config_in_blocks(data_dir, gpu=4, cpu=0, disk=0, spec: KVSpec | None = None, **kwargs) -> StoreConfig:
    """A StoreConfig with capacities counted in blocks of ``spec`` (DISK: in record footprints)."""
    spec = spec or tiny_spec()
    return StoreConfig(
        gpu_bytes=gpu * spec.block_nbytes,
        cpu_bytes=cpu * spec.block_nbytes,
        disk_bytes=disk * record_footprint(spec.block_nbytes),
        block_size=spec.block_size,
        data_dir=data_dir,
        **kwargs,
    )


@pytest.fixture(scope="module")
def llama():
    """A tiny random-weight Llama (2 layers, 2 K/V heads, head_dim 16), seeded."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture
def namespace() -> bytes:
    return NS


@pytest.fixture
def make_store(tmp_path, namespace):
    """``make_store(gpu_blocks=, cpu_blocks=, disk_blocks=, **config)`` -> TieredStore with
    capacities counted in blocks; closed at teardown."""
    stores: list[TieredStore] = []

    def factory(gpu_blocks=4, cpu_blocks=0, disk_blocks=0, spec=None, data_dir=None, remote=None, **kwargs):
        spec = spec or tiny_spec()
        config = config_in_blocks(data_dir or tmp_path / "kvtier", gpu_blocks, cpu_blocks, disk_blocks, spec, **kwargs)
        store = TieredStore(spec, config, namespace, device="cpu", remote=remote, emulate_gpu=True)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


@pytest.fixture(params=["serial", "overlap"])
def write_overlap(request, monkeypatch):
    """Run a test with DISK writes on one thread and again overlapped with the tier's writer
    thread (kvtier.tiers.disk._WriteOverlap, which real blocks of >= 640 KiB take and the tiny
    test blocks do not): modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    from kvtier.tiers import disk

    monkeypatch.setattr(disk, "OVERLAP_MIN_NBYTES", 1 << 62 if request.param == "serial" else 0)
    return request.param


def open_store(data_dir, gpu=4, cpu=0, disk=0, spec: KVSpec | None = None, **kwargs) -> TieredStore:
    """A TieredStore under namespace ``NS`` with capacities counted in blocks (the GPU pool
    emulated in host memory); the caller closes it (or registers it with ``opened``)."""
    spec = spec or tiny_spec()
    return TieredStore(spec, config_in_blocks(data_dir, gpu, cpu, disk, spec, **kwargs), NS, device="cpu",
                       emulate_gpu=True)


@pytest.fixture
def opened():
    """``opened(store)`` registers a store to close at teardown; a close that raises (a bug
    can leave a store broken) is ignored there, the test itself says what it expects."""
    stores: list[TieredStore] = []
    yield lambda store: stores.append(store) or store
    for store in stores:
        try:
            store.close()
        except Exception:  # noqa: BLE001 - teardown of a store a bug left broken
            pass


def read_back(store: TieredStore, hashes) -> tuple[int, torch.Tensor]:
    """Load ``hashes``; the number of blocks loaded and a copy of their bytes ``[n, *block_shape]``."""
    result = store.load(hashes)
    with result.lease:
        ids = torch.tensor(result.block_ids, dtype=torch.long)
        return len(result.block_ids), store.top.tensor[ids].clone()


def stored_then_reopened(opened, data_dir, n, seed=0, edit=None, **reopen):
    """Store ``n`` blocks of the tiny spec, close (they go to DISK), optionally ``edit(txn,
    hashes)`` the LMDB environment behind kvtier's back, reopen. Returns (store, hashes, blocks)."""
    spec = tiny_spec()
    first = open_store(data_dir, gpu=max(4, n), disk=4 * n)
    hashes = chain(n, spec, NS, start=1000 * seed)
    blocks = random_blocks(spec, n, seed=seed)
    assert first.store(hashes, blocks) == n
    first.close()
    if edit is not None:
        env = lmdb.open(str(data_dir / "disk"), map_size=1 << 30)
        with env.begin(write=True) as txn:
            edit(txn, hashes)
        env.close()
    store = opened(open_store(data_dir, **{"gpu": max(4, n), "disk": 4 * n, **reopen}))
    return store, hashes, blocks


def patch_record(txn, key: bytes, fn) -> None:
    """Replace the LMDB value under ``key`` by ``fn(bytearray(value))``."""
    value = bytearray(txn.get(key))
    txn.put(key, bytes(fn(value)))


def flip_byte(offset: int, mask: int = 0xFF):
    """A ``patch_record`` edit: XOR byte ``offset`` of a record with ``mask``."""
    return lambda v: v[:offset] + bytes([v[offset] ^ mask]) + v[offset + 1 :]


class MemoryRemote(_MemoryRemote):
    """kvtier.testing's in-memory REMOTE backend, plus ``down = True``: every call fails the
    way an unreachable daemon does (misses, ``errors["unavailable"]`` counted)."""

    down = False

    def lookup(self, namespace, block_hashes) -> int:
        if self.down:
            self.errors["unavailable"] += 1
            return 0
        return super().lookup(namespace, block_hashes)

    def get_into(self, namespace, block_hashes, outs, fingerprints=None):
        if self.down:
            self.errors["unavailable"] += 1
            return [ReadStatus.UNAVAILABLE] * len(block_hashes)
        return super().get_into(namespace, block_hashes, outs, fingerprints)

    def put(self, namespace, block_hashes, blocks, fingerprints=None):
        if self.down:
            self.errors["unavailable"] += 1
            return [False] * len(block_hashes)
        return super().put(namespace, block_hashes, blocks, fingerprints)


def receive_puts(monkeypatch, every: bool) -> None:
    """Every put body, whatever its size and block size, received straight from the socket
    (``every``: kvtier.server.streams.BodyReceiver), or none (aiohttp's reads). In-process
    daemons only (make_api, thread_daemon, secure_daemon)."""
    from kvtier.server import streams

    monkeypatch.setattr(streams, "RECEIVE_MIN_NBYTES", 0 if every else 1 << 62)
    monkeypatch.setattr(streams, "RECEIVE_MIN_BLOCK_NBYTES", 0)


@pytest.fixture(params=["aiohttp reads", "receiver"])
def put_reads(request, monkeypatch) -> str:
    """Each put body read through aiohttp, then received from the socket (:func:`receive_puts`)."""
    receive_puts(monkeypatch, request.param == "receiver")
    return request.param
