"""The HF connector's block layouts: head-major (``LKVHTD``, the default of ``from_model``)
and token-major (``LKVTHD``) both give back, bit for bit, the K/V the model computed, from
every tier and through every gather path; the layout is in the namespace, so a block stored
in one layout is never served as the other."""

from __future__ import annotations

import lmdb
import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_cache import cache_layers
from kvtier.records import ReadStatus
from kvtier.store import prefetch
from kvtier.types import KV_LAYOUT, KV_LAYOUT_HEAD_MAJOR, Medium
from kvtier.wire import spec_from_wire, spec_to_wire
from tests.conftest import flip_byte, patch_record

BLOCK = 16


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def config(tmp_path, **kwargs) -> StoreConfig:
    fields = dict(gpu_bytes=0, cpu_bytes=4 << 20, disk_bytes=64 << 20, block_size=BLOCK, data_dir=tmp_path)
    return StoreConfig(**{**fields, **kwargs})


def connector(model, cfg: StoreConfig, head_major: bool = True, **kwargs) -> HFConnector:
    return HFConnector.from_model(model, cfg, model_id="tiny-llama", model_revision="r1", head_major=head_major, **kwargs)


def full_forward(model, ids: torch.Tensor):
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    return cache_layers(getattr(out, "cache", None) or out.past_key_values)


def assert_exact(plan, model, ids: torch.Tensor, num_tokens: int) -> None:
    """The hit's K/V equal the full forward's, bit for bit, and are contiguous tensors."""
    assert plan.num_cached_tokens == num_tokens
    keys, values = cache_layers(plan.cache)
    full_keys, full_values = full_forward(model, ids)
    assert len(keys) == len(full_keys) == 3
    for k, v, fk, fv in zip(keys, values, full_keys, full_values):
        assert k.is_contiguous() and v.is_contiguous()
        assert torch.equal(k, fk[:, :, :num_tokens]) and torch.equal(v, fv[:, :, :num_tokens])


def store_prompt(kv: HFConnector, model, ids: torch.Tensor) -> None:
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    kv.after_request(ids[0], getattr(out, "cache", None) or out.past_key_values)


def test_from_model_keys_the_head_major_layout(model, tmp_path):
    head, token = connector(model, config(tmp_path / "a")), connector(model, config(tmp_path / "b"), head_major=False)
    assert head.store.spec.head_major and head.key_context.kv_layout == KV_LAYOUT_HEAD_MAJOR
    assert head.store.spec.block_shape == (3, 2, 2, BLOCK, 16)
    assert not token.store.spec.head_major and token.key_context.kv_layout == KV_LAYOUT
    assert head.namespace != token.namespace
    ids = prompt(40)
    assert head.block_hashes(ids[0]) != token.block_hashes(ids[0])
    assert spec_from_wire(spec_to_wire(head.store.spec)) == head.store.spec  # REMOTE registers the same spec
    head.close()
    token.close()


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("tier", ["CPU", "DISK", "GPU (emulated)", "CPU, no kept buffer", "DISK, no kept buffer"])
def test_a_hit_gives_back_the_models_kv_bit_for_bit(model, tmp_path, head_major, tier):
    """CPU and DISK: the host path (HostHitBuffer, gather per landed chunk); an emulated GPU
    pool, or no kept buffer: LayerGather, layer by layer, into per-layer tensors."""
    emulate = tier == "GPU (emulated)"
    kept = {"hit_buffer_bytes": 0} if "no kept buffer" in tier else {}
    cfg = config(tmp_path, gpu_bytes=4 << 20 if emulate else 0)
    ids = prompt(7 * BLOCK + 3, seed=1)
    kv = connector(model, cfg, head_major, emulate_gpu=emulate, **kept)
    store_prompt(kv, model, ids)
    if tier.startswith("DISK"):
        kv.close()  # flushes to DISK
        kv = connector(model, cfg, head_major, **kept)
    plan = kv.before_prefill(ids)
    assert_exact(plan, model, ids, 7 * BLOCK)
    assert set(plan.sources) == {Medium.DISK if tier.startswith("DISK") else Medium.GPU if emulate else Medium.CPU}
    with torch.inference_mode():  # and the suffix prefill on it picks the full forward's token
        want = model(ids).logits[0, -1].argmax()
        got = model(ids[:, 7 * BLOCK :], **plan.generate_kwargs()).logits[0, -1].argmax()
    assert int(got) == int(want)
    kv.close()


