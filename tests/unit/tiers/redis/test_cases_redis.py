"""Cases N4 and N5 of /work/shared/cases (fp8 through every tier; TP rank identity) with Redis
as the REMOTE tier: RedisTier's guarded connections (GETRANGE reads, call budgets) and
``TieredStore.reset`` (the namespace emptied through ``clear_namespace``) keep them true."""

from __future__ import annotations

import torch

from kvtier.hashing import KeyContext, block_hashes_for
from kvtier.store import TieredStore
from kvtier.types import KVSpec, Medium, dtype_name
from tests.conftest import config_in_blocks

FP8 = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float8_e4m3fn)


def _namespace(spec: KVSpec, **key) -> bytes:
    return KeyContext(model_id="cases", dtype=dtype_name(spec.dtype), block_size=spec.block_size, **key).namespace()


def _open(spec: KVSpec, namespace: bytes, data_dir, url: str, gpu: int = 2, disk: int = 16) -> TieredStore:
    config = config_in_blocks(data_dir, gpu=gpu, cpu=0, disk=disk, spec=spec, remote_url=url)
    return TieredStore(spec, config, namespace, device="cpu", emulate_gpu=True)


def _random_bytes(spec: KVSpec, n: int, seed: int) -> torch.Tensor:
    """``n`` blocks of random bytes (every bit pattern: NaN codes included), as ``spec.dtype``."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, spec.block_nbytes), dtype=torch.uint8, generator=g)
    return raw.view(spec.dtype).reshape(n, *spec.block_shape)


def _loads_exactly(store: TieredStore, hashes, blocks: torch.Tensor, window: int) -> list[Medium]:
    """Load ``hashes`` ``window`` at a time (the top pool's size) and compare bytes (uint8)."""
    sources: list[Medium] = []
    for start in range(0, len(hashes), window):
        part = hashes[start : start + window]
        result = store.load(part)
        assert len(result.block_ids) == len(part)
        got = store.top.tensor[torch.tensor(result.block_ids)].view(torch.uint8)
        assert torch.equal(got, blocks[start : start + window].view(torch.uint8))
        sources += result.sources
        result.lease.release()
    return sources


def test_n4_fp8_through_disk_and_redis_then_a_reset_empties_redis(redis_server, tmp_path):
    namespace = _namespace(FP8)
    hashes = block_hashes_for(list(range(6 * 16)), namespace, 16)
    blocks = _random_bytes(FP8, 6, seed=4)
    first = _open(FP8, namespace, tmp_path / "a", redis_server.url)
    assert first.store(hashes, blocks) == 6
    first.close()  # flushes to DISK; REMOTE puts are waited for

    same_disk = _open(FP8, namespace, tmp_path / "a", redis_server.url)
    assert same_disk.lookup(hashes).num_hit_blocks == 6
    assert set(_loads_exactly(same_disk, hashes, blocks, 2)) == {Medium.DISK}
    same_disk.close()

    only_remote = _open(FP8, namespace, tmp_path / "b", redis_server.url)
    assert only_remote.lookup(hashes).media == [Medium.REMOTE] * 6
    assert set(_loads_exactly(only_remote, hashes, blocks, 2)) == {Medium.REMOTE}
    # the other fp8 format is another namespace: nothing of these blocks is found under it
    assert _namespace(KVSpec(2, 2, 8, 16, torch.float8_e5m2)) != namespace

    reset = only_remote.reset()
    assert reset.remote_cleared is True and reset.dropped_blocks["REMOTE"] == 6
    only_remote.close()
    fresh = _open(FP8, namespace, tmp_path / "c", redis_server.url)
    assert fresh.lookup(hashes).num_hit_blocks == 0  # Redis holds nothing of it any more
    fresh.close()


def test_n5_tp_ranks_sharing_redis_never_see_each_others_blocks(redis_server, tmp_path):
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype=torch.float32)
    rank0, rank1 = _namespace(spec, tp_size=2, tp_rank=0), _namespace(spec, tp_size=2, tp_rank=1)
    tokens = list(range(4 * 16))
    hashes0 = block_hashes_for(tokens, rank0, 16)
    blocks = _random_bytes(spec, 4, seed=5)
    writer = _open(spec, rank0, tmp_path / "w", redis_server.url, gpu=4)
    assert writer.store(hashes0, blocks) == 4
    writer.close()

    other_rank = _open(spec, rank1, tmp_path / "r1", redis_server.url, gpu=4)
    assert other_rank.lookup(block_hashes_for(tokens, rank1, 16)).num_hit_blocks == 0
    assert other_rank.lookup(hashes0).num_hit_blocks == 0  # rank 0's own hashes: another namespace
    assert other_rank.load(hashes0).block_ids == []
    other_rank.close()

    second_engine = _open(spec, rank0, tmp_path / "e2", redis_server.url, gpu=4)
    assert second_engine.lookup(hashes0).media == [Medium.REMOTE] * 4
    assert _loads_exactly(second_engine, hashes0, blocks, 4) == [Medium.REMOTE] * 4
    second_engine.close()

    tp1 = _namespace(spec)
    single = _open(spec, tp1, tmp_path / "tp1", redis_server.url, gpu=4)
    assert single.lookup(block_hashes_for(tokens, tp1, 16)).num_hit_blocks == 0
    single.close()
