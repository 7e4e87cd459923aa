"""The store with a REMOTE tier: lookups extend past the local tiers, loads bring REMOTE
blocks up verified, new blocks are put in the background, a down remote is only misses."""

from __future__ import annotations

import torch

from kvtier.records import ReadStatus
from kvtier.types import Medium
from tests.conftest import MemoryRemote, chain, random_blocks, tiny_spec


def test_second_store_hits_blocks_another_store_put(make_store, namespace, tmp_path):
    remote = MemoryRemote()
    spec = tiny_spec()
    a = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "a")
    b = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "b")
    hashes, blocks = chain(6, spec, namespace), random_blocks(spec, 6)
    assert a.store(hashes, blocks) == 6
    a.wait_for_writes()
    assert a.stats.stored_blocks[Medium.REMOTE] == 6

    result = b.lookup(hashes)
    assert result.num_hit_blocks == 6 and result.media == [Medium.REMOTE] * 6
    loaded = b.load(hashes)
    assert loaded.sources == [Medium.REMOTE] * 6
    assert torch.equal(b.top.tensor[loaded.block_ids], blocks)
    loaded.lease.release()
    assert b.stats.loaded_blocks[Medium.REMOTE] == 6
    assert b.lookup(hashes).media == [Medium.GPU] * 6  # now local
    b.check_invariants()


def test_remote_extends_a_local_prefix(make_store, namespace, tmp_path):
    remote, spec = MemoryRemote(), tiny_spec()
    hashes, blocks = chain(5, spec, namespace), random_blocks(spec, 5, seed=3)
    a = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "a")
    a.store(hashes, blocks)
    a.wait_for_writes()
    b = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "b")
    b.store(hashes[:2], blocks[:2])
    b.wait_for_writes()
    assert b.lookup(hashes).media == [Medium.GPU] * 2 + [Medium.REMOTE] * 3
    with b.load(hashes).lease:
        pass
    loaded = b.load(hashes)
    assert torch.equal(b.top.tensor[loaded.block_ids], blocks)
    loaded.lease.release()
    b.check_invariants()


def test_corrupt_remote_record_is_a_miss_for_it_and_the_rest(make_store, namespace, tmp_path):
    remote, spec = MemoryRemote(), tiny_spec()
    hashes, blocks = chain(4, spec, namespace), random_blocks(spec, 4, seed=5)
    a = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "a")
    a.store(hashes, blocks)
    a.wait_for_writes()
    key = (namespace, hashes[2])
    value = bytearray(remote.records[key])
    value[-1] ^= 0xFF  # one payload bit
    remote.records[key] = bytes(value)

    b = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "b")
    loaded = b.load(hashes)
    assert loaded.sources == [Medium.REMOTE] * 2
    assert torch.equal(b.top.tensor[loaded.block_ids], blocks[:2])
    loaded.lease.release()
    assert b.stats.load_failures[ReadStatus.CORRUPT.value] == 1
    assert b.lookup(hashes[2:3]).num_hit_blocks == 1  # still remote (not ours to delete)
    b.check_invariants()


def test_down_remote_is_misses_and_counted(make_store, namespace, tmp_path):
    remote, spec = MemoryRemote(), tiny_spec()
    hashes, blocks = chain(3, spec, namespace), random_blocks(spec, 3)
    a = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "a")
    a.store(hashes, blocks)
    a.wait_for_writes()
    remote.down = True
    b = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "b")
    assert b.lookup(hashes).num_hit_blocks == 0
    assert b.load(hashes).block_ids == []
    assert b.store(chain(2, spec, namespace, start=1000), random_blocks(spec, 2)) == 2  # local store still works
    b.wait_for_writes()
    assert b.stats.store_failures["remote_put"] == 2
    remote.down = False
    loaded = b.load(hashes)
    assert loaded.sources == [Medium.REMOTE] * 3
    loaded.lease.release()
    b.check_invariants()


