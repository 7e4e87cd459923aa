"""Capacity is never exceeded and never a dead end (guarantee 3, case D3), with the real LMDB
map filling up (fault-injected full maps and filesystems: test_faults.py; a real full tmpfs:
test_disk_full.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.types import Medium
from tests.reliability.conftest import contents, loaded_bytes, open_store
from tests.reliability.test_faults import _request


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_full_lmdb_map_refuses_stores_keeps_reading_and_raises_nothing(tmp_path, stores, policy, caplog):
    store = stores(open_store(tmp_path, gpu=2, cpu=2, disk=64, write_policy=policy))
    kept = _request(2)
    store.store(kept, contents(kept))
    store.flush()
    assert all(h in store.disk for h in kept)
    env = store.disk.env
    env.set_mapsize((env.info()["last_pgno"] + 2) * store.disk.page_nbytes)  # no transaction open: the map is full
    for r in range(8):  # every spill and write-through finds no room in the map
        request = _request(3, start=100 * (r + 1))
        assert store.store(request, contents(request)) >= 1
    store.wait_for_writes()
    store.flush()
    assert any("DISK write" in r.getMessage() for r in caplog.records), "the map never filled: nothing was tested"
    store.check_invariants()
    for tier in store.usage().values():
        assert tier["used_bytes"] <= tier["capacity_bytes"]
    result = store.load(kept)  # written before the map filled: still read, exact
    assert torch.equal(loaded_bytes(store, result), contents(kept))
    result.lease.release()
    store.close()
    reopened = stores(open_store(tmp_path, gpu=2, cpu=2, disk=64))  # opened with the configured map size again
    assert reopened.lookup(kept).media == [Medium.DISK] * 2
    reopened.check_invariants()


def test_disk_at_its_cap_evicts_the_oldest_and_the_map_is_never_resized(tmp_path, stores, caplog):
    """A DISK tier churned through 50x its cap: usage stays at or under the cap after every
    store, no write fails for lack of map space (the map is sized at open with slack for
    B-tree pages and pages held by readers: DiskTier.__init__), and the map is never resized
    (LMDB allows that only with no transaction open in the process; kvtier never does it)."""
    store = stores(open_store(tmp_path, gpu=2, cpu=0, disk=8))
    map_size = store.disk.env.info()["map_size"]
    for r in range(200):
        request = _request(2, start=10 * r)
        store.store(request, contents(request))
        usage = store.usage()[str(Medium.DISK)]
        assert usage["used_bytes"] <= usage["capacity_bytes"] and usage["blocks"] <= 8
    assert store.stats.evicted_blocks[Medium.DISK] >= 380
    assert not [r for r in caplog.records if "DISK" in r.getMessage()], "a DISK write failed"
    assert store.disk.env.info()["map_size"] == map_size
    newest = _request(2, start=10 * 199)
    result = store.load(newest)
    assert torch.equal(loaded_bytes(store, result), contents(newest))
    store.check_invariants()
    sources = Path(__file__).resolve().parents[2] / "kvtier"
    assert not [p for p in sources.rglob("*.py") if "set_mapsize" in p.read_text()], "kvtier resizes the map"


def test_write_through_at_a_full_disk_never_drops_an_acknowledged_block(tmp_path, stores):
    """Write-through DISK writes run in the background; a second store that sized its DISK
    evictions without counting the writes still in flight made those writes fail "full"
    after the blocks were reported stored, and they were lost once the memory tier evicted
    them (found driving the SGLang backend: CPU 4 blocks, DISK 6, rounds of 3 stores of 2)."""
    store = stores(open_store(tmp_path, gpu=0, cpu=4, disk=6, write_policy="write_through"))
    stored: list = []
    for r in range(6):
        for k in range(3):
            request = _request(2, start=1000 * r + 10 * k)
            assert store.store(request, contents(request)) == 2
            stored.append(request)
    store.wait_for_writes()
    assert store.stats.store_failures["full"] == 0, dict(store.stats.store_failures)
    store.check_invariants()
    newest = [h for request in stored[-3:] for h in request]
    assert all(store.lookup([h]).num_hit_blocks == 1 for h in newest)
