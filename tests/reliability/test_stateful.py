"""A stateful property test (hypothesis) of TieredStore against a model of what was stored.

Random sequences of store, lookup (pinned or not), prefetch + wait, load, lease release and
drop, flush, reset, close/reopen (with other pool sizes: case K3), crash/reopen (kvtier.testing
``abandon``) and DISK and REMOTE fault injection, on a store with tiny capacities (GPU, CPU:
1-3 blocks; DISK: 3-6 records; REMOTE, when there is one: a MemoryRemote of 4 or 12 blocks
that outlives the store, like a daemon), so that eviction and spills happen at almost every
step, under ``write_back`` and ``write_through``.

The model: the content of a block is a function of its hash (tests/reliability/conftest.py
``content``), so "what was stored under h" is ``content(h)``, plus the set of hashes ever
stored and the leases the test holds. Checked after every step (guarantees 1, 3, 4):
- ``store.check_invariants()`` (pools and DISK agree with their indexes, caps hold);
- every block any tier holds is a hash that was stored, with exactly its bytes (GPU/CPU
  slots read in place; DISK and REMOTE records read and verified; a record damaged at rest
  must not verify); every hit served is checked the same way when it is served;
- pins: the store's ref counts equal the leases the test holds, exactly (none leaked);
- usage <= capacity on every tier; DISK usage and record count match the LMDB database;
- without faults, a store's claimed blocks are found by a lookup right after it, and a
  load of a fully cached prefix that fits the top pool returns all of it;
- close/reopen and crash/reopen: the reopened DISK holds exactly the records that were
  committed when the old store went away (nothing lost, nothing half-written, no resurrection);
- reset: the model forgets what was stored, so from then on every tier (REMOTE included) may
  hold only blocks stored after it; prefetches in flight across it return nothing, leases
  held across it release without error and the bytes they pin stay as they were.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.hashing import block_hashes_for
from kvtier.records import ReadStatus
from kvtier.records import decode_into
from kvtier.testing import DISK_READ_FAULTS, DISK_WRITE_FAULTS, REMOTE_FAULTS, Fault, FaultPlan, MemoryRemote
from kvtier.testing import abandon, inject_disk_faults, inject_remote_faults
from kvtier.types import Medium
from tests.reliability.conftest import NS, SPEC, content, contents, loaded_bytes, open_store, reliability_settings


def _prompts() -> list[list[bytes]]:
    """Six prompts of 1-6 blocks; some share prefixes (0 and 1; 2 and 3)."""
    b = SPEC.block_size
    a, c = list(range(1000, 1000 + 4 * b)), list(range(2000, 2000 + 3 * b))
    token_lists = [
        a,
        a[: 2 * b] + list(range(3000, 3000 + 2 * b)),
        c,
        c + list(range(4000, 4000 + 2 * b)),
        list(range(5000, 5000 + b)),
        list(range(6000, 6000 + 6 * b)),
    ]
    return [block_hashes_for(tokens, NS, b) for tokens in token_lists]


PROMPTS = _prompts()
_FAULTS = [("read", kind) for kind in DISK_READ_FAULTS] + [("write", kind) for kind in DISK_WRITE_FAULTS]
_REMOTE_FAULTS = [(op, kind) for op, kinds in REMOTE_FAULTS.items() for kind in kinds]
prompt_ids = st.integers(0, len(PROMPTS) - 1)
lengths = st.integers(1, 6)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-stateful-"))
        self.store = None
        self.held: list = []  # leases the test holds
        self.pending: list = []  # (prefetch handle, hashes) not waited yet
        self.stored: set[bytes] = set()  # hashes ever passed to store()
        self.plan: FaultPlan | None = None
        self.faults = contextlib.ExitStack()
        self.damaged: set[bytes] = set()  # records written with a flipped payload bit
        self.remote: MemoryRemote | None = None  # shared by every store opened (a daemon: survives crashes)
        self.remote_damaged: set[bytes] = set()
        self.read_faulted: set[bytes] = set()  # blocks a read fault hit (dropped as corrupt/missing)
        self.stale_held: list = []  # leases held across a reset
        self.loads_held: dict[int, tuple[list[int], list[bytes]]] = {}  # id(lease) -> its top slots, hashes
        self.stale_pending: list = []  # prefetch handles in flight across a reset

    # -- setup and teardown ----------------------------------------------------------------
    @initialize(
        gpu=st.integers(1, 3), cpu=st.integers(0, 3), disk=st.integers(3, 6),
        policy=st.sampled_from(["write_back", "write_through"]), remote=st.sampled_from([None, 4, 12]),
    )
    def open(self, gpu, cpu, disk, policy, remote) -> None:
        self.disk_cap, self.policy = disk, policy
        if remote is not None:
            self.remote = MemoryRemote(capacity_blocks=remote, timeout_s=0.002)
        self._open(gpu, cpu)

    def _open(self, gpu, cpu) -> None:
        self.store = open_store(self.dir, gpu=gpu, cpu=cpu, disk=self.disk_cap, write_policy=self.policy,
                                num_io_threads=1, remote=self.remote)

    def teardown(self) -> None:
        self.faults.close()
        if self.store is not None:
            self._settle()
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- operations -------------------------------------------------------------------------
    @rule(p=prompt_ids, n=lengths)
    def store_prompt(self, p, n) -> None:
        hashes = PROMPTS[p][:n]
        claimed = self.store.store(hashes, contents(hashes))
        self.stored.update(hashes)
        assert 0 <= claimed <= len(hashes)
        if self.plan is None:
            assert self.store.lookup(hashes).num_hit_blocks >= claimed, "store claimed blocks a lookup misses"

    @rule(p=prompt_ids, n=lengths, pin=st.booleans())
    def lookup(self, p, n, pin) -> None:
        hashes = PROMPTS[p][:n]
        result = self.store.lookup(hashes, pin=pin)
        assert result.num_hit_blocks == len(result.media) <= len(hashes)
        assert set(hashes[: result.num_hit_blocks]) <= self.stored, "a hit on a block never stored"
        if result.lease is not None:
            self.held.append(result.lease)

    @rule(p=prompt_ids, n=lengths, keep=st.booleans())
    def load(self, p, n, keep) -> None:
        hashes = PROMPTS[p][:n]
        quiet = self.plan is None and not (self.held or self.pending or self.stale_held or self.stale_pending)
        if quiet:
            self.store.wait_for_writes()  # background write-through jobs pin their blocks
            expected = self.store.lookup(hashes).num_hit_blocks
        result = self.store.load(hashes)
        self._check_served(hashes, result)
        if keep:
            self.loads_held[id(result.lease)] = (list(result.block_ids), hashes[: len(result.block_ids)])
        # Nothing pinned, no fault: the whole cached prefix loads, or as much of its head as the
        # top pool holds (unless a record was damaged at rest: that load must fail).
        damaged = self.damaged | self.remote_damaged
        if quiet and not set(hashes[:expected]) & damaged:
            wanted = min(expected, self.store.top.num_blocks)
            assert len(result.block_ids) == wanted, "a cached prefix (or its head) did not load"
        self._keep_or_release(result.lease, keep)

    @rule(p=prompt_ids, n=lengths)
    def prefetch(self, p, n) -> None:
        hashes = PROMPTS[p][:n]
        self.pending.append((self.store.prefetch(hashes), hashes))

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 7), keep=st.booleans())
    def wait_prefetch(self, i, keep) -> None:
        handle, hashes = self.pending.pop(i % len(self.pending))
        result = handle.wait()
        self._check_served(hashes, result)
        if keep:
            self.loads_held[id(result.lease)] = (list(result.block_ids), hashes[: len(result.block_ids)])
        self._keep_or_release(result.lease, keep)

    @rule(i=st.integers(0, 7), drop=st.booleans())
    def release(self, i, drop) -> None:
        if not self.held:  # (no precondition on it: what is held depends on hits, see the note below)
            return
        lease = self.held.pop(i % len(self.held))
        self.loads_held.pop(id(lease), None)
        if drop:  # never released: the finalizer must give the pins back (O1)
            del lease
            gc.collect()
        else:
            lease.release()

    @rule()
    def flush(self) -> None:
        self.store.flush()

    @rule()
    def reset(self) -> None:
        self.stale_pending += [handle for handle, _ in self.pending]
        self.stale_held += self.held
        self.pending, self.held = [], []
        self.store.reset()
        self.stored = set()  # from now on, no tier may hold a block stored before

    @precondition(lambda self: self.stale_pending or self.stale_held)
    @rule(drop=st.booleans())
    def settle_stale(self, drop) -> None:
        """Prefetches from before a reset publish nothing; leases from before it release
        without error (or are dropped: their finalizers run)."""
        self._settle_stale(drop)

    @rule(gpu=st.integers(1, 3), cpu=st.integers(0, 3))
    def close_and_reopen(self, gpu, cpu) -> None:
        self._settle()
        self.store.close()
        self._reopen_and_compare(set(self.store.disk.lru_order()), gpu, cpu)

    @rule(gpu=st.integers(1, 3), cpu=st.integers(0, 3))
    def crash_and_reopen(self, gpu, cpu) -> None:
        """The process dies: held leases and prefetches die with it, memory tiers are lost."""
        self.held.clear()
        self.pending.clear()
        self.stale_held.clear()
        self.stale_pending.clear()
        self.loads_held.clear()
        abandon(self.store)  # waits for background jobs: the DISK index is then what committed
        self._reopen_and_compare(set(self.store.disk.lru_order()), gpu, cpu)

    @rule(fault=st.sampled_from(_FAULTS + _REMOTE_FAULTS), p=st.sampled_from([0.3, 1.0]), seed=st.integers(0, 1000))
    def inject(self, fault, p, seed) -> None:
        self._stop_faults()
        op, kind = fault
        self.plan = FaultPlan([Fault(op, kind, p=p, delay_s=0.002)], seed=seed)
        self.faults.enter_context(inject_disk_faults(self.store, self.plan))
        if self.remote is not None:
            self.faults.enter_context(inject_remote_faults(self.remote, self.plan))

    @precondition(lambda self: self.plan is not None)
    @rule()
    def heal(self) -> None:
        self._stop_faults()

    # -- helpers ----------------------------------------------------------------------------
    def _stop_faults(self) -> None:
        self.faults.close()
        if self.plan is not None:
            self.damaged |= self.plan.keys(op="write", kind="corrupt")
            self.remote_damaged |= self.plan.keys(op="put", kind="corrupt") | self.plan.keys(op="put", kind="truncate")
            self.read_faulted |= self.plan.keys(op="read")
        self.plan = None
        self.faults = contextlib.ExitStack()

    def _settle_stale(self, drop: bool = False) -> None:
        for handle in self.stale_pending:
            result = handle.wait()
            assert result.block_ids == [] and result.sources == [], "a prefetch from before a reset published"
        self.stale_pending.clear()
        for lease in self.stale_held:  # the slots they pin kept their bytes through the reset
            block_ids, hashes = self.loads_held.pop(id(lease), ([], []))
            if block_ids and not lease.released:
                got = self.store.top.tensor[torch.tensor(block_ids, dtype=torch.long)]
                assert torch.equal(got, contents(hashes)), "a slot pinned across a reset was overwritten"
        if drop:
            self.stale_held.clear()
            gc.collect()
        for lease in self.stale_held:
            lease.release()
        self.stale_held.clear()

    def _settle(self) -> None:
        """Wait the test's prefetches and release its leases."""
        self._settle_stale()
        for handle, hashes in self.pending:
            result = handle.wait()
            self._check_served(hashes, result)
            result.lease.release()
        self.pending.clear()
        for lease in self.held:
            lease.release()
        self.held.clear()
        self.loads_held.clear()

    def _reopen_and_compare(self, committed: set, gpu: int, cpu: int) -> None:
        self._stop_faults()
        self._open(gpu, cpu)
        reopened = set(self.store.disk.lru_order())
        assert reopened == committed, (
            f"reopen: {len(committed - reopened)} committed records lost, {len(reopened - committed)} appeared"
        )

    def _keep_or_release(self, lease, keep: bool) -> None:
        if keep and lease.block_hashes:
            self.held.append(lease)
        else:
            lease.release()

    def _check_served(self, hashes, result) -> None:
        n = len(result.block_ids)
        assert n == len(result.sources) <= len(hashes)
        assert torch.equal(loaded_bytes(self.store, result), contents(hashes[:n])), "served bytes differ from stored"

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        store = self.store
        if store is None:
            return
        if self.pending or self.stale_pending:  # prefetch slots are pending by design until waited
            store.wait_for_writes()
            with store.residency.lock:
                for pool in store.pools:
                    pool.check()
                if store.disk is not None:
                    store.disk.check()
        else:
            store.check_invariants()
        pinned = store.residency.pinned()
        expected = Counter()
        for lease in self.held:
            if not lease.released:
                expected.update(lease.block_hashes)
        for handle, _ in self.pending:
            expected.update(handle.lease.block_hashes)
        assert pinned == dict(expected), "store pins differ from the leases held"
        # A pinned block is never evicted (a failed read still drops it: a damaged record, or a
        # read fault, is a miss and the record is forgotten)
        dropped = self.read_faulted | self.damaged | (self.plan.keys(op="read") if self.plan else set())
        if self.plan is not None:
            dropped |= self.plan.keys(op="write", kind="corrupt")
        lost = set(pinned) - dropped
        remote = set() if self.remote is None else {h for _, h in self.remote.records}
        coming = store.residency.pending(store.top.medium)  # prefetches bringing it up
        present = [store.medium_of(h) is not None or h in coming | remote for h in lost]
        assert all(present), "a pinned block was evicted"
        for tier in store.usage().values():
            assert tier["used_bytes"] <= tier["capacity_bytes"]

    @invariant()
    def every_block_held_is_the_stored_one(self) -> None:
        store = self.store
        if store is None:
            return
        with store.residency.lock:
            for pool in store.pools:
                for h in list(pool.lru_order()):
                    assert h in self.stored, f"{pool.medium} holds a block never stored"
                    if store.residency.is_pending(pool.medium, h):
                        continue  # a transfer is filling it
                    got = pool.tensor[pool.block_id(h)]
                    assert torch.equal(got, content(h)), f"{pool.medium} slot of a hash holds other bytes (O2)"
        disk = store.disk
        with contextlib.ExitStack() as paused:
            if self.plan is not None:
                paused.enter_context(self.plan.paused())
            out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
            for h in list(disk.lru_order()):
                assert h in self.stored, "DISK holds a block never stored"
                status = disk.read_into(h, NS, out)
                damaged = h in self.damaged or h in (self.plan.keys(op="write", kind="corrupt") if self.plan else ())
                if status is ReadStatus.OK:
                    assert torch.equal(out, content(h)), "a DISK record verified with other bytes"
                else:
                    assert damaged and status is ReadStatus.CORRUPT, f"an intact DISK record read as {status}"
            with disk.env.begin() as txn:
                assert txn.stat()["entries"] == len(disk) == store.usage()[str(Medium.DISK)]["blocks"]
        if self.remote is None:
            return
        damaged = self.remote_damaged | (self.plan.keys(op="put") if self.plan is not None else set())
        with self.remote._lock:
            records = dict(self.remote.records)
        for (namespace, h), value in records.items():
            assert namespace == NS and h in self.stored, "REMOTE holds a block never stored"
            status = decode_into(memoryview(value), NS, out)
            if status is ReadStatus.OK:
                assert torch.equal(out, content(h)), "a REMOTE record verified with other bytes"
            else:
                assert h in damaged, f"an intact REMOTE record read as {status}"


# Replays must be exact (hypothesis checks it, and shrinking needs it), so: one I/O thread
# (background jobs run in submission order; every step ends by waiting for them), fault draws
# keyed by block (kvtier.testing.FaultPlan), and rule preconditions only on state that does not
# depend on hits. Concurrency itself is exercised in test_processes.py and
# test_threads.py (threads storing, loading and flushing at once).
TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.pytestmark = [pytest.mark.slow]  # the long stateful model check
TestStoreMachine.settings = reliability_settings()
