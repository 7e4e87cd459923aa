"""CUDA ordering of kvtier's transfers: cases G1 and G2, and per-layer prefetch readiness.

What goes wrong on a GPU when a copy is not ordered against the model's work, and the test that
pins it down (each runs once on the default stream and once on a non-default compute stream):

- G1, store after compute: the transfer engine copies a block on its side stream while the
  kernel writing it is still queued on the compute stream, so the copy reads the old bytes.
  ``test_g1_*``: a long matmul, then a fill with 7, then at once the store; 1,000 times.
- G1 reversed: a load overwrites a GPU slot while a queued kernel still reads its old block.
- G2, staging reuse: a pinned CPU slot is reused for the next block before the copy out of it
  finished, so a load returns the previous block. ``test_g2_*``: back-to-back stores and loads
  of different blocks through a one-slot CPU slab (and through DISK staging when lmdb imports).
- Per-layer prefetch: layer ``l`` read after ``PrefetchHandle.wait_layer(l)`` but before the
  whole load finished must already hold the new bytes.

Blocks are poisoned (-1, a sentinel, another block) before each transfer, so a copy that ran
too early shows up as a wrong value rather than as the right value left over from before.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvtier.tiers import disk
from kvtier.transfer.engine import TransferJob
from kvtier.types import BlockHash, KVSpec, Medium
from tests.gpu.conftest import GPU_ONLY

pytestmark = GPU_ONLY

ITERATIONS = 1000
SMALL = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
"""64 KiB blocks: 1,000 round trips stay fast; float32 holds every payload value exactly."""
LARGE = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
"""Llama-3-8B blocks (2 MiB): a prefetch of many takes long enough to read a layer too early."""
SENTINEL = 1e4  # stored as 9984 in bf16: far outside what randn produces


def block_hashes(n: int, tag: str) -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(f"{tag}:{i}".encode()).digest()) for i in range(n)]


def all_equal(t: torch.Tensor, value: float) -> bool:
    return bool((t == value).all())


def needs_lmdb() -> None:
    """Skip unless the DISK tier can open (the device image may have no lmdb)."""
    if disk.lmdb is None:
        pytest.skip("needs lmdb (the DISK tier)")


def settle(device: torch.device) -> None:
    """Finish the set-up queued on the default stream before a test switches to its compute
    stream (that stream does not wait for the default one)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- G1: store after compute -----------------------------------------------------------------
def test_g1_store_after_compute_then_spill_and_load(make_store, device, compute_stream, slow_work):
    """store() right after the fill, spill to the CPU slab, load() back to the GPU: all 7s."""
    store = make_store(SMALL, gpu_blocks=1, cpu_blocks=2)
    keys, fillers = block_hashes(ITERATIONS, "g1"), block_hashes(ITERATIONS, "g1-filler")
    block = torch.empty((1, *SMALL.block_shape), device=device)
    other = torch.zeros_like(block)
    bad = []
    settle(device)
    with compute_stream():
        for i in range(ITERATIONS):
            block.fill_(-1.0)
            slow_work()
            block.fill_(7.0)
            assert store.store([keys[i]], block) == 1
            assert store.store([fillers[i]], other) == 1  # one GPU slot: keys[i] spills to the CPU slab
            assert store.medium_of(keys[i]) is Medium.CPU
            result = store.load([keys[i]])  # CPU -> GPU on the engine's side stream
            with result.lease:
                assert result.sources == [Medium.CPU]
                if not all_equal(store.top.tensor[result.block_ids[0]], 7.0):
                    bad.append(i)
    assert not bad, f"{len(bad)} of {ITERATIONS} loads were not all 7s (first: iteration {bad[0]})"
    store.check_invariants()


def test_g1_offload_on_the_engine_side_stream_waits_for_compute(make_store, device, compute_stream, slow_work):
    """GPU -> CPU through the store's engine (PoolCopyHandler, side stream) right after the
    fill, then CPU -> GPU into another slot: all 7s both ways. Free slots of a fresh store are
    used directly (the engine moves bytes; the index is not involved)."""
    store = make_store(SMALL, gpu_blocks=2, cpu_blocks=1)
    gpu, cpu = store.pool(Medium.GPU), store.pool(Medium.CPU)
    engine, h = store.engine, block_hashes(1, "g1-engine")
    bad_offload, bad_load = [], []
    settle(device)
    with compute_stream():
        for i in range(ITERATIONS):
            cpu.tensor[0].fill_(0.0)  # host write: nothing is in flight between iterations
            gpu.tensor[0].fill_(-1.0)
            gpu.tensor[1].fill_(-1.0)
            slow_work()
            gpu.tensor[0].fill_(7.0)
            job_id = engine.submit(TransferJob(Medium.GPU, Medium.CPU, h, src_ids=[0], dst_ids=[0]))
            assert engine.wait([job_id])[job_id].success
            if not all_equal(cpu.tensor[0], 7.0):
                bad_offload.append(i)
            job_id = engine.submit(TransferJob(Medium.CPU, Medium.GPU, h, src_ids=[0], dst_ids=[1]))
            assert engine.wait([job_id])[job_id].success
            if not all_equal(gpu.tensor[1], 7.0):
                bad_load.append(i)
    assert not bad_offload, f"GPU -> CPU copied stale bytes in {len(bad_offload)} of {ITERATIONS} iterations"
    assert not bad_load, f"CPU -> GPU copied stale bytes in {len(bad_load)} of {ITERATIONS} iterations"


