"""Every model family the HF connector serves gives the model exactly the K/V it computes:
greedy output with kvtier equals output without, and every step's logits are within 1e-5
(float32) of a full prefill with the model's own default cache, on every tier path (GPU
pool, CPU after the GPU pool evicted, DISK after reopening in a new store, REMOTE in memory
and through the daemon); the families it does not serve are refused by name.

The stores have the two-pool hierarchy of a CUDA machine: their GPU pool is emulated in host
memory (``emulate_gpu``; without it a model on the CPU gets one CPU pool).

Tiny random-weight models of the real architectures (kvtier.app.families): windows of
7-8 tokens under prompts of 30-46 tokens, so sliding layers really drop positions."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.connectors.hf import HFConnector, UnsupportedModelError, kv_spec_for
from kvtier.connectors.hf_cache import new_cache
from kvtier.testing import MemoryRemote
from kvtier.app.families import REFUSED, SUPPORTED, tiny_model
from kvtier.types import Medium

pytest.importorskip("transformers")

BLOCK = 4
PROMPT, NEW = 30, 10
LOGIT_TOL = 1e-5
_models: dict[str, torch.nn.Module] = {}
_references: dict[tuple[str, int], tuple[list[int], torch.Tensor]] = {}


def model_of(name: str) -> torch.nn.Module:
    if name not in _models:
        _models[name] = tiny_model(name)
    return _models[name]


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, ids, connector=None):
    """Greedy ``NEW`` tokens: ``(tokens, logits [NEW, vocab], plan)``; with a connector,
    through its hooks (the plan's cache, then after_request)."""
    plan = connector.before_prefill(ids) if connector is not None else None
    kwargs = plan.generate_kwargs() if plan is not None else {}
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True, **kwargs,
        )
    if connector is not None:
        connector.after_request(out.sequences[0], plan.cache)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.cat(out.logits), plan


def reference(name: str, ids: torch.Tensor, seed: int):
    """Output and logits without kvtier: ``generate`` with the model's own default cache."""
    key = (name, seed)
    if key not in _references:
        tokens, logits, _ = run(model_of(name), ids)
        _references[key] = (tokens, logits)
    return _references[key]


def check_same(name, ids, seed, connector, expected_medium, expected_cached):
    tokens, logits, plan = run(model_of(name), ids, connector)
    ref_tokens, ref_logits = reference(name, ids, seed)
    assert plan.num_cached_tokens == expected_cached, name
    assert set(plan.sources) == {expected_medium}, (name, plan.sources)
    assert tokens == ref_tokens, name
    assert (logits - ref_logits).abs().max().item() <= LOGIT_TOL, name


def config(tmp_path, gpu_blocks=64, cpu_blocks=0, disk_blocks=0, spec=None, **kwargs) -> StoreConfig:
    nbytes = spec.block_nbytes
    return StoreConfig(
        gpu_bytes=gpu_blocks * nbytes, cpu_bytes=cpu_blocks * nbytes, disk_bytes=disk_blocks * (nbytes + 8192),
        block_size=BLOCK, data_dir=tmp_path / "kvtier", **kwargs,
    )


FAMILIES = sorted(SUPPORTED)
# One family per block layout runs every tier path in the fast lane: llama (LKVTHD), gemma3
# (LKVTHD with sliding + full groups), deepseek-v3 (flat: MLA latent K and RoPE V); the tiers
# move a block's bytes whatever its layout, so the other families' runs are `slow` (the full suite
# runs every family on every tier).
LAYOUT_KINDS = ("llama", "gemma3", "deepseek-v3")
TIER_FAMILIES = [name if name in LAYOUT_KINDS else pytest.param(name, marks=pytest.mark.slow) for name in FAMILIES]
CACHED = (PROMPT - 1) // BLOCK * BLOCK  # 28 of 30 prompt tokens come from kvtier


