"""Tenants and keys at the store level (guarantee 6; cases K1-K3).

A tenant's ``cache_salt`` (like a LoRA adapter) is part of the namespace every block hash is
rooted in (kvtier.hashing), so identical tokens give unrelated hashes: no tier can hit across
tenants, and the REMOTE tier keys records by ``(namespace, block_hash)``. A tenant that somehow
learns another tenant's exact hashes still gets no bytes from a store opened with its own
namespace: every DISK and REMOTE record carries its namespace, checked on read. Hash-level
properties (any two differing key contexts give different hashes; stable across processes)
are in tests/unit/test_hashing.py.
"""

from __future__ import annotations

import torch

from kvtier.hashing import KeyContext, block_hashes_for
from kvtier.testing import MemoryRemote
from kvtier.types import Medium
from tests.reliability.conftest import SPEC, contents, loaded_bytes, open_store

TOKENS = list(range(64 * SPEC.block_size))[: 16 * SPEC.block_size]  # 16 blocks


def _namespace(**fields) -> bytes:
    return KeyContext(model_id="reliability", block_size=SPEC.block_size, **fields).namespace()


def _hashes(namespace: bytes) -> list[bytes]:
    return block_hashes_for(TOKENS, namespace, SPEC.block_size)


def test_identical_tokens_of_two_tenants_never_hit_each_other_in_any_tier(tmp_path, stores):
    """One engine, one store, many tenants: tenant a's blocks fill GPU, CPU, DISK and REMOTE;
    tenant b (and no salt, and an empty salt) with the same tokens hit nothing, before and
    after a restart and from another process's store sharing the REMOTE tier."""
    remote = MemoryRemote()
    store = stores(open_store(tmp_path / "one", gpu=2, cpu=2, disk=16, remote=remote))
    tenants = {"a": _namespace(cache_salt="a"), "b": _namespace(cache_salt="b"), None: _namespace(),
               "": _namespace(cache_salt="")}
    ours = _hashes(tenants["a"])
    assert store.store(ours, contents(ours)) == len(ours)
    store.wait_for_writes()
    assert {str(m) for m in store.lookup(ours).media} >= {"GPU", "CPU", "DISK"}
    others = [_hashes(ns) for salt, ns in tenants.items() if salt != "a"]
    assert all(store.lookup(h).num_hit_blocks == 0 for h in others)
    store.close()
    reopened = stores(open_store(tmp_path / "one", gpu=2, cpu=2, disk=16, remote=remote))
    elsewhere = stores(open_store(tmp_path / "two", gpu=2, cpu=2, disk=16, remote=remote))
    assert elsewhere.lookup(ours).media == [Medium.REMOTE] * len(ours)
    for s in (reopened, elsewhere):
        assert all(s.lookup(h).num_hit_blocks == 0 and s.load(h).block_ids == [] for h in others)
        result = s.load(ours[:2])
        assert torch.equal(loaded_bytes(s, result), contents(ours[:2]))
        result.lease.release()


def test_a_tenant_that_knows_another_tenants_hashes_gets_no_bytes(tmp_path, stores):
    """Stores opened with tenant b's namespace on tenant a's data directory and REMOTE tier
    ask for a's exact block hashes: the records' namespace does not match, so nothing is
    served (a DISK record that fails the check is a counted miss)."""
    remote = MemoryRemote()
    ns_a, ns_b = _namespace(cache_salt="a"), _namespace(cache_salt="b")
    stolen = _hashes(ns_a)[:4]
    a = open_store(tmp_path / "a", gpu=4, cpu=0, disk=8, namespace=ns_a, remote=remote)
    a.store(stolen, contents(stolen))
    a.close()  # flushed to DISK, put to REMOTE
    b_disk = stores(open_store(tmp_path / "a", gpu=4, cpu=0, disk=8, namespace=ns_b))
    assert b_disk.load(stolen).block_ids == []
    assert b_disk.stats.load_failures["corrupt"] >= 1
    b_remote = stores(open_store(tmp_path / "b", gpu=4, cpu=0, disk=8, namespace=ns_b, remote=remote))
    assert b_remote.lookup(stolen).num_hit_blocks == 0 and b_remote.load(stolen).block_ids == []


def test_lora_name_and_cache_salt_of_the_same_value_do_not_share_blocks_regression_k2(tmp_path, stores):
    store = stores(open_store(tmp_path, gpu=16, cpu=0, disk=0))
    lora = _hashes(_namespace(lora_name="x"))
    store.store(lora, contents(lora))
    assert store.lookup(_hashes(_namespace(cache_salt="x"))).num_hit_blocks == 0
    assert store.lookup(lora).num_hit_blocks == len(lora)


def test_reopen_with_other_threads_policy_and_sizes_still_hits_regression_k3(tmp_path, stores):
    """K3: what does not change the K/V bytes is not in a key (pool sizes are in
    tests/unit/store/test_tiered_store.py; here I/O threads, write policy, flush and remote timeout too)."""
    hashes = _hashes(_namespace())
    first = open_store(tmp_path, gpu=4, cpu=4, disk=32, num_io_threads=1)
    first.store(hashes, contents(hashes))
    first.close()
    other = stores(open_store(tmp_path, gpu=3, cpu=0, disk=32, num_io_threads=4, write_policy="write_through",
                              flush_on_close=False, remote_timeout_s=9.0))
    assert other.lookup(hashes).num_hit_blocks == len(hashes)
    result = other.load(hashes[:3])
    assert torch.equal(loaded_bytes(other, result), contents(hashes[:3]))