@pytest.mark.parametrize("stored_head_major", [True, False], ids=["head-major stored", "token-major stored"])
def test_a_block_of_the_other_layout_is_never_served(model, tmp_path, stored_head_major):
    """One DISK directory, both layouts: each connector hits its own blocks only (its prompt
    hashes are rooted in its namespace), and a read of the other layout's record under this
    namespace is refused (the record header's namespace, kvtier.records.decode_into)."""
    cfg = config(tmp_path)
    ids = prompt(4 * BLOCK + 1, seed=2)
    writer = connector(model, cfg, stored_head_major)
    store_prompt(writer, model, ids)
    stored_hashes, fingerprints = writer.block_keys(ids[0])
    writer.close()
    reader = connector(model, cfg, not stored_head_major)
    plan = reader.before_prefill(ids)
    own_hashes = reader.block_hashes(ids[0])  # rooted in the reader's namespace: none of the stored ones
    assert not set(own_hashes) & set(stored_hashes)
    assert plan.num_cached_tokens == 0 and reader.store.lookup(own_hashes).num_hit_blocks == 0
    out = torch.empty(reader.store.spec.block_shape)
    assert reader.store.disk.read_into(stored_hashes[0], reader.namespace, out, fingerprints[0]) is ReadStatus.CORRUPT
    reader.close()
    again = connector(model, cfg, stored_head_major)  # the writer's layout still hits
    assert_exact(again.before_prefill(ids), model, ids, 4 * BLOCK)
    again.close()


def test_disk_reads_land_in_chunks_and_a_corrupt_one_ends_the_prefix(model, tmp_path, monkeypatch):
    """DISK reads split into jobs of consecutive blocks (here one block each) are gathered as
    they land; a corrupt record in the middle still ends the hit there, with exact K/V before."""
    cfg = config(tmp_path)
    ids = prompt(6 * BLOCK + 1, seed=3)
    kv = connector(model, cfg)
    store_prompt(kv, model, ids)
    hashes = kv.block_hashes(ids[0])
    kv.close()
    monkeypatch.setattr(prefetch, "_DISK_JOB_NBYTES", 1)
    monkeypatch.setattr(prefetch, "_SINK_JOB_NBYTES", 1)  # reads into the hit buffer too
    kv = connector(model, cfg)
    ticket = kv.prefetch(ids)
    assert len(ticket.handle.read_jobs) == 6 and [sorted(v) for v in ticket.handle.read_jobs.values()] == [[i] for i in range(6)]
    assert_exact(kv.before_prefill(ids, ticket), model, ids, 6 * BLOCK)
    kv.close()
    env = lmdb.open(str(tmp_path / "disk"))
    with env.begin(write=True) as txn:  # flip one payload byte of block 3
        patch_record(txn, hashes[3], flip_byte(-5, 0x10))
    env.close()
    kv = connector(model, cfg)
    plan = kv.before_prefill(ids)
    assert_exact(plan, model, ids, 3 * BLOCK)
    kv.finish_loads()  # the hit read DISK straight into its buffer: published (and counted) now
    assert kv.store.stats.load_failures["corrupt"] == 1
    kv.close()


def test_consecutive_hits_reuse_the_host_buffer_and_a_kept_cache_keeps_its_bytes(model, tmp_path):
    cfg = config(tmp_path, disk_bytes=0)
    a, b = prompt(3 * BLOCK + 1, seed=4), prompt(3 * BLOCK + 1, seed=5)
    kv = connector(model, cfg)
    store_prompt(kv, model, a)
    store_prompt(kv, model, b)
    kept = kv.before_prefill(a)  # the caller keeps this cache: the next hit must not overwrite it
    kept_keys = [k.clone() for k in cache_layers(kept.cache)[0]]
    second = kv.before_prefill(b)
    assert_exact(second, model, b, 3 * BLOCK)
    assert all(torch.equal(k, want) for k, want in zip(cache_layers(kept.cache)[0], kept_keys))
    ptr = cache_layers(kept.cache)[0][0].data_ptr()
    assert cache_layers(second.cache)[0][0].data_ptr() != ptr  # per-layer tensors of its own
    del kept
    third = kv.before_prefill(b)
    assert cache_layers(third.cache)[0][0].data_ptr() == ptr  # freed: reused
    assert_exact(third, model, b, 3 * BLOCK)
    kv.close()
