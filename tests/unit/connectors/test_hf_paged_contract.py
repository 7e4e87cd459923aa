"""Contract: every transformers internal the continuous-batching connector touches, checked on
the installed release. A failure names the internal that moved; fix kvtier/connectors/hf_paged
(layout.py for the cache's layout and ledger, connector.py for the hooks) before widening
SUPPORTED_TRANSFORMERS.

Each test builds the real objects through transformers' own entry points
(``model.init_continuous_batching`` then the manager's ``_create_batch_processor``, which
creates the paged cache and the scheduler without starting the generation thread).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from kvtier.connectors.hf_paged import compat  # noqa: E402
from kvtier.connectors.hf_paged.connector import page_size_of  # noqa: E402
from kvtier.connectors.hf_paged.layout import make_layout  # noqa: E402

PAGE, BLOCK = 32, 16
GENERATION = compat.check_transformers() if compat.supported(compat.transformers_version()) else None


def moved(internal: str, detail: str = "") -> str:
    return f"transformers internal moved: {internal}" + (f" ({detail})" if detail else "")


def cb_config(**kwargs):
    name = "block_size" if GENERATION == "block_manager" else "page_size"
    return ContinuousBatchingConfig(**{name: PAGE}, num_blocks=16, max_batch_tokens=128, **kwargs)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def manager(model):
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1),
                                             cb_config())
    yield manager
    manager.batch_processor = None


@pytest.fixture
def processor(manager):
    return manager._create_batch_processor()


def test_installed_release_is_supported():
    import transformers

    assert GENERATION is not None, (
        f"transformers {transformers.__version__} is outside {compat.SUPPORTED_TRANSFORMERS}: check these contracts "
        "against it, then widen SUPPORTED_TRANSFORMERS (and the 'continuous' extra in pyproject.toml)"
    )


def test_pyproject_pins_the_supported_range():
    text = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    match = re.search(r'continuous\s*=\s*\[([^\]]*)\]', text)
    assert match, "pyproject.toml needs a 'continuous' extra pinning transformers"
    assert f'"transformers{compat.SUPPORTED_TRANSFORMERS}"' in match.group(1)


def test_manager_entry_points(manager):
    from transformers.generation.continuous_batching import ContinuousBatchingManager

    assert isinstance(manager, ContinuousBatchingManager)
    params = list(inspect.signature(manager.add_request).parameters)
    assert params[:2] == ["input_ids", "request_id"], moved("ContinuousBatchingManager.add_request(input_ids, request_id, ...)", str(params))
    assert callable(getattr(manager, "_create_batch_processor", None)), moved("ContinuousBatchingManager._create_batch_processor")
    assert manager.model is not None and hasattr(manager, "batch_processor"), moved("ContinuousBatchingManager.model / .batch_processor")
    assert page_size_of(manager.continuous_batching_config) == PAGE, moved("ContinuousBatchingConfig page_size/block_size")
    assert manager.continuous_batching_config.allow_block_sharing, moved("ContinuousBatchingConfig.allow_block_sharing")
    event = getattr(manager, "_wake_up_loop", None) or getattr(manager, "_has_new_requests", None)
    assert event is not None and hasattr(event, "set"), moved("ContinuousBatchingManager._wake_up_loop (5.18+) / _has_new_requests (5.17)")


def test_processor_holds_cache_and_scheduler(processor):
    assert hasattr(processor, "cache") and hasattr(processor, "scheduler"), moved("ContinuousBatchProcessor.cache / .scheduler")
    assert hasattr(processor.inputs_and_outputs, "compute_stream"), moved("ContinuousBatchingIOs.compute_stream")
    assert hasattr(processor, "use_async_batching"), moved("ContinuousBatchProcessor.use_async_batching")
    assert processor.cache.use_prefix_sharing, moved("PagedAttentionCache.use_prefix_sharing (on for full attention)")


def test_cache_methods_the_connector_hooks(processor):
    cache = processor.cache
    complete = "mark_shareable_blocks_as_complete" if GENERATION == "block_manager" else "mark_complete_blocks"
    expected = {
        "search_prefix_match": ["request_id", "prompt_ids"],
        complete: ["state"],
        "free_blocks": ["request_id"],
    }
    for name, first in expected.items():
        method = getattr(cache, name, None)
        assert callable(method), moved(f"PagedAttentionCache.{name}")
        params = list(inspect.signature(method).parameters)
        assert params[: len(first)] == first, moved(f"PagedAttentionCache.{name}{tuple(first)}", str(params))


def test_scheduler_methods_the_connector_hooks(processor):
    scheduler = processor.scheduler
    assert list(inspect.signature(scheduler.add_waiting_request).parameters) == ["state"], moved("Scheduler.add_waiting_request(state)")
    assert list(inspect.signature(scheduler._get_waiting_candidates).parameters) == [], moved("Scheduler._get_waiting_candidates()")
    infer = inspect.getsource(type(scheduler)._infer_request_tokens)
    assert "search_prefix_match" in infer and "position_offset += prefill_length" in infer, moved(
        "Scheduler._infer_request_tokens: prefix match of PENDING requests -> position_offset"
    )
    schedule = inspect.getsource(type(scheduler).schedule_batch)
    assert "_get_waiting_candidates" in schedule, moved("Scheduler.schedule_batch reads _get_waiting_candidates()")


def test_processor_calls_the_hooked_methods():
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    complete = "mark_shareable_blocks_as_complete" if GENERATION == "block_manager" else "mark_complete_blocks"
    update = inspect.getsource(ContinuousBatchProcessor.update_batch)
    assert f"self.cache.{complete}(state" in update, moved(f"ContinuousBatchProcessor.update_batch calls cache.{complete}")
    tp_state = inspect.getsource(ContinuousBatchProcessor._update_tp_group_state)
    assert "add_waiting_request" in tp_state, moved("ContinuousBatchProcessor._update_tp_group_state adds new requests")


def test_request_state_fields():
    from transformers.generation.continuous_batching import RequestState

    state = RequestState(request_id="r", initial_tokens=[1, 2, 3])
    for name in ("request_id", "initial_tokens", "generated_tokens", "position_offset", "is_cpu_offloaded", "status"):
        assert hasattr(state, name), moved(f"RequestState.{name}")


def _write_like_transformers(cache, request_id: str, num_tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write random K/V for every layer the way the attention layers do, through transformers'
    own write indices and update; returns ``[(k, v)]`` per layer, ``[num_tokens, H, D]``."""
    g = torch.Generator().manual_seed(seed)
    written = []
    if GENERATION == "block_manager":
        manager = cache.group_cache_managers[0]
        heads, head_dim = cache.num_key_value_heads, cache.head_dim
        write = torch.tensor(manager.get_write_indices(request_id, 0, num_tokens))
        for layer in range(len(cache.key_cache)):
            k, v = (torch.randn(num_tokens, heads, head_dim, generator=g) for _ in range(2))
            cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer, [torch.empty(0, dtype=torch.long)], [write])
            written.append((k, v))
        return written
    from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

    allocator = cache.cache_allocators[FULL_ATTENTION]
    write = torch.tensor(allocator.get_write_indices(request_id, 0, num_tokens))
    for layer in allocator.layer_indices:
        k, v = (torch.randn(num_tokens, allocator.num_key_value_heads, allocator.head_dim, generator=g) for _ in range(2))
        allocator.update(k, v, layer, torch.empty(0, dtype=torch.long), write)
        written.append((k, v))
    return written


