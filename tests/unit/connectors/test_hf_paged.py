"""kvtier under transformers' continuous batching, on a tiny random-weight Llama (CPU, sdpa).

Every test compares greedy outputs with transformers' continuous batching alone (its own
prefix sharing on) and checks where each cached token came from. Those that run several
managers end to end are marked ``slow`` (about 5-15 s each on 2 cores).
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from kvtier.config import StoreConfig  # noqa: E402
from kvtier.connectors.hf import HFConnector  # noqa: E402
from kvtier.connectors.hf_paged import PAGED, HFPagedConnector, UnsupportedModelError, compat  # noqa: E402
from kvtier.testing.faults import Fault, FaultPlan, inject_disk_faults  # noqa: E402

BLOCK, PAGE, NEW = 16, 64, 6
GENERATION = compat.check_transformers()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      initializer_range=0.5)
    return LlamaForCausalLM(cfg).eval()


def cb_config(num_blocks: int = 48, page: int = PAGE, max_batch_tokens: int = 256, **kwargs) -> ContinuousBatchingConfig:
    name = "block_size" if GENERATION == "block_manager" else "page_size"
    return ContinuousBatchingConfig(**{name: page}, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, **kwargs)


def gen_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1)


def store_config(data_dir, **kwargs) -> StoreConfig:
    values = dict(gpu_bytes=0, cpu_bytes=16 << 20, disk_bytes=64 << 20, block_size=BLOCK, data_dir=data_dir)
    values.update(kwargs)
    return StoreConfig(**values)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@contextlib.contextmanager
def running(manager):
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=True)


def serve(manager, waves: list[list[list[int]]], gap_s: float = 0.0) -> list[list[int]]:
    """On a running manager: add each wave of prompts (``gap_s`` apart, so prefill and decode
    steps mix), then wait for every output; outputs in order of the prompts."""
    ids = []
    for wave in waves:
        ids += [manager.add_request(p, max_new_tokens=NEW, streaming=True) for p in wave]
        time.sleep(gap_s)
    outputs: dict[str, list[int]] = {}
    deadline = time.monotonic() + 120
    while len(outputs) < len(ids) and time.monotonic() < deadline:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            assert result.error is None, result.error
            outputs[result.request_id] = result.generated_tokens
    return [outputs.get(i) for i in ids]


def baseline(model, waves, gap_s: float = 0.0, **kwargs) -> list[list[int]]:
    """Transformers' continuous batching alone (its own prefix sharing on)."""
    with running(model.init_continuous_batching(gen_config(), cb_config(**kwargs))) as manager:
        return serve(manager, waves, gap_s)


@pytest.fixture
def connect(model, tmp_path):
    made = []

    def make(**kwargs) -> HFPagedConnector:
        deadline = kwargs.pop("load_deadline_s", 2.0)
        conn = HFPagedConnector.from_model(model, store_config(tmp_path, **kwargs), model_id="tiny",
                                           load_deadline_s=deadline)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.close()


def with_kvtier(conn, waves, gap_s: float = 0.0, **kwargs) -> list[list[int]]:
    with running(conn.init_continuous_batching(gen_config(), cb_config(**kwargs))) as manager:
        return serve(manager, waves, gap_s)


def chats(num_users: int, system: list[int], rounds: int = 1) -> list[list[int]]:
    return [system + tokens(40 + 9 * u, seed=100 + u) for u in range(num_users)]


