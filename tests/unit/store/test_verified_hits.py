"""Verified hits (issue 11, item 5): every tier keeps each block's token fingerprint and a load
serves a block only to a request of the same tokens; records of another format version are
misses that age out and never wipe the DISK tier."""

from __future__ import annotations

import hashlib
import struct

import lmdb
import pytest
import torch

from kvtier.hashing import KeyContext, block_hashes_for, block_keys_for, fingerprint_block_tokens
from kvtier.records import HEADER_NBYTES, VERSION, ReadStatus, decode_into, encode_record, record_version
from kvtier.store import TieredStore
from kvtier.testing import MemoryRemote
from kvtier.tiers.disk import DiskTier, record_footprint
from kvtier.types import NO_FINGERPRINT, Medium
from tests.conftest import BLOCK_SIZE, config_in_blocks, random_blocks, tiny_spec

SPEC = tiny_spec()
NS = KeyContext(model_id="test-model", block_size=BLOCK_SIZE).namespace()
TOKENS = list(range(100, 100 + 4 * BLOCK_SIZE))
OTHER = list(range(500, 500 + 4 * BLOCK_SIZE))  # another prompt, same length
HASHES, FPS = block_keys_for(TOKENS, NS, BLOCK_SIZE)
_, OTHER_FPS = block_keys_for(OTHER, NS, BLOCK_SIZE)


def mismatches(store: TieredStore) -> dict:
    return {k: n for k, n in store.stats.load_failures_by_tier.items() if k[1] == "token_mismatch"}


# -- keys ----------------------------------------------------------------------------------------
def test_fingerprints_chain_over_fingerprints_not_over_block_hashes():
    hashes, fps = block_keys_for(TOKENS, NS, BLOCK_SIZE, "xxh3_128")
    assert hashes == block_hashes_for(TOKENS, NS, BLOCK_SIZE, "xxh3_128")
    assert all(len(f) == 32 for f in fps) and len(set(fps)) == 4 and not set(fps) & set(hashes)
    assert fps[0] == fingerprint_block_tokens(NS, TOKENS[:BLOCK_SIZE])
    assert fps[1] == fingerprint_block_tokens(fps[0], TOKENS[BLOCK_SIZE : 2 * BLOCK_SIZE])
    assert fps[1] != fingerprint_block_tokens(hashes[0], TOKENS[BLOCK_SIZE : 2 * BLOCK_SIZE])
    # the same under either block hash function: the fingerprint is always SHA-256
    assert fps == block_keys_for(TOKENS, NS, BLOCK_SIZE, "sha256")[1]
    # a change in block 0 changes every later fingerprint
    changed = [TOKENS[0] + 1] + TOKENS[1:]
    assert all(a != b for a, b in zip(block_keys_for(changed, NS, BLOCK_SIZE)[1], fps))


def test_fingerprints_are_checked_at_the_boundary(make_store):
    store = make_store(gpu_blocks=4)
    with pytest.raises(ValueError, match="one fingerprint per block hash"):
        store.load(HASHES, fingerprints=FPS[:2])
    with pytest.raises(ValueError, match="32 bytes"):
        store.store(HASHES[:1], random_blocks(SPEC, 1), [b"short"])


# -- records -------------------------------------------------------------------------------------
def test_a_record_of_other_tokens_is_token_mismatch_never_ok():
    block = random_blocks(SPEC, 1)[0]
    record = memoryview(encode_record(NS, block, 7, FPS[0]))
    out = torch.empty_like(block)
    assert decode_into(record, NS, out, FPS[0]) is ReadStatus.OK and torch.equal(out, block)
    assert decode_into(record, NS, out) is ReadStatus.OK  # a relay checks no tokens
    assert decode_into(record, NS, out, OTHER_FPS[0]) is ReadStatus.TOKEN_MISMATCH
    damaged = bytearray(record)
    damaged[4 + 2 + 1 + 1 + 32 + 32 + 5] ^= 1  # a bit of the fingerprint field
    assert decode_into(memoryview(damaged), NS, out, FPS[0]) is ReadStatus.CORRUPT  # the checksum covers it


