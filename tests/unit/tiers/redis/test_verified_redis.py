"""Verified hits on Redis (issue 11, item 5): a value of other tokens or of another record
version is a miss, counted, and stays (intact: Redis's eviction ages it out)."""

from __future__ import annotations

import torch

from kvtier.hashing import block_keys_for
from kvtier.records import ReadStatus
from kvtier.store import TieredStore
from kvtier.tiers.redis import RedisTier
from kvtier.types import Medium
from tests.conftest import config_in_blocks, random_blocks, tiny_spec
from tests.unit.store.test_verified_hits import legacy_record

NS = bytes(range(32))
SPEC = tiny_spec()
HASHES, FPS = block_keys_for(list(range(100, 100 + 4 * SPEC.block_size)), NS, SPEC.block_size)
_, OTHER_FPS = block_keys_for(list(range(900, 900 + 4 * SPEC.block_size)), NS, SPEC.block_size)
OK, MISSING = ReadStatus.OK, ReadStatus.MISSING


def tier(url: str) -> RedisTier:
    t = RedisTier(url)
    t.register(NS, SPEC)
    return t


def outs(n: int = 4) -> list[torch.Tensor]:
    return list(torch.full((n, *SPEC.block_shape), float("nan")))


def test_a_value_of_other_tokens_is_token_mismatch_and_stays(redis_server):
    t = tier(redis_server.url)
    blocks = random_blocks(SPEC, 4)
    try:
        assert t.put(NS, HASHES, list(blocks), FPS[:2] + OTHER_FPS[2:]) == [True] * 4
        assert t.get_into(NS, HASHES, outs(), FPS) == [OK, OK, ReadStatus.TOKEN_MISMATCH, MISSING]
        assert t.errors["token_mismatch"] == 1 and t.errors["corrupt"] == 0
        got = outs()
        assert t.get_into(NS, HASHES, got, FPS[:2] + OTHER_FPS[2:]) == [OK] * 4  # not deleted: its own tokens hit
        assert torch.equal(torch.stack(got), blocks)
    finally:
        t.close()


def test_an_old_version_value_is_a_miss_and_is_not_deleted(redis_server):
    t = tier(redis_server.url)
    client = redis_server.client()
    try:
        key = RedisTier._key(NS, HASHES[0])
        client.set(key, legacy_record(NS, random_blocks(SPEC, 1)[0]))
        assert t.get_into(NS, HASHES[:1], outs(1), FPS[:1]) == [ReadStatus.OTHER_VERSION]
        assert t.errors["other_version"] == 1 and client.exists(key) == 1
    finally:
        client.close()
        t.close()


def test_a_store_over_redis_counts_token_mismatch(redis_server, tmp_path):
    blocks = random_blocks(SPEC, 4)
    forger = tier(redis_server.url)
    forger.put(NS, HASHES, list(blocks), FPS[:1] + OTHER_FPS[1:])
    forger.close()
    config = config_in_blocks(tmp_path, gpu=8, num_io_threads=1)
    with TieredStore(SPEC, config, NS, device="cpu", remote=tier(redis_server.url)) as store:
        result = store.load(HASHES, fingerprints=FPS)
        with result.lease:
            assert result.sources == [Medium.REMOTE]
            assert torch.equal(store.top.tensor[result.block_ids[0]], blocks[0])
        assert store.stats.load_failures_by_tier[("REMOTE", "token_mismatch")] == 1
        store.remote.close()