@pytest.mark.slow
def test_concurrent_users_identical_and_hits_from_disk_after_restart(model, connect):
    """8 users, one shared system prompt, two waves (prefill and decode mixed); a new store
    process on the same DISK serves the second pass from DISK."""
    system = tokens(70, seed=1)
    waves = [chats(4, system), [p + tokens(5, seed=9) for p in chats(4, system[:50])]]
    expected = baseline(model, waves)
    first = connect()
    assert with_kvtier(first, waves) == expected
    first.close()
    second = connect()
    assert with_kvtier(second, waves) == expected
    stats = second.admissions.stats
    assert stats.cached_by_source["DISK"] > 0, stats
    if GENERATION == "allocators":  # hits end inside paged blocks: every usable kvtier block is loaded
        usable = sum((len(p) - 1) // BLOCK * BLOCK for wave in waves for p in wave)
        assert sum(stats.cached_by_source.values()) == usable, stats
    assert stats.errors == 0 and stats.late_loads == 0
    second.store.check_invariants()


@pytest.mark.slow
def test_loaded_blocks_are_shared_with_later_requests(model, connect):
    """A prefix loaded from kvtier becomes transformers' own shared blocks: the next request
    with that prefix matches it in the paged cache, without asking kvtier."""
    prefix = tokens(2 * PAGE + 10, seed=2)
    conn = connect()
    with_kvtier(conn, [[prefix]])
    conn.close()
    again = connect()
    waves = [[prefix + [7]], [prefix + [8]]]
    expected = baseline(model, waves)
    assert with_kvtier(again, waves, gap_s=0.5) == expected
    ids = [a for a in list(again.admissions._by_id.values())]
    assert ids[0].cached_by_source.get(PAGED, 0) == 0 and ids[0].kvtier_tokens == 2 * PAGE
    assert ids[1].cached_by_source.get(PAGED) == 2 * PAGE, ids[1]


@pytest.mark.slow
def test_conversation_hits_after_the_paged_cache_turned_over(model, connect):
    """A device cache of 8 paged blocks: a conversation comes back after 6 others pushed its
    blocks out of transformers' cache; kvtier still holds them (CPU tier)."""
    conversation = tokens(2 * PAGE + 20, seed=3)
    others = [[tokens(2 * PAGE, seed=10 + i)] for i in range(6)]
    waves = [[conversation], *others, [conversation + tokens(9, seed=4)]]
    with running(model.init_continuous_batching(gen_config(), cb_config(num_blocks=8))) as manager:
        expected = [serve(manager, [w])[0] for w in waves]
    conn = connect()
    with running(conn.init_continuous_batching(gen_config(), cb_config(num_blocks=8))) as manager:
        got = [serve(manager, [w])[0] for w in waves]
    assert got == expected
    last = conn.admissions.get(list(conn.admissions._by_id)[-1])
    assert last.cached_tokens >= 2 * PAGE
    if GENERATION == "allocators":  # 5.17 evicts its cached blocks newest first: the old ones may survive
        assert last.cached_by_source.get(PAGED, 0) == 0, "expected transformers' own cache to have turned over"
        assert last.cached_by_source.get("CPU", 0) >= 2 * PAGE


@pytest.mark.slow
def test_conversation_hits_after_a_new_paged_cache(model, connect):
    """A new manager (a new paged cache, nothing of the old one left) on the same connector:
    the conversation's blocks come back from kvtier."""
    conversation = tokens(2 * PAGE + 20, seed=3)
    waves = [[conversation], [conversation + tokens(9, seed=4)]]
    expected = baseline(model, waves, gap_s=1.0)
    conn = connect()
    first = with_kvtier(conn, waves[:1])
    conn.detach()
    second = with_kvtier(conn, waves[1:])
    assert first + second == expected
    last = conn.admissions.get(list(conn.admissions._by_id)[-1])
    assert last.cached_by_source.get(PAGED, 0) == 0 and last.kvtier_tokens >= 2 * PAGE


@pytest.mark.slow
def test_corrupt_disk_blocks_fall_back_to_computing(model, connect):
    prompt = tokens(3 * PAGE + 5, seed=5)
    expected = baseline(model, [[prompt]])
    conn = connect()
    with_kvtier(conn, [[prompt]])
    conn.close()
    again = connect()
    plan = FaultPlan([Fault("read", "corrupt", calls={3})], seed=0)
    with inject_disk_faults(again.store, plan):
        assert with_kvtier(again, [[prompt]]) == expected
    assert sum(again.store.stats.load_failures.values()) >= 1
    admission = next(iter(again.admissions._by_id.values()))
    assert 0 < admission.kvtier_tokens < (len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.slow
def test_late_load_computes_instead(model, connect):
    prompt = tokens(2 * PAGE + 5, seed=6)
    expected = baseline(model, [[prompt]])
    conn = connect()
    with_kvtier(conn, [[prompt]])
    conn.close()
    late = connect(load_deadline_s=0.0)
    plan = FaultPlan([Fault("read", "delay", delay_s=0.3)], seed=0)
    with inject_disk_faults(late.store, plan):
        assert with_kvtier(late, [[prompt]]) == expected
        late.tickets.close()  # the abandoned load ends and releases its pins
    admission = next(iter(late.admissions._by_id.values()))
    assert admission.late and admission.kvtier_tokens == 0
    late.store.check_invariants()
    assert all(late.store.ref_cnt(h) == 0 for h in late.prompt_hashes(prompt))


def test_blocks_are_shared_with_the_generate_connector(model, connect, tmp_path):
    """Same namespace, same bytes: blocks stored by continuous batching are hits for
    model.generate through HFConnector built token-major (``head_major=False``: the paged
    cache's layout; its default head-major layout is another namespace), and their K/V
    match what generate computes."""
    prompt = tokens(3 * BLOCK + 4, seed=7)
    conn = connect()
    with_kvtier(conn, [[prompt]])
    conn.close()
    generate = HFConnector.from_model(model, store_config(tmp_path), model_id="tiny", head_major=False)
    try:
        plan = generate.before_prefill(torch.tensor([prompt]))
        assert plan.num_cached_tokens == 3 * BLOCK
        with torch.inference_mode():
            full = model(torch.tensor([prompt[: 3 * BLOCK]]), use_cache=True).past_key_values
        for layer in range(2):
            ours, ref = plan.cache.layers[layer], full.layers[layer]
            assert torch.allclose(ours.keys, ref.keys, atol=1e-4) and torch.allclose(ours.values, ref.values, atol=1e-4)
    finally:
        generate.close()


def test_stores_never_the_last_sampled_token_n9(model, connect):
    """Prompt of 20 tokens + 13 new: K/V exist for 32 tokens, so 2 blocks are stored."""
    conn = connect()
    manager = conn.init_continuous_batching(GenerationConfig(max_new_tokens=13, do_sample=False, eos_token_id=-1),
                                            cb_config())
    with running(manager):
        rid = manager.add_request(tokens(20, seed=8), max_new_tokens=13)
        result = manager.get_result(request_id=rid, timeout=60)
    assert len(result.generated_tokens) == 13
    assert conn.store.usage()["CPU"]["blocks"] == 2
    assert conn.admissions.stats.stored_blocks == 2


def test_add_request_takes_a_flat_prompt_and_refuses_a_batch_with_a_clear_error(model, connect):
    # a newcomer passed the [1, seq_len] tensor model.generate takes (2026-12-03): it failed
    # inside a list comprehension; a 1-D tensor or a list of numpy ints is one prompt
    import numpy as np

    conn = connect()
    manager = conn.init_continuous_batching(GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1),
                                            cb_config())
    prompt = tokens(20, seed=9)
    with running(manager):
        for bad, match in ((torch.tensor([prompt]), r"shape \[1, 20\]: pass input_ids\[0\]"),
                           ([], "non-empty"), ([1, -2, 3], "non-negative"), ([1.5, 2.0], "integer token ids"),
                           ("abc", "list of token ids"), (7, "list of token ids")):
            with pytest.raises(ValueError, match=match):
                manager.add_request(bad, max_new_tokens=4)
        ids = [manager.add_request(p, max_new_tokens=4)
               for p in (torch.tensor(prompt), np.asarray(prompt, dtype=np.int64).tolist(), list(map(np.int64, prompt)))]
        outputs = [manager.get_result(request_id=i, timeout=60).generated_tokens for i in ids]
    assert len(outputs[0]) == 4 and outputs[0] == outputs[1] == outputs[2]


def test_detach_leaves_no_hook_behind(model, connect):
    conn = connect()
    manager = conn.init_continuous_batching(gen_config(), cb_config())
    processor = manager._create_batch_processor()
    hooked = [(manager, "add_request"), (processor.cache, "search_prefix_match"), (processor.scheduler, "_get_waiting_candidates")]
    assert all(name in vars(obj) for obj, name in hooked)
    conn.detach()
    assert not any(name in vars(obj) for obj, name in hooked)
    other = type(processor.cache).search_prefix_match
    assert getattr(other, "__wrapped__", None) is None  # the class itself was never touched


def test_refuses_what_it_cannot_serve(model, connect, tmp_path):
    conn = connect()
    name = "block_size" if GENERATION == "block_manager" else "page_size"
    with pytest.raises(ValueError, match="multiple of block_size"):
        conn.init_continuous_batching(gen_config(), ContinuousBatchingConfig(**{name: 24}, num_blocks=8))
    conn.detach()
    with pytest.raises(ValueError, match="allow_block_sharing"):
        conn.init_continuous_batching(gen_config(), ContinuousBatchingConfig(**{name: 32}, num_blocks=8,
                                                                              allow_block_sharing=False))
    sliding = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1))
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    sliding.config.sliding_window = 8
    with pytest.raises(UnsupportedModelError, match=r"full-attention models only.*sliding\(8\):0"):
        HFPagedConnector.from_model(sliding, store_config(tmp_path / "s"), model_id="x", model_revision="r")


