"""kvtier's HiCache backend driven as SGLang drives it: created by SGLang's own
StorageBackendFactory from a real HiCacheStorageConfig, keys from SGLang's get_hash_str, pages
moved by the HiCacheController's own page functions (zero-copy v1 and generic paths) into host
pools with SGLang's own layouts, for MHA and MLA."""

from __future__ import annotations

import lmdb
import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvtier.connectors.sglang import KVTierStorage  # noqa: E402
from kvtier.types import Medium  # noqa: E402
from tests.sglang.conftest import PAGE_SIZE, fill_random, new_host_pool, page_keys, pages, storage_config  # noqa: E402
from tests.sglang.sglang_source import controller  # noqa: E402

pytestmark = pytest.mark.sglang

LAYOUTS = [("MHA", "layer_first"), ("MHA", "page_first"), ("MHA", "page_first_direct"), ("MHA", "page_head"),
           ("MLA", "layer_first"), ("MLA", "page_first"), ("MLA", "page_first_direct")]


def tokens(num_pages: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_pages * PAGE_SIZE))


def backup(ctrl, token_ids: list[int], host_indices: torch.Tensor) -> int:
    """The backup thread's write of one operation; returns tokens written."""
    keys = get_storage_hash_str(token_ids, None, page_size=PAGE_SIZE)
    op = ctrl.StorageOperation(host_indices, token_ids, hash_value=keys)
    ctrl._page_backup(op)
    return op.completed_tokens


def prefetch(ctrl, host, token_ids: list[int]) -> tuple[int, int, torch.Tensor]:
    """The prefetch thread's hit query, then the I/O thread's read of the hit pages into new
    host slots: ``(hit tokens, pages read, host indices)``."""
    op = ctrl.PrefetchOperation("req", token_ids)
    keys, hit_tokens = ctrl._storage_hit_query(op)
    host_indices = host.alloc(len(keys) * PAGE_SIZE)
    read = ctrl._page_transfer_kv_batch(op, keys, host_indices, HiCacheStorageExtraInfo(), []) if keys else 0
    return hit_tokens, read, host_indices