@pytest.mark.parametrize("name", TIER_FAMILIES)
def test_gpu_pool_hits_multi_turn(name, tmp_path):
    model = model_of(name)
    spec = kv_spec_for(model, BLOCK, head_major=True)
    conn = HFConnector.from_model(model, config(tmp_path, spec=spec), model_id=name, emulate_gpu=True)
    try:
        ids = prompt(PROMPT, seed=1)
        first, _, plan = run(model, ids, conn)
        assert plan.num_cached_tokens == 0 and first == reference(name, ids, 1)[0]
        check_same(name, ids, 1, conn, Medium.GPU, CACHED)
        # next turn: the history (prompt + output) and a new user message; the cut falls
        # inside the generated tokens, windows of earlier positions long gone
        turn2 = torch.cat([ids, torch.tensor([first]), prompt(6, seed=2)], dim=1)
        stored = (PROMPT + NEW - 1) // BLOCK * BLOCK
        explained = conn.explain(turn2)  # before the load: what it will hit, and why the rest misses
        assert explained.hit_tokens == stored and {b.tier for b in explained.blocks[: stored // BLOCK]} == {"GPU"}
        assert {r for r, _ in explained.miss_tokens} <= {"never_stored", "partial_tail"}
        check_same(name, turn2, 2, conn, Medium.GPU, stored)
        # run()'s after_request counted the prefill: TTFT saved is measured on every family
        assert conn.last_prefill["cached_tokens"] == stored and conn.last_prefill["prefill_s"] > 0
        assert conn.store.stats.ttft_saved_s is not None
    finally:
        conn.close()


@pytest.mark.parametrize("name", TIER_FAMILIES)
def test_cpu_hits_after_gpu_pool_evicted(name, tmp_path):
    model = model_of(name)
    spec = kv_spec_for(model, BLOCK, head_major=True)
    conn = HFConnector.from_model(
        model, config(tmp_path, gpu_blocks=10, cpu_blocks=64, spec=spec), model_id=name, emulate_gpu=True
    )
    try:
        ids = prompt(PROMPT, seed=1)
        run(model, ids, conn)
        run(model, prompt(44, seed=3), conn)  # 13 new blocks through a 10-block GPU pool
        hashes = conn.block_hashes(ids[0])[: CACHED // BLOCK]
        assert not any(h in conn.store.top for h in hashes)
        check_same(name, ids, 1, conn, Medium.CPU, CACHED)
    finally:
        conn.close()


@pytest.mark.parametrize("name", TIER_FAMILIES)
def test_disk_hits_after_reopening_in_a_new_store(name, tmp_path):
    model = model_of(name)
    spec = kv_spec_for(model, BLOCK, head_major=True)
    cfg = config(tmp_path, gpu_blocks=32, disk_blocks=64, spec=spec)
    ids = prompt(PROMPT, seed=1)
    first = HFConnector.from_model(model, cfg, model_id=name)
    run(model, ids, first)
    first.close()
    second = HFConnector.from_model(model, cfg, model_id=name)
    try:
        check_same(name, ids, 1, second, Medium.DISK, CACHED)
    finally:
        second.close()


@pytest.mark.parametrize("name", TIER_FAMILIES)
def test_remote_hits_in_another_store(name, tmp_path):
    model = model_of(name)
    spec = kv_spec_for(model, BLOCK, head_major=True)
    remote = MemoryRemote()
    ids = prompt(PROMPT, seed=1)
    first = HFConnector.from_model(model, config(tmp_path / "a", spec=spec), model_id=name, remote=remote)
    run(model, ids, first)
    first.close()
    second = HFConnector.from_model(model, config(tmp_path / "b", spec=spec), model_id=name, remote=remote)
    try:
        check_same(name, ids, 1, second, Medium.REMOTE, CACHED)
    finally:
        second.close()


@pytest.mark.parametrize("name", LAYOUT_KINDS)
@pytest.mark.slow  # a daemon subprocess per family
def test_remote_hits_through_the_daemon(name, tmp_path):
    """The real daemon (kvtier serve's app on a thread), one family per block layout: its
    register call carries the layer groups; blocks another store put come back verified."""
    from kvtier.server.app import REGISTRY
    from tests.unit.server.conftest import ThreadDaemon, serve_settings

    model = model_of(name)
    spec = kv_spec_for(model, BLOCK, head_major=True)
    daemon = ThreadDaemon(serve_settings(tmp_path / "daemon", spec=spec)).start()
    try:
        ids = prompt(PROMPT, seed=1)
        first = HFConnector.from_model(model, config(tmp_path / "a", spec=spec, remote_url=daemon.url), model_id=name)
        run(model, ids, first)
        first.close()
        second = HFConnector.from_model(model, config(tmp_path / "b", spec=spec, remote_url=daemon.url), model_id=name)
        try:
            check_same(name, ids, 1, second, Medium.REMOTE, CACHED)
        finally:
            second.close()
        registered = daemon.call(lambda: [entry.spec for entry in daemon.app[REGISTRY].namespaces.values()])
        assert registered == [spec]
    finally:
        daemon.stop()


WINDOWED = {"qwen2": "sliding_window", "mistral": "sliding_window", "gemma2": "sliding_window",
            "gemma3": "sliding_window", "gpt-oss": "sliding_window", "llama4": "attention_chunk_size"}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windows_really_slide_in_these_prompts(name):
    """Without its window the same model gives other logits for the test prompt: the tests
    above exercise positions that left the window."""
    model, field = model_of(name), WINDOWED[name]
    ids = prompt(PROMPT, seed=1)
    windowed = reference(name, ids, 1)[1]
    old = getattr(model.config, field)
    setattr(model.config, field, 4096)
    try:
        _, unwindowed, _ = run(model, ids)
    finally:
        setattr(model.config, field, old)
    assert (windowed - unwindowed).abs().max().item() > 1e-4  # the noise floor is ~1e-7


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_families_are_refused_by_name(name, tmp_path):
    model = tiny_model(name)
    with pytest.raises(UnsupportedModelError, match=REFUSED[name].refusal):
        HFConnector.from_model(model, StoreConfig(gpu_bytes=1 << 20, block_size=BLOCK, data_dir=tmp_path))


def test_cache_that_dropped_positions_disables_storing(tmp_path, caplog):
    """transformers' own cache for Mistral keeps only the window's tail: never stored from."""
    from transformers import DynamicCache

    model = model_of("mistral")
    spec = kv_spec_for(model, BLOCK, head_major=True)
    conn = HFConnector.from_model(model, config(tmp_path, spec=spec), model_id="mistral")
    try:
        ids = prompt(PROMPT, seed=1)
        own = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(ids, **{conn._cache_kwarg: own})
        with caplog.at_level(logging.ERROR, logger="kvtier.connectors.hf"):
            assert conn.after_request(ids[0], own) == 0
        assert "DynamicSlidingWindowLayer kept 6 of 30 positions" in conn.store_disabled
        assert "storing disabled" in caplog.text
        assert conn.store.lookup(conn.block_hashes(ids[0])).num_hit_blocks == 0
        good = new_cache()
        with torch.inference_mode():
            model(ids, **{conn._cache_kwarg: good})
        assert conn.after_request(ids[0], good) == 0  # stays disabled: never a store of wrong bytes
    finally:
        conn.close()


def test_cache_of_other_shapes_disables_storing(tmp_path):
    model, mla = model_of("llama"), model_of("deepseek-v3")  # MLA caches a latent K of 32, V of 8
    conn = HFConnector.from_model(model, config(tmp_path, spec=kv_spec_for(model, BLOCK, head_major=True)), model_id="llama")
    try:
        ids = prompt(PROMPT, seed=1)
        wrong = new_cache()
        with torch.inference_mode():
            mla(ids, **{conn._cache_kwarg: wrong})
        assert conn.after_request(ids[0], wrong) == 0
        assert "layer 0: expected K [1, 2, n, 16] and V [1, 2, n, 16], got (1, 1, 30, 32)" in conn.store_disabled
        assert conn.store.lookup(conn.block_hashes(ids[0])).num_hit_blocks == 0
    finally:
        conn.close()