@pytest.mark.skipif(GENERATION != "allocators", reason="the allocators' layout (transformers 5.18+)")
def test_a_full_attention_group_with_another_page_layout_is_refused():
    # transformers 5.25 files MLA layers under FULL_ATTENTION with an allocator of its own
    # (two latents per token, not K and V heads): its pages are not the layout kvtier copies
    from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

    from kvtier.connectors.hf_paged.layout import AllocatorsLayout

    class MLACacheAllocator:  # what 5.25 names it; the check is on the exact allocator class
        layer_indices = [0, 1]
        tokens_per_page = 32

    cache = type("Cache", (), {"cache_allocators": {FULL_ATTENTION: MLACacheAllocator()}})()
    with pytest.raises(UnsupportedModelError, match="got MLACacheAllocator"):
        AllocatorsLayout(cache, 16)


def test_unsupported_transformers_release_is_refused_at_start(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.40.0")
    with pytest.raises(compat.UnsupportedTransformersError, match=r"supports transformers >=5.17,<5.26.*found 5.40.0"):
        compat.check_transformers()


@pytest.mark.slow
def test_chunked_prefill_stays_identical(model, connect):
    """Prompts longer than a forward's token budget: prefill in chunks, stores after each."""
    prompts = [tokens(3 * PAGE + 10 * i, seed=40 + i) for i in range(5)]
    expected = baseline(model, [prompts], max_batch_tokens=64)
    conn = connect()
    assert with_kvtier(conn, [prompts], max_batch_tokens=64) == expected
    assert conn.admissions.stats.stored_blocks >= sum(len(p) // BLOCK for p in prompts)


@pytest.mark.slow
def test_soft_reset_requests_come_back_to_their_own_blocks(model, connect):
    """A paged cache too small for every request's decode: transformers soft-resets one (its
    cache is freed, it comes back with its output in its prompt); kvtier serves the blocks it
    had computed, and every output stays the same."""
    new = 60
    generation = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1)
    prompts = [tokens(2 * PAGE - 4 - i, seed=40 + i) for i in range(4)]

    def run(manager) -> list[list[int]]:
        with running(manager):
            ids = [manager.add_request(p, max_new_tokens=new) for p in prompts]
            outputs = {}
            while len(outputs) < len(ids):
                result = manager.get_result(timeout=60)
                assert result is not None, "timed out"
                if result.is_finished():
                    outputs[result.request_id] = result.generated_tokens
        return [outputs[i] for i in ids]

    cb = {"num_blocks": 9, "max_batch_tokens": 512, "safety_margin": 0.0}
    expected = run(model.init_continuous_batching(generation, cb_config(**cb)))
    # a generous load deadline: this test counts the tokens kvtier served, which a 2 s deadline
    # on a loaded host turns into computed ones (late loads: test_late_load_computes_instead)
    conn = connect(load_deadline_s=60.0)
    assert run(conn.init_continuous_batching(generation, cb_config(**cb))) == expected
    if GENERATION == "allocators":
        resets = [a for a in conn.admissions._by_id.values() if a.prompt_tokens > max(len(p) for p in prompts)]
        assert resets and all(a.kvtier_tokens >= 2 * PAGE for a in resets), list(conn.admissions._by_id.values())


@pytest.mark.slow
def test_two_engines_share_blocks_through_remote(model, tmp_path):
    """Two connectors, each with its own store and DISK, one REMOTE tier: what the first one
    computed is a REMOTE hit for the second, loaded straight into its paged blocks."""
    from kvtier.connectors.hf import kv_spec_for
    from kvtier.hashing import KeyContext
    from kvtier.store import TieredStore
    from kvtier.testing.remote import MemoryRemote
    from kvtier.types import KV_LAYOUT

    remote = MemoryRemote()
    context = KeyContext(model_id="tiny", model_revision="r1", dtype="float32", kv_layout=KV_LAYOUT, block_size=BLOCK)

    def engine(name: str) -> HFPagedConnector:
        store = TieredStore(kv_spec_for(model, BLOCK), store_config(tmp_path / name), context.namespace(), remote=remote)
        return HFPagedConnector(model, store, context)

    prompt = tokens(2 * PAGE + 30, seed=11)
    first, second = engine("a"), engine("b")
    try:
        expected = with_kvtier(first, [[prompt]])
        first.store.wait_for_writes()  # the puts to REMOTE run in the background
        assert with_kvtier(second, [[prompt]]) == expected
        admission = next(iter(second.admissions._by_id.values()))
        usable = (len(prompt) - 1) // BLOCK * BLOCK
        if GENERATION == "block_manager":  # whole paged blocks only
            usable -= usable % PAGE
        assert admission.cached_by_source.get("REMOTE") == usable
    finally:
        first.close()
        second.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma2", "gemma3", "gpt-oss", "llama4", "deepseek-v3",
                                  "mamba", "jamba", "bamba", "qwen3-next", "t5"])