def test_layout_views_address_what_transformers_writes(processor):
    cache = processor.cache
    layout = make_layout(cache, BLOCK)
    num_tokens = 3 * PAGE  # three paged blocks, six kvtier blocks
    assert layout.append("req", 0, num_tokens) == num_tokens, moved("cache allocation for a request (append)")
    table = layout.block_table("req")
    assert table is not None and len(table) == 3, moved("block_table of a request", str(table))
    written = _write_like_transformers(cache, "req", num_tokens, seed=1)
    for j in range(num_tokens // BLOCK):
        k_off = j % layout.ratio
        keys, values = layout.views(k_off)
        view_id = layout.view_id(table[j // layout.ratio], k_off)
        for layer, (k, v) in enumerate(written):
            tokens = slice(j * BLOCK, (j + 1) * BLOCK)
            assert torch.equal(keys[layer][view_id], k[tokens]), moved("paged cache layout (K)", f"block {j} layer {layer}")
            assert torch.equal(values[layer][view_id], v[tokens]), moved("paged cache layout (V)", f"block {j} layer {layer}")


def test_registered_blocks_are_found_by_the_prefix_match(processor):
    cache = processor.cache
    layout = make_layout(cache, BLOCK)
    tokens = list(range(5, 5 + 2 * PAGE + 7))
    assert layout.append("first", 0, 2 * PAGE) == 2 * PAGE
    layout.register("first", tokens, 2)
    assert layout.complete_blocks("first") == 2, moved("block sharing registration (ledger / Block.is_complete)")
    assert cache.search_prefix_match("second", tokens) == 2 * PAGE, moved("search_prefix_match over registered blocks")
    assert layout.block_table("second") == layout.block_table("first"), moved("shared blocks in the block table")


def test_truncate_gives_blocks_back(processor):
    cache = processor.cache
    layout = make_layout(cache, BLOCK)
    assert layout.append("req", 0, 4 * PAGE) == 4 * PAGE
    before = _free_blocks(cache)
    layout.truncate("req", 1)
    assert layout.block_table("req") == layout.block_table("req")[:1] and len(layout.block_table("req")) == 1
    assert _free_blocks(cache) == before + 3, moved("freeing a request's blocks (ledger.release / BlockManager.free_blocks)")


@pytest.mark.skipif(GENERATION != "allocators", reason="transformers 5.18 - 5.25's BlockLedger keeps cached blocks")
def test_append_evicts_only_the_cached_blocks_it_needs_least_recently_freed_first(processor):
    """A load into a cache whose free blocks are gone takes transformers' cached blocks (held
    by no request, kept for their hash), oldest first, only as many as it needs."""
    cache = processor.cache
    layout = make_layout(cache, BLOCK)
    ledger = layout.allocator.ledger
    old, new = list(range(5, 5 + 2 * PAGE + 3)), list(range(60, 60 + 2 * PAGE + 3))
    tables = {}
    for request_id, tokens in (("old", old), ("new", new)):
        assert layout.append(request_id, 0, 2 * PAGE) == 2 * PAGE
        layout.register(request_id, tokens, 2)
        tables[request_id] = list(layout.block_table(request_id))
    cache.free_blocks("old")
    cache.free_blocks("new")
    assert list(ledger.cached_blocks) == tables["old"] + tables["new"], moved("BlockLedger.cached_blocks (ordered set)")
    free = _free_blocks(cache)
    assert layout.append("busy", 0, free * PAGE) == free * PAGE and _free_blocks(cache) == 0

    assert layout.append("load", 0, PAGE) == PAGE  # one block: the oldest cached one
    assert layout.block_table("load") == tables["old"][:1]
    assert list(ledger.cached_blocks) == tables["old"][1:] + tables["new"]
    assert cache.search_prefix_match("old-again", old) == 0  # its first block is gone
    assert cache.search_prefix_match("new-again", new) == 2 * PAGE  # untouched
    cache.free_blocks("new-again")

    # more than every cached block: all of them, and no more than that
    assert layout.append("load", PAGE, 5 * PAGE) == 3 * PAGE
    assert not ledger.cached_blocks and not ledger.hash_to_block.keys() & ledger.block_to_hash.values()
    assert cache.search_prefix_match("new-again", new) == 0
    assert layout.block_table("busy") is not None and len(layout.block_table("busy")) == free  # never taken


def _free_blocks(cache) -> int:
    if GENERATION == "block_manager":
        return cache.get_num_free_blocks()
    from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

    allocator = cache.cache_allocators[FULL_ATTENTION]
    return cache.pool.count_free_blocks(allocator.index) + cache.pool.num_free_sectors * allocator.blocks_per_sector