def test_g1_load_waits_for_kernels_reading_the_old_block(make_store, device, compute_stream, slow_work):
    """A kernel queued on the compute stream reads slot 1 (3s); a load into slot 1 submitted
    right after must not land before that read: the snapshot is all 3s, the slot all 7s."""
    store = make_store(SMALL, gpu_blocks=2, cpu_blocks=1)
    gpu, cpu = store.pool(Medium.GPU), store.pool(Medium.CPU)
    engine, h = store.engine, block_hashes(1, "g1-reverse")
    snapshot = torch.empty_like(gpu.tensor[1])
    cpu.tensor[0].fill_(7.0)
    bad = []
    settle(device)
    with compute_stream():
        for i in range(ITERATIONS):
            gpu.tensor[1].fill_(3.0)
            slow_work()
            snapshot.copy_(gpu.tensor[1])  # still queued behind the matmuls
            job_id = engine.submit(TransferJob(Medium.CPU, Medium.GPU, h, src_ids=[0], dst_ids=[1]))
            assert engine.wait([job_id])[job_id].success
            if not (all_equal(snapshot, 3.0) and all_equal(gpu.tensor[1], 7.0)):
                bad.append(i)
    assert not bad, f"a load overwrote a slot under a queued reader in {len(bad)} of {ITERATIONS} iterations"


# -- G2: staging reuse -----------------------------------------------------------------------
def test_g2_staging_reuse_gives_each_load_its_own_block(make_store, device, compute_stream, slow_work):
    """One GPU slot, one CPU slot (the staging): store block i, spill it into the CPU slot,
    load it back; the next iteration rewrites that slot right after the load read it."""
    store = make_store(SMALL, gpu_blocks=1, cpu_blocks=1)
    keys, fillers = block_hashes(ITERATIONS, "g2"), block_hashes(ITERATIONS, "g2-filler")
    payload = torch.empty((1, *SMALL.block_shape), device=device)
    filler = torch.zeros_like(payload)
    wrong: dict[int, float] = {}
    settle(device)
    with compute_stream():
        for i in range(ITERATIONS):
            slow_work()
            payload.fill_(float(i + 1))
            assert store.store([keys[i]], payload) == 1
            assert store.store([fillers[i]], filler) == 1  # keys[i] spills into the only CPU slot
            result = store.load([keys[i]])
            with result.lease:
                assert result.sources == [Medium.CPU]
                got = store.top.tensor[result.block_ids[0]]
                if not all_equal(got, float(i + 1)):
                    wrong[i] = float(got.flatten()[0])
    previous = [i for i, v in wrong.items() if v == float(i)]
    assert not wrong, f"{len(wrong)} loads returned another payload ({len(previous)} the previous one)"
    store.check_invariants()


def test_g2_disk_staging_reuse_with_two_prefetches_in_flight(make_store, device, compute_stream):
    """DISK -> CPU (two staging slots) -> GPU, two prefetches in flight at a time, the same
    two staging slots reused by every pair: each load returns its own block."""
    needs_lmdb()
    n, rounds = 32, ITERATIONS // 32
    store = make_store(SMALL, gpu_blocks=2, cpu_blocks=2, disk_blocks=2 * n)
    keys = block_hashes(n, "g2-disk")
    blocks = torch.arange(1, n + 1, dtype=SMALL.dtype, device=device).view(n, *[1] * 5).expand(n, *SMALL.block_shape)
    assert store.store(keys, blocks.contiguous()) == n
    store.flush()
    for pool in store.pools:  # DISK only from here on
        pool.clear()
    bad, sources = [], []
    settle(device)
    with compute_stream():
        for r in range(rounds):
            order = torch.randperm(n, generator=torch.Generator().manual_seed(r)).tolist()
            for a, b in zip(order[0::2], order[1::2]):
                handles = [(k, store.prefetch([keys[k]])) for k in (a, b)]
                for k, handle in handles:
                    result = handle.wait()
                    with result.lease:
                        assert len(result.block_ids) == 1, f"block {k} did not load"
                        sources += result.sources
                        if not all_equal(store.top.tensor[result.block_ids[0]], float(k + 1)):
                            bad.append((r, k))
    assert not bad, f"{len(bad)} loads returned another block (first: round, block = {bad[0]})"
    # a block still in the CPU slab from an earlier round loads from there: most come from DISK
    assert sources.count(Medium.DISK) >= len(sources) // 2, f"{sources.count(Medium.DISK)} of {len(sources)} from DISK"
    assert store.stats.load_failures == {}
    store.check_invariants()