def legacy_record(namespace: bytes, block: torch.Tensor, seq: int = 1) -> bytes:
    """A version-1 record (kvtier before fingerprints: 96-byte header)."""
    import xxhash

    shape = list(block.shape) + [0] * (8 - block.dim())
    header = struct.pack("<4sHBB8I32sQQ", b"KVTB", 1, 3, block.dim(), *shape, namespace,
                         block.numel() * block.element_size(), seq)
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    return header + struct.pack("<Q", xxhash.xxh3_64(header + payload).intdigest()) + payload


def version2_record(namespace: bytes, block: torch.Tensor, seq: int = 1, fingerprint: bytes = b"\0" * 32) -> bytes:
    """A version-2 record (kvtier before the payload digest: the same 128-byte header, its
    checksum the xxh3-64 of the header fields followed by the payload)."""
    import xxhash

    shape = list(block.shape) + [0] * (8 - block.dim())
    header = struct.pack("<4sHBB8I32s32sQQ", b"KVTB", 2, 3, block.dim(), *shape, namespace, fingerprint,
                         block.numel() * block.element_size(), seq)
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    return header + struct.pack("<Q", xxhash.xxh3_64(header + payload).intdigest()) + payload


@pytest.mark.parametrize("version", [1, 2])
def test_another_versions_record_is_other_version_not_corrupt(version):
    block = random_blocks(SPEC, 1)[0]
    value = legacy_record(NS, block) if version == 1 else version2_record(NS, block)
    assert record_version(value) == version and VERSION == 3 and HEADER_NBYTES == 128
    assert decode_into(memoryview(value), NS, torch.empty(SPEC.block_shape)) is ReadStatus.OTHER_VERSION
    if version == 2:  # the same bytes under this version's number: its checksum is not this version's
        current = bytearray(value)
        current[4:6] = struct.pack("<H", VERSION)
        assert decode_into(memoryview(current), NS, torch.empty(SPEC.block_shape)) is ReadStatus.CORRUPT
    assert decode_into(memoryview(b"garbage" * 30), NS, torch.empty(SPEC.block_shape)) is ReadStatus.CORRUPT


# -- GPU and CPU pools ---------------------------------------------------------------------------
def test_a_block_of_other_tokens_in_the_gpu_pool_is_a_miss_counted_token_mismatch(make_store):
    store = make_store(gpu_blocks=8)
    blocks = random_blocks(SPEC, 4)
    store.store(HASHES[:2], blocks[:2], FPS[:2])
    store.store(HASHES[2:], blocks[2:], OTHER_FPS[2:])  # forged: right hashes, other tokens
    result = store.load(HASHES, fingerprints=FPS)
    with result.lease:
        assert result.block_ids and len(result.block_ids) == 2  # the prefix up to the forged block
        assert torch.equal(store.top.tensor[result.block_ids], blocks[:2])
        assert result.fingerprints == FPS[:2]
    assert mismatches(store) == {("GPU", "token_mismatch"): 1}
    assert store.stats.load_failures["token_mismatch"] == 1
    # miss reasons (kvtier.store.misses): the forged block by its own reason, the one after it
    # held but after the gap; prompt tokens = loaded + missed
    assert dict(store.stats.miss_tokens) == {("token_mismatch", "GPU"): BLOCK_SIZE, ("after_gap", "GPU"): BLOCK_SIZE}
    # the block is intact and stays: it serves the tokens it was computed from
    assert store.medium_of(HASHES[2]) is Medium.GPU
    store.check_invariants()


def test_a_block_of_other_tokens_in_the_cpu_pool_is_a_miss(make_store):
    store = make_store(gpu_blocks=2, cpu_blocks=8)
    blocks = random_blocks(SPEC, 4)
    store.store(HASHES, blocks, OTHER_FPS)  # the GPU pool keeps 2: the first 2 spilled to CPU
    assert [store.medium_of(h) for h in HASHES] == [Medium.CPU, Medium.CPU, Medium.GPU, Medium.GPU]
    result = store.load(HASHES, fingerprints=FPS)
    result.lease.release()
    assert result.block_ids == [] and mismatches(store) == {("CPU", "token_mismatch"): 1}
    own = store.load(HASHES, fingerprints=OTHER_FPS)  # its own tokens hit (as much as the top pool holds)
    own.lease.release()
    assert own.fingerprints == OTHER_FPS[:2]


