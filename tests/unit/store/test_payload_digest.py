"""Payload digests (kvtier.records version 3): a record's checksum hashes its header fields and
then its payload's own xxh3-64, which a pool keeps beside each slot where the slot's writer
hashed the bytes on the way (``TieredStore.store``'s copy, a write_down, the daemon's receive);
the records later made of the slot (a DISK spill, a daemon get) then hash 128 bytes, not the
block. A digest that is not the slot's bytes' makes a record that reads back ``CORRUPT``: a
miss, never served."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from kvtier import records
from kvtier.kernels import host_copy
from kvtier.records import HEADER_NBYTES, ReadStatus, decode_into, encode_header, encode_record, parse_header
from kvtier.tiers.pool import BlockPool
from kvtier.types import Medium
from tests.conftest import NS, chain, random_blocks, read_back, tiny_spec

pytestmark = pytest.mark.usefixtures("write_overlap")
SPEC = tiny_spec()
FP = b"\x07" * 32
needs_kernels = pytest.mark.skipif(not host_copy.hashing_available(),
                                   reason="no compiled host kernels with python-xxhash's xxh3: stores hash at spill")


def _xxh3(tensor: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(tensor.contiguous().view(torch.uint8).numpy().reshape(-1))


def _slot_digests(pool, hashes):
    """Each block's (kept digest, xxh3 of its slot's bytes now)."""
    ids = [pool.block_id(h) for h in hashes]
    return [(pool.payload_digest_at(b), _xxh3(pool.tensor[b])) for b in ids]


@pytest.fixture
def payload_hashes(monkeypatch):
    """Counts the blocks hashed whole to make a record header (records.payload_digest calls)."""
    calls = []
    real = records.payload_digest

    def counting(block):
        calls.append(block.numel() * block.element_size())
        return real(block)

    monkeypatch.setattr(records, "payload_digest", counting)
    return calls


# -- the record --------------------------------------------------------------------------------
def test_the_checksum_hashes_the_header_fields_then_the_payloads_digest():
    block = random_blocks(SPEC, 1)[0]
    record = encode_record(NS, block, 7, FP)
    payload = record[HEADER_NBYTES:].tobytes()
    digest = xxhash.xxh3_64_intdigest(payload)
    (checksum,) = struct.unpack_from("<Q", record, HEADER_NBYTES - 8)
    assert checksum == xxhash.xxh3_64_intdigest(record[: HEADER_NBYTES - 8].tobytes() + struct.pack("<Q", digest))
    assert checksum != xxhash.xxh3_64_intdigest(record[: HEADER_NBYTES - 8].tobytes() + payload)  # not version 2's
    assert encode_header(NS, block, 7, FP) == encode_header(NS, block, 7, FP, digest) == record[:HEADER_NBYTES].tobytes()
    running = parse_header(record).digest(record[:HEADER_NBYTES])
    for start in range(0, len(payload), 1000):
        running.update(payload[start : start + 1000])
    assert running.intdigest() == checksum and running.payload_intdigest() == digest


def test_a_header_made_from_another_digest_reads_back_corrupt():
    block = random_blocks(SPEC, 1)[0]
    digest = _xxh3(block)
    payload = block.view(torch.uint8).numpy().tobytes()
    out = torch.empty_like(block)
    assert decode_into(memoryview(encode_header(NS, block, 1, FP, digest) + payload), NS, out) is ReadStatus.OK
    assert torch.equal(out, block)
    wrong = encode_header(NS, block, 1, FP, digest ^ 1) + payload
    assert decode_into(memoryview(wrong), NS, out) is ReadStatus.CORRUPT


def test_a_slots_digest_is_forgotten_when_the_slot_is_allocated_freed_or_cleared():
    pool = BlockPool(Medium.CPU, SPEC, 4 * SPEC.block_nbytes)
    hs = chain(4, SPEC, NS)
    b = pool.allocate(hs[0])
    assert pool.payload_digest_at(b) is None
    pool.set_payload_digest(b, 5)
    assert pool.payload_digest_at(b) == 5
    pool.free(hs[0])
    assert pool.payload_digest_at(b) is None
    pool.set_payload_digest(b, 6)  # a stale digest on a free slot (never: but allocate forgets it)
    assert pool.allocate(hs[1]) == b and pool.payload_digest_at(b) is None
    c = pool.allocate(hs[2])
    pool.set_payload_digest(b, 7)
    pool.set_payload_digest(c, 8)
    held = pool.clear(hold=[hs[2]])
    assert pool.payload_digest_at(b) is None and pool.payload_digest_at(c) == 8  # held: still being read
    pool.release_slot(held[hs[2]])
    assert pool.payload_digest_at(c) is None


# -- the store ---------------------------------------------------------------------------------
def _full_slab(make_store, cpu=8, disk=32):
    store = make_store(gpu_blocks=0, cpu_blocks=cpu, disk_blocks=disk)
    old, old_blocks = chain(cpu, SPEC, NS, start=10_000), random_blocks(SPEC, cpu, seed=1)
    assert store.store(old, old_blocks) == cpu
    assert store.top.num_free == 0
    return store, old, old_blocks


def _disk_blocks(store, hashes):
    out = torch.empty((len(hashes), *SPEC.block_shape), dtype=SPEC.dtype)
    return [store.disk.read_into(h, NS, out[i]) for i, h in enumerate(hashes)], out


@needs_kernels
def test_store_keeps_each_slots_digest_and_its_spill_hashes_no_block(make_store, payload_hashes):
    store, old, old_blocks = _full_slab(make_store)
    kept = _slot_digests(store.top, old)
    assert all(d is not None and d == actual for d, actual in kept)
    new, new_blocks = chain(8, SPEC, NS), random_blocks(SPEC, 8, seed=2)
    assert store.store(new, new_blocks) == 8  # every old block spills; the new ones refill their slots
    assert payload_hashes == []
    statuses, on_disk = _disk_blocks(store, old)
    assert statuses == [ReadStatus.OK] * 8 and torch.equal(on_disk, old_blocks)
    assert all(d is not None and d == actual for d, actual in _slot_digests(store.top, new))
    n, out = read_back(store, new)
    assert n == 8 and torch.equal(out, new_blocks)
    store.check_invariants()


def test_without_the_kernels_the_spill_hashes_each_victim(make_store, payload_hashes, monkeypatch):
    monkeypatch.setattr(host_copy, "hashing_available", lambda: False)
    store, old, old_blocks = _full_slab(make_store)
    assert [d for d, _ in _slot_digests(store.top, old)] == [None] * 8
    assert store.store(chain(8, SPEC, NS), random_blocks(SPEC, 8, seed=2)) == 8
    assert payload_hashes == [SPEC.block_nbytes] * 8
    statuses, on_disk = _disk_blocks(store, old)
    assert statuses == [ReadStatus.OK] * 8 and torch.equal(on_disk, old_blocks)


def test_a_write_that_returns_no_digests_leaves_them_unknown(make_store, payload_hashes):
    store = make_store(gpu_blocks=0, cpu_blocks=8, disk_blocks=32)
    old, old_blocks = chain(8, SPEC, NS, start=10_000), random_blocks(SPEC, 8, seed=1)

    def write(indices, block_ids):  # a connector's own copy
        for i, b in zip(indices, block_ids):
            store.top.tensor[b].copy_(old_blocks[i])

    assert store.store_with(old, write) == 8
    assert [d for d, _ in _slot_digests(store.top, old)] == [None] * 8
    assert store.store(chain(8, SPEC, NS), random_blocks(SPEC, 8, seed=2)) == 8
    assert payload_hashes == [SPEC.block_nbytes] * 8
    statuses, on_disk = _disk_blocks(store, old)
    assert statuses == [ReadStatus.OK] * 8 and torch.equal(on_disk, old_blocks)


def test_a_digest_that_is_not_the_slots_makes_a_miss_never_a_wrong_hit(make_store):
    store, old, old_blocks = _full_slab(make_store)
    store.top.set_payload_digest(store.top.block_id(old[3]), 12345)  # what a stale digest would do
    assert store.store(chain(8, SPEC, NS), random_blocks(SPEC, 8, seed=2)) == 8
    statuses, on_disk = _disk_blocks(store, old)
    assert statuses == [ReadStatus.OK] * 3 + [ReadStatus.CORRUPT] + [ReadStatus.OK] * 4
    assert torch.equal(on_disk[:3], old_blocks[:3]) and torch.equal(on_disk[4:], old_blocks[4:])
    result = store.load(old[:4])
    with result.lease:
        assert len(result.block_ids) == 3  # the hit stops before the corrupt record
        assert torch.equal(store.top.tensor[result.block_ids], old_blocks[:3])
    assert store.stats.load_failures["corrupt"] == 1


@needs_kernels
def test_a_block_written_down_to_the_cpu_pool_keeps_its_digest(make_store, payload_hashes):
    store = make_store(gpu_blocks=4, cpu_blocks=4, disk_blocks=16)  # the GPU pool emulated in host memory
    first, first_blocks = chain(4, SPEC, NS, start=10_000), random_blocks(SPEC, 4, seed=1)
    assert store.store(first, first_blocks) == 4
    assert store.store(chain(4, SPEC, NS), random_blocks(SPEC, 4, seed=2)) == 4  # first -> CPU pool
    cpu = store.pools[1]
    assert all(h in cpu for h in first)
    assert all(d is not None and d == actual for d, actual in _slot_digests(cpu, first))
    assert store.store(chain(4, SPEC, NS, start=20_000), random_blocks(SPEC, 4, seed=3)) == 4  # first -> DISK
    assert payload_hashes == []
    statuses, on_disk = _disk_blocks(store, first)
    assert statuses == [ReadStatus.OK] * 4 and torch.equal(on_disk, first_blocks)
