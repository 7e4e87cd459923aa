"""DISK faults under the store (kvtier.testing.faults): every kind of read fault is a miss for
that block and the rest, counted by reason, never wrong bytes and never an exception; every
kind of write fault leaves the blocks already stored readable and raises nothing
(guarantees 1 and 3). Plus the fault layer's own contract, and regression tests of the faults
these tests found (each docstring says which; all fixed).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.hashing import block_hashes_for
from kvtier.records import ReadStatus
from kvtier.testing import DISK_READ_FAULTS, DISK_WRITE_FAULTS, Fault, FaultPlan, inject_disk_faults
from kvtier.types import Medium
from tests.reliability.conftest import NS, SPEC, contents, loaded_bytes, open_store


def _request(n: int, start: int = 0) -> list[bytes]:
    return block_hashes_for(list(range(start, start + n * SPEC.block_size)), NS, SPEC.block_size)


def _on_disk(stores, tmp_path, n: int = 4, **kwargs):
    """A store whose DISK holds one ``n``-block request (written, closed, reopened)."""
    hashes = _request(n)
    first = open_store(tmp_path, gpu=n, cpu=0, disk=16, **kwargs)
    assert first.store(hashes, contents(hashes)) == n
    first.close()
    store = stores(open_store(tmp_path, gpu=n, cpu=0, disk=16, **kwargs))
    assert store.lookup(hashes).media == [Medium.DISK] * n
    return store, hashes


# == the fault layer ================================================================================
def test_scripted_faults_fire_on_exactly_the_named_calls():
    plan = FaultPlan([Fault("read", "error", calls={2, 4})])
    fired = [plan.pick("read") is not None for _ in range(5)]
    assert fired == [False, True, False, True, False] and plan.calls("read") == 5
    with plan.paused():
        assert plan.pick("read") is None
    assert plan.calls("read") == 5


def test_probability_draws_depend_on_the_seed_and_block_not_on_call_order():
    keys = [bytes([i]) * 32 for i in range(200)]
    a, b, c = (FaultPlan([Fault("read", "corrupt", p=0.3)], seed=s) for s in (1, 1, 2))
    fired_a = [a.pick("read", k) is not None for k in keys]
    fired_b = [b.pick("read", k) is not None for k in reversed(keys)][::-1]
    fired_c = [c.pick("read", k) is not None for k in keys]
    assert fired_a == fired_b != fired_c
    assert 30 < sum(fired_a) < 90


@pytest.mark.parametrize("bad", [dict(op="fetch", kind="error"), dict(op="read", kind="full"),
                                 dict(op="read", kind="error", p=2)])
def test_bad_fault_rules_raise_value_error(bad):
    with pytest.raises(ValueError, match="expected"):
        Fault(**bad)


def test_injection_is_undone_on_exit(stores, tmp_path):
    store, hashes = _on_disk(stores, tmp_path)
    real_env = store.disk.env
    with inject_disk_faults(store, FaultPlan([Fault("read", "error")])):
        assert store.disk.env is not real_env
    assert store.disk.env is real_env and "write_batch" not in vars(store.disk)
    result = store.load(hashes)
    assert torch.equal(loaded_bytes(store, result), contents(hashes))


# == reads ==========================================================================================
_REASON = {"error": "error", "readers_full": "error", "corrupt": "corrupt", "truncate": "corrupt", "missing": "missing"}


@pytest.mark.parametrize("kind", [k for k in DISK_READ_FAULTS if k != "delay"])
def test_disk_read_fault_is_a_miss_from_that_block_on_counted_by_reason(stores, tmp_path, kind):
    store, hashes = _on_disk(stores, tmp_path)
    plan = FaultPlan([Fault("read", kind, keys={hashes[2]})])
    with inject_disk_faults(store, plan):
        result = store.load(hashes)
    # a read that raises (error, readers_full) fails its job's batch read, whose blocks are then
    # read one by one (the handler's fallback): the fault fires again there, on the same block
    fired = 2 if kind in ("error", "readers_full") and store.config.num_io_threads < len(hashes) else 1
    assert plan.count(op="read", kind=kind) == fired
    assert {i.key for i in plan.injected} == {hashes[2]}
    assert len(result.block_ids) == 2 and torch.equal(loaded_bytes(store, result), contents(hashes[:2]))
    result.lease.release()
    assert dict(store.stats.load_failures) == {_REASON[kind]: 1}
    store.check_invariants()
    again = store.load(hashes)  # healed: an I/O error is retried; a bad record was dropped
    assert len(again.block_ids) == (4 if _REASON[kind] == "error" else 2)
    assert torch.equal(loaded_bytes(store, again), contents(hashes[: len(again.block_ids)]))


def test_slow_disk_reads_still_load_everything(stores, tmp_path):
    store, hashes = _on_disk(stores, tmp_path)
    with inject_disk_faults(store, FaultPlan([Fault("read", "delay", delay_s=0.02)])) as plan:
        handle = store.prefetch(hashes)
        assert store.lookup(_request(2, start=500)).num_hit_blocks == 0  # the store is not blocked meanwhile
        result = handle.wait()
    assert plan.count(kind="delay") == 4
    assert torch.equal(loaded_bytes(store, result), contents(hashes))


@pytest.mark.parametrize("seed", range(6))
def test_random_read_faults_serve_only_exact_bytes(stores, tmp_path, seed):
    """Every read fault at once, at 30 %: whatever loads is exact, the rest is a counted miss."""
    store, _ = _on_disk(stores, tmp_path, n=1)
    requests = [_request(4, start=1000 * r) for r in range(6)]
    for r in requests:
        store.store(r, contents(r))
    store.flush()
    faults = [Fault("read", kind, p=0.3 / 5) for kind in DISK_READ_FAULTS if kind != "delay"]
    with inject_disk_faults(store, FaultPlan(faults, seed=seed)) as plan:
        served = 0
        for _ in range(3):
            for r in requests:
                result = store.load(r)
                with result.lease:
                    assert torch.equal(loaded_bytes(store, result), contents(r[: len(result.block_ids)]))
                served += len(result.block_ids)
    assert sum(store.stats.load_failures.values()) == plan.count()
    assert served > 0
    store.check_invariants()


# == writes =========================================================================================
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("kind", [k for k in DISK_WRITE_FAULTS if k != "raise"])
def test_disk_write_fault_raises_nothing_and_keeps_stored_blocks(stores, tmp_path, kind, policy):
    store, hashes = _on_disk(stores, tmp_path, write_policy=policy)
    plan = FaultPlan([Fault("write", kind, delay_s=0.01)])
    with inject_disk_faults(store, plan):
        for r in range(4):  # each request pushes the previous ones down: spills and write-throughs
            request = _request(3, start=100 * (r + 1))
            assert store.store(request, contents(request)) >= 1
        store.wait_for_writes()
        store.flush()
    assert plan.count() > 0
    store.check_invariants()
    result = store.load(hashes)  # written before the faults: all there
    assert torch.equal(loaded_bytes(store, result), contents(hashes))
    result.lease.release()
    for r in range(4):  # the faulted ones: exact bytes or a miss; a damaged record is caught
        request = _request(3, start=100 * (r + 1))
        with store.load(request).lease as lease:
            n = len(lease.block_hashes)
        assert store.lookup(request).num_hit_blocks >= n
    if kind == "corrupt":
        assert store.stats.load_failures["corrupt"] >= 1
    store.check_invariants()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_disk_write_that_raises_does_not_reach_the_caller(stores, tmp_path, policy):
    """Found by these tests (fixed in cf72e4c): an unexpected exception from write_batch (a
    MemoryError allocating a record buffer) escaped store()/load()/flush() through the
    synchronous spill in TieredStore._spill_to_disk."""
    store, hashes = _on_disk(stores, tmp_path, write_policy=policy)
    with inject_disk_faults(store, FaultPlan([Fault("write", "raise")])):
        for r in range(4):
            request = _request(3, start=100 * (r + 1))
            store.store(request, contents(request))
        store.flush()
    result = store.load(hashes)
    assert torch.equal(loaded_bytes(store, result), contents(hashes))


def test_failed_spills_are_counted_by_reason(stores, tmp_path):
    """Found by these tests (fixed in cf72e4c): a failed synchronous spill was not counted."""
    store = stores(open_store(tmp_path, gpu=2, cpu=0, disk=16))
    with inject_disk_faults(store, FaultPlan([Fault("write", "error")])) as plan:
        for r in range(3):
            request = _request(2, start=100 * r)
            store.store(request, contents(request))
    assert plan.count() >= 1
    assert sum(store.stats.store_failures.values()) >= plan.count()


# == write-through background writes =============================================================
def test_write_through_background_write_never_evicts_a_pinned_block(stores, tmp_path):
    store = stores(open_store(tmp_path, gpu=1, cpu=1, disk=2, write_policy="write_through"))
    x, y, z = (_request(1, start=s) for s in (0, 100, 200))
    for request in (x, y):
        store.store(request, contents(request))
        store.wait_for_writes()
    assert store.medium_of(x[0]) is Medium.DISK  # only there
    with inject_disk_faults(store, FaultPlan([Fault("write", "delay", delay_s=0.2)])):
        store.store(z, contents(z))  # its DISK write (which needs x's room) is still running
        lease = store.lookup(x, pin=True).lease
        store.wait_for_writes()
    # x was evicted when the write was submitted (it was unpinned then), or it is pinned now
    # and must survive the write (found failing when the job deleted its victims at run time)
    if lease is not None:
        assert store.ref_cnt(x[0]) == 1
        assert store.medium_of(x[0]) is not None, "a pinned block was evicted"
        lease.release()
    store.check_invariants()


@pytest.mark.parametrize("tiers", [(1, 0, 4), (2, 0, 4), (3, 0, 3), (3, 3, 3), (3, 3, 4)])
def test_write_through_store_claims_only_blocks_a_lookup_finds_regression_b2(stores, tmp_path, tiers):
    """A request larger than the inclusive tiers: its own DISK write-through jobs evict DISK
    victims; what store() claims must still be found afterwards (found failing before the
    head-keeping store_with: a 5-block request claimed 5, then a lookup found 0)."""
    gpu, cpu, disk = tiers
    store = stores(open_store(tmp_path, gpu=gpu, cpu=cpu, disk=disk, write_policy="write_through"))
    request = _request(5)
    claimed = store.store(request, contents(request))
    store.wait_for_writes()
    assert store.lookup(request).num_hit_blocks >= claimed >= 1


def test_disk_read_statuses_are_the_ones_the_store_counts(tmp_path):
    """The DISK tier's own verdicts under faults (the store maps them to load_failures)."""
    from kvtier.tiers.disk import DiskTier

    tier = DiskTier(tmp_path, 1 << 20)
    (h,) = _request(1)
    block = contents([h])[0]
    tier.write_batch([(h, NS, block)])
    out = torch.empty_like(block)
    verdicts = {}
    for kind in ("corrupt", "truncate", "missing", "delay"):
        with inject_disk_faults(tier, FaultPlan([Fault("read", kind, delay_s=0.001)])):
            verdicts[kind] = tier.read_into(h, NS, out)
    assert verdicts == {"corrupt": ReadStatus.CORRUPT, "truncate": ReadStatus.CORRUPT,
                        "missing": ReadStatus.MISSING, "delay": ReadStatus.OK}
    assert torch.equal(out, block)
    tier.close()


@pytest.mark.parametrize("tiers", [(4, 8, 0, 6), (8, 0, 32, 12), (1, 0, 3, 2)], ids=["cpu", "disk", "one-slot"])
def test_load_of_a_prefix_longer_than_the_top_pool_loads_its_head(stores, tmp_path, tiers):
    """Found by the stateful test (fixed in cf72e4c): plan_prefetch pinned the whole cached
    chain before making room, so when the chain's own tail filled the top pool (a request
    longer than it, head spilled down by store_with) the load returned 0 blocks."""
    gpu, cpu, disk, n = tiers
    store = stores(open_store(tmp_path, gpu=gpu, cpu=cpu, disk=disk))
    request = _request(n)
    assert store.store(request, contents(request)) == n
    result = store.load(request)
    assert len(result.block_ids) == gpu  # as much of the head as the top pool holds
    assert torch.equal(loaded_bytes(store, result), contents(request[:gpu]))