def test_blocks_stored_without_fingerprints_never_serve_a_checked_load(make_store):
    store = make_store(gpu_blocks=4)
    store.store(HASHES, random_blocks(SPEC, 4))  # NO_FINGERPRINT
    assert store.load(HASHES, fingerprints=FPS).block_ids == []
    unchecked = store.load(HASHES)
    assert len(unchecked.block_ids) == 4 and unchecked.fingerprints == [NO_FINGERPRINT] * 4


# -- DISK ----------------------------------------------------------------------------------------
def forge_on_disk(data_dir, index: int, fingerprint: bytes, block: torch.Tensor) -> None:
    """Replace block ``index``'s DISK record by one of other tokens (a valid record, right
    hash, right namespace): what a collision or a forging writer leaves behind."""
    disk = DiskTier(data_dir / "disk", 64 * record_footprint(SPEC.block_nbytes))
    try:
        disk.remove([HASHES[index]])
        assert disk.write_batch([(HASHES[index], NS, block, fingerprint)]) == [True]
    finally:
        disk.close()


def test_a_forged_disk_record_is_a_miss_after_reopening(tmp_path):
    config = config_in_blocks(tmp_path, gpu=4, cpu=0, disk=64, flush_on_close=True)
    blocks = random_blocks(SPEC, 4)
    with TieredStore(SPEC, config, NS, device="cpu") as store:
        assert store.store(HASHES, blocks, FPS) == 4
    forge_on_disk(tmp_path, 2, OTHER_FPS[2], random_blocks(SPEC, 1, seed=5)[0])
    with TieredStore(SPEC, config, NS, device="cpu") as store:
        result = store.load(HASHES, fingerprints=FPS)
        with result.lease:
            assert result.sources == [Medium.DISK, Medium.DISK]
            assert torch.equal(store.top.tensor[result.block_ids], blocks[:2])
        assert mismatches(store) == {("DISK", "token_mismatch"): 1}
        assert store.stats.miss_tokens[("token_mismatch", "DISK")] == BLOCK_SIZE
        assert store.stats.miss_tokens[("failed_verification", "DISK")] == 0
        assert HASHES[2] in store.disk  # intact: not dropped like a corrupt record
        store.check_invariants()


def test_the_disk_read_itself_checks_the_record_not_only_the_index(tmp_path):
    disk = DiskTier(tmp_path / "disk", 16 * record_footprint(SPEC.block_nbytes))
    block = random_blocks(SPEC, 1)[0]
    disk.write_batch([(HASHES[0], NS, block, FPS[0])])
    out = torch.empty_like(block)
    assert disk.read_into(HASHES[0], NS, out, FPS[0]) is ReadStatus.OK
    assert disk.read_into(HASHES[0], NS, out, OTHER_FPS[0]) is ReadStatus.TOKEN_MISMATCH
    disk._fingerprints[HASHES[0]] = OTHER_FPS[0]  # an index that lies: the record still decides
    assert disk.read_into(HASHES[0], NS, out) is ReadStatus.TOKEN_MISMATCH
    disk.close()


def write_raw(path, items) -> None:
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for key, value in items:
            txn.put(key, value)
    env.close()