def test_remote_lost_between_lookup_and_load(make_store, namespace, tmp_path):
    """The remote said yes, then the read failed: a miss from there on, slots freed."""
    remote, spec = MemoryRemote(), tiny_spec()
    hashes, blocks = chain(3, spec, namespace), random_blocks(spec, 3)
    a = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "a")
    a.store(hashes, blocks)
    a.wait_for_writes()
    b = make_store(gpu_blocks=8, remote=remote, data_dir=tmp_path / "b")
    handle = b.prefetch(hashes)
    del remote.records[(namespace, hashes[1])]  # may race the read; either way the result is honest
    result = handle.wait()
    assert len(result.block_ids) in (1, 3)
    assert torch.equal(b.top.tensor[result.block_ids], blocks[: len(result.block_ids)])
    result.lease.release()
    b.check_invariants()
    # what did arrive (block 2 reads fine after the hole) is kept, with its exact bytes
    for i, h in enumerate(hashes):
        if h in b.top:
            assert torch.equal(b.top.tensor[b.top.block_id(h)], blocks[i])
    if len(result.block_ids) == 1:  # the read lost the race: its slot was freed
        assert hashes[1] not in b.top


def test_lookup_counts_once_per_request_case_m1(make_store, namespace, tmp_path):
    """Case M1 at store level: 10 blocks asked; 6 local, the remote asked for 4 and has 2;
    the request looked up twice (a retry) is counted once."""
    remote, spec = MemoryRemote(), tiny_spec()
    hashes, blocks = chain(10, spec, namespace), random_blocks(spec, 10)
    a = make_store(gpu_blocks=16, remote=remote, data_dir=tmp_path / "a")
    a.store(hashes[:8], blocks[:8])
    a.wait_for_writes()
    b = make_store(gpu_blocks=16, remote=remote, data_dir=tmp_path / "b")
    b.store(hashes[:6], blocks[:6])
    b.wait_for_writes()
    for _ in range(2):
        assert b.lookup(hashes, request_id="req-1").num_hit_blocks == 8
    s = b.stats
    assert (s.lookup_blocks, s.hit_blocks[Medium.GPU], s.remote_lookup_blocks, s.hit_blocks[Medium.REMOTE]) == (10, 6, 4, 2)
    with b.load(hashes, request_id="req-1").lease:
        pass
    assert (s.lookup_blocks, s.hit_blocks[Medium.GPU], s.remote_lookup_blocks, s.hit_blocks[Medium.REMOTE]) == (10, 6, 4, 2)
    assert s.loaded_blocks[Medium.REMOTE] == 2


def test_register_conflict_raises_and_closes(make_store, namespace, tmp_path):
    remote = MemoryRemote()
    make_store(gpu_blocks=4, remote=remote, data_dir=tmp_path / "a")
    import pytest

    with pytest.raises(ValueError):
        make_store(gpu_blocks=4, remote=remote, spec=tiny_spec(dtype=torch.float16), data_dir=tmp_path / "b")


def test_remote_below_all_local_tiers_and_restart(make_store, namespace, tmp_path):
    """GPU+CPU+DISK+REMOTE: blocks spilled to DISK stay local hits; a new process on an empty
    data dir gets the same bytes from REMOTE; closing waits for the background puts."""
    remote, spec = MemoryRemote(), tiny_spec()
    hashes, blocks = chain(12, spec, namespace), random_blocks(spec, 12, seed=9)
    a = make_store(gpu_blocks=2, cpu_blocks=2, disk_blocks=16, remote=remote, data_dir=tmp_path / "a")
    assert a.store(hashes, blocks) == 12
    a.close()
    assert len(remote.records) == 12
    b = make_store(gpu_blocks=16, cpu_blocks=2, disk_blocks=4, remote=remote, data_dir=tmp_path / "b")
    loaded = b.load(hashes)
    assert loaded.sources == [Medium.REMOTE] * 12
    assert torch.equal(b.top.tensor[loaded.block_ids], blocks)
    loaded.lease.release()
    b.check_invariants()


