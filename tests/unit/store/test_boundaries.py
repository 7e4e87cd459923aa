"""The store's boundary: bad blocks, bad block hashes, duplicates and empty requests raise a
typed error at the call (or are no-ops) and leave what is stored intact."""

from __future__ import annotations

import pytest
import torch

from kvtier.store import TieredStore
from kvtier.types import Medium
from tests.conftest import NS, chain, config_in_blocks, open_store, random_blocks, read_back, tiny_spec

SPEC = tiny_spec()


def test_bad_blocks_at_store_boundary_raise_value_error_and_keep_stored_blocks(make_store):
    store = make_store(gpu_blocks=4)
    kept, kept_block = chain(1, SPEC, NS, start=900), random_blocks(SPEC, 1, seed=9)
    assert store.store(kept, kept_block) == 1
    hashes = chain(2, SPEC, NS)
    good = random_blocks(SPEC, 2)
    bad_inputs = [
        good[:1],  # one block for two hashes
        good.unsqueeze(0),  # extra dimension
        good.half(),  # wrong dtype
        good.to(torch.float64),
        good.numpy(),  # not a tensor
        [good[0], good[1]],
    ]
    for bad in bad_inputs:
        with pytest.raises(ValueError, match="expected"):
            store.store(hashes, bad)
    assert store.lookup(hashes).num_hit_blocks == 0
    n, out = read_back(store, kept)
    assert n == 1 and torch.equal(out, kept_block)
    store.check_invariants()


def test_empty_requests_are_no_ops(make_store):
    store = make_store(gpu_blocks=2, cpu_blocks=2, disk_blocks=4)
    empty = torch.empty((0, *SPEC.block_shape))
    assert store.store([], empty) == 0
    assert store.lookup([]).num_hit_blocks == 0 and store.lookup([], pin=True).lease is None
    assert store.load([]).block_ids == []
    assert store.prefetch([]).wait().block_ids == []
    handle = store.prepare_store([])
    store.complete_store(handle)
    store.check_invariants()


@pytest.mark.parametrize("bad_hash", [12345, "a-str-hash", b"", b"x" * 600], ids=["int", "str", "empty", "600B"])
def test_bad_block_hash_is_refused_at_store_not_raised_by_a_later_spill(tmp_path, opened, bad_hash):
    store = opened(open_store(tmp_path, gpu=2, disk=16))
    refused = False
    try:
        store.store([bad_hash], random_blocks(SPEC, 1))
    except (TypeError, ValueError) as exc:
        refused = "expected" in str(exc)
    for r in range(3):  # other requests: their stores spill older blocks to DISK (today: they raise)
        assert store.store(chain(2, SPEC, NS, start=100 * (r + 1)), random_blocks(SPEC, 2, seed=r)) == 2
    store.check_invariants()
    assert refused, "a bad hash must be refused at the call with an 'expected ..., got ...' error"


def test_duplicate_hash_in_one_load_does_not_raise_or_leak_a_pending_slot(make_store):
    store = make_store(gpu_blocks=4, cpu_blocks=4)
    (h,) = chain(1, SPEC, NS)
    block = random_blocks(SPEC, 1, seed=3)
    store.store([h], block)
    store.store(chain(4, SPEC, NS, start=100), random_blocks(SPEC, 4))  # h spills to CPU
    assert store.medium_of(h) is Medium.CPU
    store.load([h, h]).lease.release()
    store.check_invariants()
    n, out = read_back(store, [h])
    assert n == 1 and torch.equal(out, block)


def test_duplicate_hash_in_one_store_request_stores_it_once(make_store):
    store = make_store(gpu_blocks=4)
    (h,) = chain(1, SPEC, NS)
    blocks = random_blocks(SPEC, 2)
    assert store.store([h, h], blocks) >= 1
    n, out = read_back(store, [h])
    assert n == 1 and torch.equal(out, blocks[:1])
    store.check_invariants()


@pytest.mark.parametrize("bad_namespace", ["n" * 32, b"n" * 31, bytearray(32), None], ids=["str", "31B", "bytearray", "None"])
def test_non_bytes_namespace_is_refused_at_construction(tmp_path, opened, bad_namespace):
    """Refused at the call: a store built with it would write it into every DISK record (and
    spill, the first time, with a namespace the records cannot hold)."""
    config = config_in_blocks(tmp_path, gpu=1, disk=8)
    with pytest.raises(ValueError, match="expected a namespace of 32 bytes"):
        opened(TieredStore(SPEC, config, bad_namespace, device="cpu"))
    assert not (tmp_path / "disk").exists()  # refused before anything was opened