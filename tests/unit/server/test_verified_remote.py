"""Verified hits through the daemon (issue 11, item 5): the daemon keeps each block's token
fingerprint (in memory, on its DISK, across restarts) and sends it with the block; the
client checks it against its own tokens, since a daemon cannot be trusted to."""

from __future__ import annotations

import lmdb
import pytest
import torch

from kvtier.hashing import block_keys_for
from kvtier.records import ReadStatus
from kvtier.server.app import REGISTRY
from kvtier.server.tenants import DEFAULT_TENANT
from kvtier.store import TieredStore
from kvtier.tiers.remote import RemoteTier
from kvtier.types import Medium
from tests.conftest import config_in_blocks, random_blocks
from tests.unit.server.conftest import NAMESPACE, SPEC
from tests.unit.store.test_verified_hits import legacy_record

OK, MISSING, MISMATCH = ReadStatus.OK, ReadStatus.MISSING, ReadStatus.TOKEN_MISMATCH
TOKENS = list(range(100, 100 + 4 * SPEC.block_size))
HASHES, FPS = block_keys_for(TOKENS, NAMESPACE, SPEC.block_size)
_, OTHER_FPS = block_keys_for(list(range(900, 900 + 4 * SPEC.block_size)), NAMESPACE, SPEC.block_size)
FORGED = FPS[:1] + OTHER_FPS[1:]  # blocks 1..3 under the right hashes, of other tokens


@pytest.fixture
def remotes():
    made: list[RemoteTier] = []

    def factory(url: str) -> RemoteTier:
        remote = RemoteTier(url, timeout_s=10.0, backoff_s=0.01, max_backoff_s=0.05)  # a loaded CI host
        remote.register(NAMESPACE, SPEC)
        made.append(remote)
        return remote

    yield factory
    for remote in made:
        remote.close()


def outs(n: int = 4) -> list[torch.Tensor]:
    return list(torch.full((n, *SPEC.block_shape), float("nan")))


def test_the_client_refuses_a_daemon_block_of_other_tokens(thread_daemon, remotes):
    daemon = thread_daemon()
    forger, client = remotes(daemon.url), remotes(daemon.url)
    blocks = random_blocks(SPEC, 4)
    assert forger.put(NAMESPACE, HASHES, list(blocks), FORGED) == [True] * 4
    got = outs()
    assert client.get_into(NAMESPACE, HASHES, got, FPS) == [OK, MISMATCH, MISSING, MISSING]
    assert torch.equal(got[0], blocks[0]) and client.errors["token_mismatch"] == 1
    # the daemon sends what it stores: the forger's own tokens are served, bit-exact
    got = outs()
    assert client.get_into(NAMESPACE, HASHES, got, FORGED) == [OK] * 4
    assert torch.equal(torch.stack(got), blocks)
    assert client.get_into(NAMESPACE, HASHES, outs()) == [OK] * 4  # unchecked: a relay's read


def test_fingerprints_survive_a_daemon_restart_on_its_disk(thread_daemon, remotes, tmp_path):
    daemon = thread_daemon()
    remotes(daemon.url).put(NAMESPACE, HASHES, list(random_blocks(SPEC, 4)), FORGED)
    daemon.stop()  # flushed to its DISK
    daemon = thread_daemon()  # the same data directory, reopened
    client = remotes(daemon.url)
    assert client.get_into(NAMESPACE, HASHES, outs(), FPS) == [OK, MISMATCH, MISSING, MISSING]
    assert client.get_into(NAMESPACE, HASHES, outs(), FORGED) == [OK] * 4


def test_a_store_loading_through_the_daemon_counts_token_mismatch(thread_daemon, remotes, tmp_path):
    daemon = thread_daemon()
    blocks = random_blocks(SPEC, 4)
    remotes(daemon.url).put(NAMESPACE, HASHES, list(blocks), FORGED)
    config = config_in_blocks(tmp_path / "engine", gpu=8, num_io_threads=1)
    with TieredStore(SPEC, config, NAMESPACE, device="cpu", remote=remotes(daemon.url)) as store:
        assert store.lookup(HASHES).num_hit_blocks == 4  # the hashes are there...
        result = store.load(HASHES, fingerprints=FPS)  # ...but only block 0 is of these tokens
        with result.lease:
            assert result.sources == [Medium.REMOTE]
            assert torch.equal(store.top.tensor[result.block_ids[0]], blocks[0])
        assert store.stats.load_failures_by_tier[("REMOTE", "token_mismatch")] == 1
        assert store.medium_of(HASHES[1]) is None
        store.check_invariants()


def test_old_version_records_on_the_daemons_disk_are_kept_and_missed(thread_daemon, remotes, tmp_path):
    daemon = thread_daemon()
    client = remotes(daemon.url)
    client.put(NAMESPACE, HASHES[:1], list(random_blocks(SPEC, 1)), FPS[:1])
    daemon.stop()
    env = lmdb.open(str(tmp_path / "data" / "tenants" / DEFAULT_TENANT / NAMESPACE.hex() / "disk"), map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put(HASHES[1], legacy_record(NAMESPACE, random_blocks(SPEC, 1)[0]))
    env.close()
    daemon = thread_daemon()
    client = remotes(daemon.url)
    assert client.lookup(NAMESPACE, HASHES) == 1  # the old record is not a hit
    disk = daemon.call(lambda: daemon.app[REGISTRY].get(DEFAULT_TENANT, NAMESPACE).store.disk)
    assert disk.foreign_bytes > 0 and len(disk) == 1  # kept: not wiped by opening it
    assert client.put(NAMESPACE, HASHES, list(random_blocks(SPEC, 4)), FPS) == [True] * 4
    assert client.get_into(NAMESPACE, HASHES, outs(), FPS) == [OK] * 4