def test_a_load_that_is_not_a_lookup_is_not_counted(make_store, namespace, tmp_path):
    """The daemon's /get follows the client's /lookup: its load passes count=False, so the
    daemon counts each block asked once (M1)."""
    spec = tiny_spec()
    store = make_store(gpu_blocks=8, data_dir=tmp_path / "d")
    hashes = chain(4, spec, namespace)
    store.store(hashes, random_blocks(spec, 4))
    store.lookup(hashes)
    with store.load(hashes, count=False).lease:
        pass
    assert store.stats.lookup_blocks == 4 and store.stats.hit_blocks[Medium.GPU] == 4
    assert store.stats.loaded_blocks[Medium.GPU] == 4


def _interleaved_store(make_store, namespace, data_dir, hashes, blocks):
    """A store whose blocks 0-1 and 4-5 are local (GPU) and 2-3 and 6-7 only on its REMOTE."""
    remote = MemoryRemote()
    store = make_store(gpu_blocks=8, remote=remote, data_dir=data_dir)
    for part in (slice(2, 4), slice(6, 8)):
        assert remote.put(namespace, hashes[part], list(blocks[part])) == [True, True]
    for part in (slice(0, 2), slice(4, 6)):
        assert store.store(hashes[part], blocks[part]) == 2
    store.wait_for_writes()
    for h in hashes[0:2] + hashes[4:6]:
        del remote.records[(namespace, h)]  # the background puts: keep REMOTE's part apart
    return store


def _lookup_counts(store) -> dict:
    s = store.stats
    return {"lookup": s.lookup_blocks, "remote_lookup": s.remote_lookup_blocks, "hits": dict(s.hit_blocks)}


def test_lookup_and_prefetch_of_one_chain_count_the_same(make_store, namespace, tmp_path):
    """One lookup path counts (the hit rate users see): lookup() and prefetch() of the same
    chain in identical stores give identical stats, REMOTE rounds included (local, REMOTE,
    local, REMOTE: the REMOTE tier is asked twice, 6 blocks then 2)."""
    spec = tiny_spec()
    hashes, blocks = chain(8, spec, namespace), random_blocks(spec, 8, seed=11)
    looked = _interleaved_store(make_store, namespace, tmp_path / "a", hashes, blocks)
    fetched = _interleaved_store(make_store, namespace, tmp_path / "b", hashes, blocks)
    before = _lookup_counts(looked)
    assert before == _lookup_counts(fetched)

    result = looked.lookup(hashes, request_id="r1")
    assert result.media == [Medium.GPU] * 2 + [Medium.REMOTE] * 2 + [Medium.GPU] * 2 + [Medium.REMOTE] * 2
    loaded = fetched.prefetch(hashes, request_id="r1").wait()
    counts = _lookup_counts(looked)
    assert counts == _lookup_counts(fetched)
    assert loaded.sources == result.media  # and the prefetch loads all of what it counted
    assert torch.equal(fetched.top.tensor[loaded.block_ids], blocks)
    loaded.lease.release()
    assert counts["lookup"] - before["lookup"] == 8
    assert counts["remote_lookup"] - before["remote_lookup"] == 6 + 2
    assert counts["hits"][Medium.GPU] - before["hits"].get(Medium.GPU, 0) == 4
    assert counts["hits"][Medium.REMOTE] - before["hits"].get(Medium.REMOTE, 0) == 4
    # the same request again (a retried schedule) counts once, through either call (case M1)
    looked.prefetch(hashes, request_id="r1").wait().lease.release()
    fetched.lookup(hashes, request_id="r1")
    assert _lookup_counts(looked) == _lookup_counts(fetched) == counts
    looked.check_invariants()
    fetched.check_invariants()