def test_families_it_cannot_serve_are_refused_by_name(name, tmp_path):
    """The HF connector's family check comes first (same message); families the HF connector
    serves but whose layers are not all full attention are refused by this connector, naming
    their layer kinds, before a store is built."""
    from kvtier.app.families import REFUSED, tiny_model

    model = tiny_model(name)
    expected = REFUSED[name].refusal if name in REFUSED else r"full-attention models only.*(sliding|chunked|mla)"
    with pytest.raises(UnsupportedModelError, match=expected):
        HFPagedConnector.from_model(model, store_config(tmp_path), model_id=name, model_revision="r")
    assert not (tmp_path / "disk").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_full_attention_families_identical_with_hits(name, tmp_path):
    """The families it accepts: a second pass over the same prompts is served from kvtier
    (a new manager, so from kvtier's tiers, not transformers' paged cache) and its greedy
    output equals transformers' continuous batching alone."""
    from kvtier.app.families import VOCAB_SIZE, tiny_model

    model = tiny_model(name)
    prompts = [[3 + (7 * i + 11 * u) % (VOCAB_SIZE - 3) for i in range(50 + 13 * u)] for u in range(3)]
    expected = baseline(model, [prompts])
    conn = HFPagedConnector.from_model(model, store_config(tmp_path), model_id=name, model_revision="r")
    try:
        assert with_kvtier(conn, [prompts]) == expected
        conn.detach()
        assert with_kvtier(conn, [prompts]) == expected
        stats = conn.admissions.stats
        from_kvtier = sum(n for source, n in stats.cached_by_source.items() if source != PAGED)
        assert from_kvtier >= sum((len(p) - 1) // PAGE * PAGE for p in prompts), stats
    finally:
        conn.close()