def test_old_version_records_do_not_wipe_the_disk_tier_and_age_out(tmp_path):
    """A release of another record version opening the directory keeps its records (they
    are misses, counted in used_bytes) and drops them first when it needs room."""
    cap = 6 * record_footprint(SPEC.block_nbytes)
    disk = DiskTier(tmp_path / "disk", cap)
    disk.close()
    old = [hashlib.sha256(f"old{i}".encode()).digest() for i in range(4)]
    write_raw(tmp_path / "disk", [(h, legacy_record(NS, b)) for h, b in zip(old, random_blocks(SPEC, 4))])

    disk = DiskTier(tmp_path / "disk", cap)
    assert len(disk) == 0 and all(h not in disk for h in old)  # misses
    assert disk.foreign_bytes == disk.used_bytes > 0
    assert disk.free_bytes == cap  # they make way for new records
    disk.check()
    disk.close()
    disk = DiskTier(tmp_path / "disk", cap)  # opening again wipes nothing either
    assert disk.foreign_bytes > 0
    blocks = random_blocks(SPEC, 6, seed=3)
    assert disk.write_batch([(h, NS, b, f) for h, b, f in zip(HASHES, blocks, FPS)]) == [True] * 4
    assert disk.used_bytes <= cap and disk.foreign_bytes < 4 * record_footprint(SPEC.block_nbytes)
    disk.check()
    assert disk.write_batch([(OTHER_FPS[i], NS, blocks[4 + i], OTHER_FPS[i]) for i in range(2)]) == [True, True]
    assert disk.foreign_bytes == 0 and len(disk) == 6 and disk.used_bytes <= cap  # aged out, first
    disk.check()
    disk.close()


def test_a_store_on_a_directory_of_old_records_misses_them_and_keeps_working(tmp_path):
    config = config_in_blocks(tmp_path, gpu=4, disk=8)
    (tmp_path / "disk").mkdir(parents=True)
    DiskTier(tmp_path / "disk", config.disk_bytes).close()
    write_raw(tmp_path / "disk", [(HASHES[0], legacy_record(NS, random_blocks(SPEC, 1)[0]))])
    with TieredStore(SPEC, config, NS, device="cpu") as store:
        assert store.lookup(HASHES).num_hit_blocks == 0
        blocks = random_blocks(SPEC, 4)
        assert store.store(HASHES, blocks, FPS) == 4
        store.flush()  # overwrites the old record under HASHES[0]
        assert store.disk.foreign_bytes == 0 and HASHES[0] in store.disk
        store.check_invariants()


# -- REMOTE (in memory) --------------------------------------------------------------------------
def test_a_remote_block_of_other_tokens_is_a_miss_counted_token_mismatch(tmp_path):
    remote = MemoryRemote()
    blocks = random_blocks(SPEC, 4)
    remote.register(NS, SPEC)
    remote.put(NS, HASHES, list(blocks), FPS[:1] + OTHER_FPS[1:])  # blocks 1..3 forged
    config = config_in_blocks(tmp_path, gpu=8, num_io_threads=1)  # one read job: it stops at the first failure
    with TieredStore(SPEC, config, NS, device="cpu", remote=remote) as store:
        result = store.load(HASHES, fingerprints=FPS)
        with result.lease:
            assert result.sources == [Medium.REMOTE]
            assert torch.equal(store.top.tensor[result.block_ids[0]], blocks[0])
        assert mismatches(store) == {("REMOTE", "token_mismatch"): 1}
        assert store.stats.miss_tokens[("token_mismatch", "REMOTE")] == BLOCK_SIZE  # found by the read itself
        assert store.medium_of(HASHES[1]) is None  # never published
        store.check_invariants()


def test_old_version_records_make_room_for_a_stores_spills(tmp_path):
    """A DISK full of another version's records takes this store's spills: the room they
    hold counts as free (free_bytes and free_bytes_after agree), they are dropped first."""
    config = config_in_blocks(tmp_path, gpu=4, disk=4)
    (tmp_path / "disk").mkdir(parents=True)
    DiskTier(tmp_path / "disk", config.disk_bytes).close()
    old = [hashlib.sha256(f"old{i}".encode()).digest() for i in range(4)]
    write_raw(tmp_path / "disk", [(h, legacy_record(NS, b)) for h, b in zip(old, random_blocks(SPEC, 4))])
    with TieredStore(SPEC, config, NS, device="cpu") as store:
        disk = store.disk
        assert disk.foreign_bytes == disk.used_bytes == config.disk_bytes
        assert disk.free_bytes_after([], SPEC.block_nbytes) == disk.free_bytes == config.disk_bytes
        blocks = random_blocks(SPEC, 4)
        assert store.store(HASHES, blocks, FPS) == 4
        store.flush()
        assert [h in disk for h in HASHES] == [True] * 4 and disk.foreign_bytes == 0
        store.check_invariants()
