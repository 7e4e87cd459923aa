"""REMOTE faults under the store (kvtier.testing.MemoryRemote): a failed, corrupt, truncated,
timed-out or missing REMOTE read is a miss for that block and the rest, counted by reason; a
refused or failed put raises nothing; damaged bytes are never served (guarantee 1). Plus the
test double's own contract (kvtier.tiers.backend), so that what it shows is meaningful.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvtier.records import ReadStatus
from kvtier.testing import REMOTE_FAULTS, Fault, FaultPlan, MemoryRemote, inject_remote_faults
from kvtier.tiers.backend import RemoteBackend
from kvtier.types import KVSpec, Medium
from tests.reliability.conftest import NS, SPEC, contents, loaded_bytes, open_store
from tests.reliability.test_faults import _request

OTHER_NS = b"o" * 32


# == the double's contract =====================================================================
def test_memory_remote_keeps_the_backend_contract():
    remote = MemoryRemote(capacity_blocks=3, evict=False)
    assert isinstance(remote, RemoteBackend)
    remote.register(NS, SPEC)
    remote.register(NS, SPEC)  # idempotent
    with pytest.raises(ValueError, match="expected"):
        remote.register(NS, KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32))
    hashes = _request(4)
    blocks = list(contents(hashes))
    assert remote.put(NS, hashes, blocks) == [True, True, True, False]  # refused when full
    assert remote.lookup(NS, hashes) == 3 and remote.lookup(OTHER_NS, hashes) == 0
    outs = [torch.full_like(b, 7) for b in blocks]
    assert remote.get_into(NS, hashes, outs) == [ReadStatus.OK] * 3 + [ReadStatus.MISSING]
    assert all(torch.equal(o, b) for o, b in zip(outs[:3], blocks))
    assert remote.get_into(OTHER_NS, hashes[:1], outs[:1]) == [ReadStatus.MISSING]
    for bad in ([b"", *hashes[1:]], ["str", *hashes[1:]]):
        with pytest.raises(ValueError, match="expected"):
            remote.lookup(NS, bad)


def test_memory_remote_evicts_least_recently_used_when_full():
    remote = MemoryRemote(capacity_blocks=2)
    a, b, c = (_request(1, start=s) for s in (0, 10, 20))
    for h in (a, b):
        remote.put(NS, h, list(contents(h)))
    remote.get_into(NS, a, [torch.empty(SPEC.block_shape)])  # a is used: b is the LRU
    remote.put(NS, c, list(contents(c)))
    assert [remote.lookup(NS, h) for h in (a, b, c)] == [1, 0, 1]


_GET_STATUS = {"unavailable": ReadStatus.UNAVAILABLE, "timeout": ReadStatus.TIMEOUT, "corrupt": ReadStatus.CORRUPT,
               "truncate": ReadStatus.CORRUPT, "missing": ReadStatus.MISSING}


@pytest.mark.parametrize("kind", sorted(_GET_STATUS))
def test_memory_remote_get_faults_are_statuses_never_bytes(kind):
    remote = MemoryRemote(timeout_s=0.01)
    hashes = _request(3)
    remote.put(NS, hashes, list(contents(hashes)))
    outs = [torch.zeros(SPEC.block_shape) for _ in hashes]
    with inject_remote_faults(remote, FaultPlan([Fault("get", kind, keys={hashes[1]}, delay_s=0.05)])):
        statuses = remote.get_into(NS, hashes, outs)
    assert statuses[0] is ReadStatus.OK and torch.equal(outs[0], contents(hashes[:1])[0])
    assert statuses[1] is _GET_STATUS[kind] and statuses[2] is not ReadStatus.OK


# == the store on a misbehaving REMOTE ===========================================================
def _stored_remotely(tmp_path, stores, remote, n=4):
    """Store ``n`` blocks through one store (they are put to REMOTE); a second store on
    another data directory sees them only on REMOTE."""
    hashes = _request(n)
    writer = stores(open_store(tmp_path / "a", gpu=8, cpu=0, disk=0, remote=remote))
    assert writer.store(hashes, contents(hashes)) == n
    writer.wait_for_writes()
    reader = stores(open_store(tmp_path / "b", gpu=8, cpu=0, disk=0, remote=remote))
    assert reader.lookup(hashes).media == [Medium.REMOTE] * n
    return reader, hashes


@pytest.mark.parametrize("kind", sorted(_GET_STATUS))
def test_remote_read_fault_is_a_miss_from_that_block_on_counted_by_reason(tmp_path, stores, kind):
    remote = MemoryRemote(timeout_s=0.01)
    reader, hashes = _stored_remotely(tmp_path, stores, remote)
    plan = FaultPlan([Fault("get", kind, keys={hashes[2]}, delay_s=0.05)])
    with inject_remote_faults(remote, plan):
        result = reader.load(hashes)
    assert plan.count(op="get") == 1
    assert len(result.block_ids) == 2 and torch.equal(loaded_bytes(reader, result), contents(hashes[:2]))
    result.lease.release()
    assert reader.stats.load_failures[_GET_STATUS[kind].value] >= 1
    reader.check_invariants()
    again = reader.load(hashes)  # healed: REMOTE still has the intact record (transient faults)
    assert torch.equal(loaded_bytes(reader, again), contents(hashes[: len(again.block_ids)]))
    assert len(again.block_ids) == 4


@pytest.mark.parametrize("kind", [k for k in REMOTE_FAULTS["put"] if k != "raise"])
def test_remote_put_fault_raises_nothing_and_damaged_records_are_never_served(tmp_path, stores, kind):
    remote = MemoryRemote(timeout_s=0.01)
    writer = stores(open_store(tmp_path / "a", gpu=8, cpu=0, disk=0, remote=remote))
    requests = [_request(3, start=100 * r) for r in range(4)]
    with inject_remote_faults(remote, FaultPlan([Fault("put", kind, p=0.5, delay_s=0.01)], seed=3)) as plan:
        for request in requests:
            assert writer.store(request, contents(request)) == 3
        writer.wait_for_writes()
    assert plan.count() > 0
    writer.check_invariants()
    reader = stores(open_store(tmp_path / "b", gpu=8, cpu=0, disk=0, remote=remote))
    served = 0
    for request in requests:
        result = reader.load(request)
        with result.lease:
            assert torch.equal(loaded_bytes(reader, result), contents(request[: len(result.block_ids)]))
        served += len(result.block_ids)
    if kind in ("corrupt", "truncate"):
        assert reader.stats.load_failures["corrupt"] >= 1
    assert served < 12 or kind == "delay"
    reader.check_invariants()


def test_remote_down_for_every_call_is_only_misses(tmp_path, stores):
    remote = MemoryRemote(timeout_s=0.01)
    reader, hashes = _stored_remotely(tmp_path, stores, remote)
    down = FaultPlan([Fault(op, "unavailable") for op in ("lookup", "get", "put")])
    with inject_remote_faults(remote, down):
        assert reader.lookup(hashes).num_hit_blocks == 0
        assert reader.load(hashes).block_ids == []
        other = _request(2, start=500)
        assert reader.store(other, contents(other)) == 2  # stored locally; the put fails quietly
        reader.wait_for_writes()
    assert remote.errors["unavailable"] >= 3
    result = reader.load(hashes)  # back up
    assert torch.equal(loaded_bytes(reader, result), contents(hashes))


@pytest.mark.parametrize("op", ["get", "put"])
def test_remote_backend_that_raises_in_a_transfer_fails_the_job_not_the_caller(tmp_path, stores, op):
    remote = MemoryRemote()
    reader, hashes = _stored_remotely(tmp_path, stores, remote)
    with inject_remote_faults(remote, FaultPlan([Fault(op, "raise")])):
        result = reader.load(hashes)
        assert len(result.block_ids) == (0 if op == "get" else 4)
        result.lease.release()
        other = _request(2, start=700)
        assert reader.store(other, contents(other)) == 2
        reader.wait_for_writes()
    reader.check_invariants()


def test_remote_backend_that_raises_in_lookup_is_a_miss(tmp_path, stores):
    """Found by these tests (fixed in cf72e4c): a backend raising in lookup (a bug the contract
    excludes) reached the caller; get/put were already guarded by RemoteHandler."""
    remote = MemoryRemote()
    reader, hashes = _stored_remotely(tmp_path, stores, remote)
    with inject_remote_faults(remote, FaultPlan([Fault("lookup", "raise")])):
        assert reader.lookup(hashes).num_hit_blocks == 0
        assert reader.load(hashes).block_ids == []


def test_a_dropped_lease_is_released_after_a_remote_lookup_raised(tmp_path, stores):
    """Found by the stateful test (kvtier-long profile): the REMOTE error's log record (kept
    by a log handler, as pytest's is) held the exception, its traceback the lookup's frame, and
    that frame the pinned lease: dropped by its owner, it was never collected, the pin stayed."""
    remote = MemoryRemote()
    store = stores(open_store(tmp_path, gpu=2, cpu=0, disk=0, remote=remote))
    hashes = _request(2)
    store.store(hashes[:1], contents(hashes[:1]))
    store.wait_for_writes()  # (the REMOTE put pins its block until then)
    with inject_remote_faults(remote, FaultPlan([Fault("lookup", "raise")])):
        result = store.lookup(hashes, pin=True)  # block 0 local (pinned), block 1 asked of REMOTE
    assert result.num_hit_blocks == 1 and store.ref_cnt(hashes[0]) == 1
    del result
    gc.collect()
    assert store.ref_cnt(hashes[0]) == 0


def test_lookup_counts_local_blocks_after_a_remote_part(tmp_path, stores):
    """Found by the stateful test (fixed in cf72e4c): lookup stopped where the REMOTE prefix
    stopped, so block 0 only on REMOTE + block 1 local gave lookup 1 while load served 2."""
    remote = MemoryRemote()
    store = stores(open_store(tmp_path, gpu=3, cpu=0, disk=0, remote=remote))
    hashes = _request(2)
    with inject_remote_faults(remote, FaultPlan([Fault("put", "full", keys={hashes[1]})])):
        store.store(hashes, contents(hashes))  # block 1 is refused by REMOTE
        store.wait_for_writes()
    store.load(hashes[1:]).lease.release()  # a use: block 1 is protected, block 0 is the LRU victim
    other = _request(2, start=100)
    store.store(other, contents(other))
    store.wait_for_writes()
    assert [store.medium_of(h) for h in hashes] == [None, Medium.GPU] and remote.lookup(NS, hashes) == 1
    num_looked_up = store.lookup(hashes).num_hit_blocks
    result = store.load(hashes)
    assert result.sources == [Medium.REMOTE, Medium.GPU]  # load serves both
    assert torch.equal(loaded_bytes(store, result), contents(hashes))
    result.lease.release()
    assert num_looked_up == 2