def token_kv(pool, kind: str, t: int) -> torch.Tensor:
    """Token ``t``'s K/V for every layer, read from the raw buffer: MHA ``[L, 2, H, D]``, MLA
    ``[L, 1, D]`` (independent of the backend's own page views)."""
    kv, ps, layout = pool.kv_buffer, pool.page_size, pool.layout
    if kind == "MHA":
        return {
            "layer_first": lambda: kv[:, :, t].transpose(0, 1),
            "page_first": lambda: kv[:, t].transpose(0, 1),
            "page_first_direct": lambda: kv[:, t // ps, :, t % ps].transpose(0, 1),
            "page_head": lambda: kv[:, t // ps, :, t % ps].permute(2, 0, 1, 3),
        }[layout]()
    return {"layer_first": lambda: kv[:, t], "page_first": lambda: kv[t],
            "page_first_direct": lambda: kv[t // ps, :, t % ps]}[layout]()


def test_sglang_factory_loads_it_as_a_dynamic_backend(make_backend) -> None:
    host = new_host_pool()
    backend = make_backend(host)
    assert type(backend) is KVTierStorage and isinstance(backend, HiCacheStorage)
    assert not getattr(KVTierStorage, "__abstractmethods__", None)
    assert backend.layout.spec.block_shape == (2, 2, PAGE_SIZE, 2, 8)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_controller_backup_then_prefetch_gives_the_same_pages(make_backend, kind, layout, zero_copy) -> None:
    dtype = torch.bfloat16 if layout == "page_first" else torch.float32
    writer_pool, reader_pool = new_host_pool(kind, layout, dtype=dtype), new_host_pool(kind, layout, dtype=dtype)
    backend = make_backend(writer_pool, is_mla=kind == "MLA", interface_v1=int(zero_copy))
    ids = tokens(6)
    src = writer_pool.alloc(6 * PAGE_SIZE)
    fill_random(writer_pool, src, seed=1)
    assert backup(controller(backend, writer_pool, zero_copy), ids, src) == 6 * PAGE_SIZE

    backend.register_mem_pool_host(reader_pool)  # another engine's host pool, same store
    reader_pool.alloc(3 * PAGE_SIZE)  # the reads land at other slots than the writes came from
    hit_tokens, read, dst = prefetch(controller(backend, reader_pool, zero_copy), reader_pool, ids + [7, 7])
    assert (hit_tokens, read) == (6 * PAGE_SIZE, 6)
    assert all(torch.equal(a, b) for a, b in zip(pages(writer_pool, src), pages(reader_pool, dst)))


def test_a_page_first_engine_reads_what_a_layer_first_engine_wrote(make_backend) -> None:
    lf, pf = new_host_pool("MHA", "layer_first"), new_host_pool("MHA", "page_first_direct")
    backend = make_backend(lf)
    src = lf.alloc(3 * PAGE_SIZE)
    fill_random(lf, src, seed=2)
    assert backup(controller(backend, lf, True), tokens(3), src) == 3 * PAGE_SIZE
    backend.register_mem_pool_host(pf)
    pf.alloc(PAGE_SIZE)
    _, read, dst = prefetch(controller(backend, pf, True), pf, tokens(3))
    assert read == 3
    for i in range(3 * PAGE_SIZE):
        assert torch.equal(token_kv(lf, "MHA", int(src[i])), token_kv(pf, "MHA", int(dst[i])))


def test_generic_path_reads_what_sglangs_file_backend_reads(make_backend, tmp_path) -> None:
    """Same pages through SGLang's own HiCacheFile and through kvtier, both on the generic
    (flat page) path: byte-identical host pages."""
    host = new_host_pool("MHA", "page_first")
    src = host.alloc(4 * PAGE_SIZE)
    fill_random(host, src, seed=3)
    file_backend = HiCacheFile(storage_config(tmp_path, file_storage_path=str(tmp_path / "file")),
                               file_path=str(tmp_path / "file"))
    kvtier = make_backend(host, interface_v1=0)
    results = []
    for backend in (file_backend, kvtier):
        ctrl = controller(backend, host, zero_copy=False)
        assert backup(ctrl, tokens(4), src) == 4 * PAGE_SIZE
        _, read, dst = prefetch(ctrl, host, tokens(4))
        assert read == 4
        results.append(pages(host, dst))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert all(torch.equal(a, b) for a, b in zip(results[0], pages(host, src)))


def test_batch_exists_is_the_longest_stored_prefix(make_backend) -> None:
    host = new_host_pool()
    backend = make_backend(host)
    keys = page_keys(8)
    idx = host.alloc(8 * PAGE_SIZE)
    fill_random(host, idx, seed=4)
    assert backend.batch_set_v1(keys[:3] + keys[4:6], torch.cat([idx[: 3 * PAGE_SIZE], idx[4 * PAGE_SIZE : 6 * PAGE_SIZE]])) == [True] * 5
    assert backend.batch_exists(keys) == 3  # page 3 is missing: pages 4, 5 cannot be used
    assert backend.batch_exists(keys[4:6]) == 2
    assert backend.batch_exists(page_keys(8, start=1000)) == 0
    assert backend.exists(keys[0]) and not backend.exists(keys[3])
    assert backend.batch_get_v1(keys, host.alloc(8 * PAGE_SIZE)) == [True] * 3 + [False] * 5


def test_other_model_rank_or_salt_misses(make_backend, tmp_path) -> None:
    host = new_host_pool()
    keys, idx = page_keys(3), host.alloc(3 * PAGE_SIZE)
    fill_random(host, idx, seed=5)
    root = tmp_path / "root"
    first = make_backend(host, data_dir=root)
    assert first.batch_set_v1(keys, idx) == [True] * 3
    with pytest.raises(RuntimeError, match="in use"):  # one process per DISK directory
        make_backend(new_host_pool(), data_dir=root)
    others = [make_backend(new_host_pool(), data_dir=root, model_name="org/other"),
              make_backend(new_host_pool(), data_dir=root, tp_rank=1, tp_size=2),
              make_backend(new_host_pool(), data_dir=root, cache_salt="tenant-b"),
              make_backend(new_host_pool(dtype=torch.float16), data_dir=root)]
    assert len({first.namespace, *(b.namespace for b in others)}) == 5
    assert [b.batch_exists(keys) for b in others] == [0, 0, 0, 0]


def test_pages_beyond_the_cpu_pool_go_through_in_chunks(make_backend) -> None:
    host = new_host_pool(num_pages=40)
    backend = make_backend(host, cpu_bytes=4 * 2 * 2 * PAGE_SIZE * 2 * 8 * 4)  # 4 pages
    assert backend.store.top.num_blocks == 4
    keys, src = page_keys(12), host.alloc(12 * PAGE_SIZE)
    fill_random(host, src, seed=6)
    assert backend.batch_set_v1(keys, src) == [True] * 12
    dst = host.alloc(12 * PAGE_SIZE)
    assert backend.batch_get_v1(keys, dst) == [True] * 12
    assert all(torch.equal(a, b) for a, b in zip(pages(host, src), pages(host, dst)))


def test_reopened_backend_hits_from_disk(make_backend, tmp_path) -> None:
    host = new_host_pool()
    keys, src = page_keys(5), host.alloc(5 * PAGE_SIZE)
    fill_random(host, src, seed=7)
    first = make_backend(host, data_dir=tmp_path / "d")
    assert first.batch_set_v1(keys, src) == [True] * 5
    first.close()
    again = make_backend(host, data_dir=tmp_path / "d")
    assert again.batch_exists(keys) == 5
    dst = host.alloc(5 * PAGE_SIZE)
    assert again.batch_get_v1(keys, dst) == [True] * 5
    assert again.store.stats.loaded_blocks[Medium.DISK] == 5
    assert all(torch.equal(a, b) for a, b in zip(pages(host, src), pages(host, dst)))


def test_corrupt_record_is_a_miss_from_there_on(make_backend, tmp_path) -> None:
    host = new_host_pool()
    keys, src = page_keys(4), host.alloc(4 * PAGE_SIZE)
    fill_random(host, src, seed=8)
    first = make_backend(host, data_dir=tmp_path / "d")
    assert first.batch_set_v1(keys, src) == [True] * 4
    first.close()
    from kvtier.connectors.sglang.keys import block_hashes

    env = lmdb.open(str(first.data_dir / "disk"), writemap=True, max_dbs=0)
    with env.begin(write=True) as txn:
        key = block_hashes(first.namespace, keys[2:3])[0]
        value = bytearray(txn.get(key))
        value[-5] ^= 0x40  # one payload bit
        txn.put(key, bytes(value))
    env.close()
    again = make_backend(host, data_dir=tmp_path / "d")
    dst = host.alloc(4 * PAGE_SIZE)
    assert again.batch_get_v1(keys, dst) == [True, True, False, False]
    got = pages(host, dst)
    assert torch.equal(got[1], pages(host, src)[1]) and torch.isnan(got[2]).all() and torch.isnan(got[3]).all()
    assert sum(again.store.stats.load_failures.values()) == 1
    assert again.batch_exists(keys) == 2  # the bad record was dropped


def test_a_page_stored_under_another_keys_fingerprint_is_never_served(make_backend) -> None:
    """Issue 11, item 5: a record under the right block hash whose token fingerprint is
    another page key's (a collision or a forging writer) is a miss counted token_mismatch."""
    from kvtier.connectors.sglang.keys import block_keys

    host = new_host_pool()
    keys, other = page_keys(3), page_keys(3, start=1000)
    backend = make_backend(host)
    hashes, _ = block_keys(backend.namespace, keys)
    _, other_fps = block_keys(backend.namespace, other)
    blocks = torch.randn((3, *backend.layout.spec.block_shape)).to(backend.layout.spec.dtype)
    assert backend.store.store(hashes, blocks, other_fps) == 3
    assert backend.batch_exists(keys) == 3  # the hashes are there...
    dst = host.alloc(3 * PAGE_SIZE)
    assert backend.batch_get_v1(keys, dst) == [False] * 3  # ...but never served
    assert backend.store.stats.load_failures["token_mismatch"] == 1


def test_bad_calls_are_misses_never_exceptions(make_backend, tmp_path) -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    unregistered = StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path / "u"), None)
    keys = page_keys(2)
    assert unregistered.batch_exists(keys) == 0 and unregistered.batch_get_v1(keys, torch.arange(8)) == [False] * 2
    host = new_host_pool()
    backend = make_backend(host)
    assert backend.batch_set_v1(keys, host.alloc(PAGE_SIZE)) == [False, False]  # one page of indices for two keys
    assert backend.batch_set_v1(keys, torch.arange(1, 2 * PAGE_SIZE + 1)) == [False, False]  # not page-aligned
    assert backend.batch_exists([b"not a str"]) == 0
    assert backend.batch_set(keys, [torch.zeros(3), torch.zeros(3)]) is False
    assert backend.get(keys[0], torch.zeros(3)) is None
    assert sum(backend.errors.values()) == 5


@pytest.mark.parametrize("layout", ["page_unified", "page_first_kv_split"])
def test_unsupported_host_layouts_are_refused_at_attach(make_backend, layout) -> None:
    host = new_host_pool()
    host.layout = layout
    with pytest.raises(ValueError, match="host layouts"):
        make_backend(host)


def test_hybrid_model_pools_and_mla_without_remote_on_several_ranks_are_refused(make_backend, tmp_path) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    host = new_host_pool()
    backend = make_backend(host)
    backend.register_mem_host_pool_v2(host, PoolName.KV)  # the KV pool itself is fine
    with pytest.raises(ValueError, match="mamba"):
        backend.register_mem_host_pool_v2(new_host_pool(), PoolName.MAMBA)
    with pytest.raises(ValueError, match="REMOTE"):
        KVTierStorage(storage_config(tmp_path, is_mla=True, tp_size=2, tp_rank=1))
    with pytest.raises(ValueError, match="unknown kvtier keys"):
        KVTierStorage(storage_config(tmp_path, disk_byte="1GiB"))


def test_pages_acknowledged_at_a_full_disk_stay_readable(make_backend) -> None:
    """Regression: the store sizes a write-through's DISK evictions from the usage it sees,
    which did not count a write still in flight; two in flight at a full DISK made the second
    fail as "full" after SGLang was told the pages were stored."""
    from kvtier.tiers.disk import record_footprint

    host = new_host_pool(num_pages=16)
    page_nbytes = 2 * 2 * PAGE_SIZE * 2 * 8 * 4
    backend = make_backend(host, cpu_bytes=4 * page_nbytes, disk_bytes=6 * record_footprint(page_nbytes))
    src = host.alloc(6 * PAGE_SIZE)
    for round_index in range(4):  # each round: 6 new pages, evicting the last round's
        keys = page_keys(6, start=1000 * round_index)
        fill_random(host, src, seed=round_index)
        assert backend.batch_set_v1(keys, src) == [True] * 6
        backend.store.wait_for_writes()
        assert backend.batch_exists(keys) == 6, f"round {round_index}"
    assert not backend.store.stats.store_failures


def test_clear_empties_memory_and_disk_and_the_backend_keeps_serving(make_backend, tmp_path) -> None:
    host = new_host_pool()
    keys, src = page_keys(4), host.alloc(4 * PAGE_SIZE)
    fill_random(host, src, seed=9)
    backend = make_backend(host, data_dir=tmp_path / "d")
    store = backend.store
    assert backend.batch_set_v1(keys, src) == [True] * 4
    store.flush()
    assert backend.clear() is True
    assert backend.store is store  # the same store, open: threads using it meanwhile are fine
    assert {tier: u["blocks"] for tier, u in store.usage().items()} == {"CPU": 0, "DISK": 0}
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, src) == [True] * 4
    dst = host.alloc(4 * PAGE_SIZE)
    assert backend.batch_get_v1(keys, dst) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(pages(host, src), pages(host, dst)))
    backend.close()
    assert make_backend(host, data_dir=tmp_path / "d").batch_exists(keys) == 4  # stored after the clear