# -- per-layer prefetch ----------------------------------------------------------------------
def _read_layers_as_they_land(store, block_hashes_: list[BlockHash], device) -> tuple[list[torch.Tensor], list[Medium]]:
    """Prefetch, then per layer: ``wait_layer(l)`` and copy layer ``l`` of the loaded blocks
    out on the current stream. Returns the copies and the blocks' sources."""
    handle = store.prefetch(block_hashes_)
    ids = torch.tensor(handle.block_ids, dtype=torch.int64, device=device)
    layers = []
    for layer in range(store.spec.num_layers):
        handle.wait_layer(layer)
        layers.append(store.top.tensor[ids, layer].clone())
    result = handle.wait()
    result.lease.release()
    assert len(result.block_ids) == len(block_hashes_), "the prefetch came back short"
    return layers, result.sources


def _large_blocks(n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LARGE.block_shape), generator=g).to(LARGE.dtype).to(device)


def test_prefetch_cpu_to_gpu_wait_layer_gives_each_layer_its_bytes(make_store, device, compute_stream):
    n = 32 if device.type == "cuda" else 2
    store = make_store(LARGE, gpu_blocks=n, cpu_blocks=2 * n)
    first, second = block_hashes(n, "layers-a"), block_hashes(n, "layers-b")
    blocks = _large_blocks(n, device)
    assert store.store(first, blocks) == n
    assert store.store(second, torch.full_like(blocks, SENTINEL)) == n  # first spills to the CPU slab
    settle(device)
    with compute_stream():
        layers, sources = _read_layers_as_they_land(store, first, device)  # lands in second's slots
    settle(device)  # the copies out were queued on the compute stream
    assert sources == [Medium.CPU] * n
    for layer, got in enumerate(layers):
        assert torch.equal(got, blocks[:, layer]), f"layer {layer} read before its copy landed"
    store.check_invariants()


def test_prefetch_disk_to_gpu_wait_layer_gives_each_layer_its_bytes(make_store, device, compute_stream):
    needs_lmdb()
    n = 16 if device.type == "cuda" else 2
    store = make_store(LARGE, gpu_blocks=n, cpu_blocks=n, disk_blocks=2 * n)
    keys = block_hashes(n, "layers-disk")
    blocks = _large_blocks(n, device, seed=1)
    assert store.store(keys, blocks) == n
    store.flush()
    for pool in store.pools:
        pool.clear()
    store.top.tensor.fill_(SENTINEL)
    settle(device)
    with compute_stream():
        layers, sources = _read_layers_as_they_land(store, keys, device)
    settle(device)
    assert sources == [Medium.DISK] * n
    for layer, got in enumerate(layers):
        assert torch.equal(got, blocks[:, layer]), f"layer {layer} read before its copy landed"
    store.check_invariants()


# -- the connector on the device -------------------------------------------------------------
def test_connector_round_trip_is_exact_from_gpu_and_cpu(tmp_path, device, compute_stream):
    """after_request then before_prefill on the device: the cache holds the stored K/V bit for
    bit, from a GPU-pool hit and, after a second prompt evicted the first, from a CPU-slab hit."""
    transformers = pytest.importorskip("transformers")
    from kvtier.config import StoreConfig
    from kvtier.connectors.hf import HFConnector, _cache_layers, kv_spec_for

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    block_size, num_blocks = 16, 6
    block_nbytes = kv_spec_for(model, block_size).block_nbytes
    config = StoreConfig(
        gpu_bytes=num_blocks * block_nbytes, cpu_bytes=4 * num_blocks * block_nbytes, disk_bytes=0,
        block_size=block_size, data_dir=tmp_path,
    )
    connector = HFConnector.from_model(model, config, model_id="tiny-llama-gpu", emulate_gpu=True)  # no-op on CUDA
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (1, num_blocks * block_size + 4), generator=g).to(device) for _ in range(2)]
    try:
        settle(device)
        with compute_stream():
            with torch.inference_mode():
                out = model(prompts[0], use_cache=True)
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            keys, values = (list(t) for t in _cache_layers(cache))
            assert connector.after_request(prompts[0][0], cache) == num_blocks
            for medium in (Medium.GPU, Medium.CPU):
                if medium is Medium.CPU:  # a second prompt fills the GPU pool: the first spills
                    with torch.inference_mode():
                        other = model(prompts[1], use_cache=True)
                    other_cache = other.cache if getattr(other, "cache", None) is not None else other.past_key_values
                    assert connector.after_request(prompts[1][0], other_cache) == num_blocks
                    # The hit above protects part of the first prompt's blocks from the second's
                    # store (SLRU): evict what is left of them in the GPU pool (it spills).
                    store = connector.store
                    with store.residency.lock:
                        store.placement.make_room(0, store.top.num_blocks)
                plan = connector.before_prefill(prompts[0])
                assert plan.num_cached_tokens == num_blocks * block_size
                assert plan.sources == [medium] * num_blocks
                got_keys, got_values = _cache_layers(plan.cache)
                for layer in range(cfg.num_hidden_layers):
                    cached = plan.num_cached_tokens
                    assert torch.equal(got_keys[layer], keys[layer][:, :, :cached]), (medium, layer)
                    assert torch.equal(got_values[layer], values[layer][:, :, :cached]), (medium, layer)
    finally:
        connector.close()
