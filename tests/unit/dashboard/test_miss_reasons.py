"""Each miss reason, driven for real: the store's counter (``stats.miss_tokens``, exported as
``kvtier_miss_tokens_total``) and ``kvtier explain``'s output for the same prompt (the CLI asks
an engine's app over HTTP, as a user would).

Block size 16. A prompt of ``n`` tokens is loaded as the connectors load it: its first
``(n - 1) // 16`` blocks, the rest is its partial tail; so every load's tokens are the loaded
ones plus the missed ones, each counted once with its reason.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from aiohttp import web
from click.testing import CliRunner

from kvtier.app.cli import main
from kvtier.config import StoreConfig
from kvtier.dashboard import setup_explain
from kvtier.hashing import KeyContext, block_hashes_for, content_keys
from kvtier.store import TieredStore, misses
from kvtier.store.results import PromptInfo
from kvtier.testing import Fault, FaultPlan, MemoryRemote, inject_disk_faults, inject_remote_faults
from kvtier.tiers.disk import record_footprint
from kvtier.types import KVSpec

BS = 16
SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=BS, dtype=torch.float32)


@dataclass
class Prompt:
    tokens: list[int]
    context: KeyContext

    @property
    def hashes(self) -> list[bytes]:
        return block_hashes_for(self.tokens, self.context.namespace(), BS)

    @property
    def max_blocks(self) -> int:
        return (len(self.tokens) - 1) // BS

    def info(self) -> PromptInfo:
        return PromptInfo(len(self.tokens), content_keys(self.tokens, BS), self.context.namespace())


def prompt(num_tokens: int, context: KeyContext, seed: int) -> Prompt:
    rng = random.Random(seed)
    return Prompt([rng.randrange(32000) for _ in range(num_tokens)], context)


def make_store(tmp_path, gpu: int = 4, cpu: int = 4, disk: int = 0, lora: str | None = None,
               remote=None) -> tuple[TieredStore, KeyContext]:
    context = KeyContext("miss-test", dtype="float32", block_size=BS, lora_name=lora)
    config = StoreConfig(
        gpu_bytes=gpu * SPEC.block_nbytes, cpu_bytes=cpu * SPEC.block_nbytes,
        disk_bytes=disk * record_footprint(SPEC.block_nbytes), block_size=BS,
        data_dir=tmp_path / f"store-{lora}", flush_on_close=False,
    )
    return TieredStore(SPEC, config, context.namespace(), device="cpu", emulate_gpu=True, remote=remote), context


def put(store: TieredStore, p: Prompt) -> int:
    """Store the prompt's full blocks (random K/V), as after_request does."""
    hashes = p.hashes
    blocks = torch.randn(len(hashes), *SPEC.block_shape)

    def write(indices: list[int], block_ids: list[int]) -> None:
        store.top.tensor[block_ids] = blocks[indices]

    return store.store_with(hashes, write, prompt=p.info())


def load(store: TieredStore, p: Prompt) -> tuple[int, Counter]:
    """Load as the connector does; returns (tokens loaded, miss tokens counted by it)."""
    before = Counter(store.stats.miss_tokens)
    result = store.prefetch(p.hashes[: p.max_blocks], prompt=p.info()).wait()
    result.lease.release()
    after = Counter(store.stats.miss_tokens)
    after.subtract(before)
    missed = +after
    assert len(result.block_ids) * BS + sum(missed.values()) == len(p.tokens), "every token served or missed once"
    return len(result.block_ids) * BS, missed


@pytest.fixture
def explain_cli(live_server):
    """``explain_cli(store, prompt) -> output``: ``kvtier explain --url ... --store s``."""

    def run(store: TieredStore, p: Prompt) -> str:
        server = live_server(lambda: _app(store))
        args = ["explain", "--url", server.url, "--store", "s", "--namespace", p.context.namespace().hex(),
                "--tokens", ",".join(map(str, p.tokens))]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert all(len(line) <= 80 for line in result.output.splitlines()), result.output
        return " ".join(result.output.split())  # long reasons wrap: compare words

    return run


def _app(store: TieredStore) -> web.Application:
    app = web.Application()
    setup_explain(app, lambda request: {"s": store})
    return app


def test_never_stored_and_partial_tail(tmp_path, explain_cli):
    store, ctx = make_store(tmp_path)
    p = prompt(3 * BS + 5, ctx, seed=1)
    loaded, missed = load(store, p)
    assert loaded == 0 and missed == {(misses.NEVER_STORED, ""): 3 * BS, (misses.PARTIAL_TAIL, ""): 5}
    out = explain_cli(store, p)
    assert "0-2 0-47 miss: never stored" in out
    assert "tail 48-52 miss: partial tail" in out
    assert "hit 0 of 53 prompt tokens" in out
    store.close()


@pytest.mark.parametrize("tier, disk, fills", [("CPU", 0, 2), ("DISK", 4, 3)])
def test_evicted_from_the_tier_that_held_the_last_copy(tmp_path, explain_cli, tier, disk, fills):
    """GPU 4 + CPU 4 (+ DISK 4) blocks: the 2 blocks stored first are the first pushed out
    of the last tier by 8 (12) newer ones; that tier's ghost list remembers them."""
    store, ctx = make_store(tmp_path, gpu=4, cpu=4, disk=disk)
    victim = prompt(2 * BS + 1, ctx, seed=2)
    assert put(store, victim) == 2
    for seed in range(3, 3 + fills):
        put(store, prompt(4 * BS, ctx, seed))
    assert all(store.medium_of(h) is None for h in victim.hashes)
    loaded, missed = load(store, victim)
    assert loaded == 0 and missed == {(misses.EVICTED, tier): 2 * BS, (misses.PARTIAL_TAIL, ""): 1}
    assert f"miss: evicted from {tier}" in explain_cli(store, victim)
    store.close()


def test_stored_under_another_namespace_names_the_field(tmp_path, explain_cli):
    plain, ctx_plain = make_store(tmp_path)
    adapter, ctx_lora = make_store(tmp_path, lora="x")
    tokens = prompt(3 * BS + 1, ctx_plain, seed=4).tokens
    put(plain, Prompt(tokens, ctx_plain))
    loaded, missed = load(adapter, Prompt(tokens, ctx_lora))
    assert loaded == 0 and missed == {(misses.OTHER_NAMESPACE, ""): 3 * BS, (misses.PARTIAL_TAIL, ""): 1}
    out = explain_cli(adapter, Prompt(tokens, ctx_lora))
    assert "miss: stored under another namespace: lora_name: 'x' here vs" in out and "None there" in out
    plain.close()
    adapter.close()


def _on_disk_only(tmp_path, p: Prompt, gpu: int = 4) -> TieredStore:
    """A store whose DISK holds ``p``'s blocks and whose memory tiers are empty (a restart)."""
    store, _ = make_store(tmp_path, gpu=gpu, cpu=4, disk=16)
    put(store, p)
    store.flush()
    store.close()
    store, _ = make_store(tmp_path, gpu=gpu, cpu=4, disk=16)
    assert [store.medium_of(h) for h in p.hashes] == ["DISK"] * len(p.hashes)
    return store


def test_failed_verification_then_after_gap(tmp_path, explain_cli):
    ctx = make_store(tmp_path)[1]
    p = prompt(4 * BS + 1, ctx, seed=5)
    store = _on_disk_only(tmp_path, p)
    corrupt = FaultPlan([Fault("read", "corrupt", keys={p.hashes[1]})])
    with inject_disk_faults(store, corrupt):
        loaded, missed = load(store, p)
    assert loaded == BS  # block 0; block 1 failed its check; 2 and 3 arrived but follow the gap
    assert missed == {(misses.FAILED_VERIFICATION, "DISK"): BS, (misses.AFTER_GAP, "DISK"): 2 * BS,
                      (misses.PARTIAL_TAIL, ""): 1}
    assert store.stats.load_failures_by_tier[("DISK", "corrupt")] == 1
    out = explain_cli(store, p)
    assert "0 0-15 hit GPU" in out
    assert "1 16-31 miss: failed verification on DISK (corrupt)" in out  # remembered: the record was dropped
    assert "2-3 32-63 miss: in GPU, but after an earlier miss" in out
    _, again = load(store, p)  # counted again, by the same reasons
    assert again[(misses.FAILED_VERIFICATION, "DISK")] == BS and again[(misses.AFTER_GAP, "GPU")] == 2 * BS
    store.close()


def test_a_verification_reason_added_later_is_a_failed_verification():
    """Reasons come from the load-failure strings, not a closed list: only transport
    failures and a token mismatch (its own reason) are something else."""
    assert misses.load_failure_reason("DISK", "some_check_added_later") == misses.FAILED_VERIFICATION
    assert misses.load_failure_reason("DISK", "token_mismatch") == misses.TOKEN_MISMATCH
    assert misses.load_failure_reason("REMOTE", "token_mismatch") == misses.TOKEN_MISMATCH
    assert misses.load_failure_reason("REMOTE", "corrupt") == misses.FAILED_VERIFICATION
    assert misses.load_failure_reason("REMOTE", "timeout") == misses.REMOTE_UNAVAILABLE
    assert misses.load_failure_reason("DISK", "missing") == misses.LOAD_FAILED


def test_load_failed_for_another_reason(tmp_path, explain_cli):
    ctx = make_store(tmp_path)[1]
    p = prompt(2 * BS + 1, ctx, seed=6)
    store = _on_disk_only(tmp_path, p)
    with inject_disk_faults(store, FaultPlan([Fault("read", "missing", keys={p.hashes[0]})])):
        loaded, missed = load(store, p)
    assert loaded == 0 and missed == {(misses.LOAD_FAILED, "DISK"): BS, (misses.AFTER_GAP, "DISK"): BS,
                                      (misses.PARTIAL_TAIL, ""): 1}
    assert "miss: load from DISK failed (missing)" in explain_cli(store, p)
    store.close()


def test_remote_unavailable_on_lookup_and_on_load(tmp_path, explain_cli):
    remote = MemoryRemote()
    store, ctx = make_store(tmp_path, remote=remote)
    p = prompt(3 * BS + 1, ctx, seed=7)
    with inject_remote_faults(remote, FaultPlan([Fault("lookup", "unavailable")])):
        loaded, missed = load(store, p)
        assert loaded == 0 and missed == {(misses.REMOTE_UNAVAILABLE, "REMOTE"): 3 * BS, (misses.PARTIAL_TAIL, ""): 1}
        assert "miss: REMOTE unavailable or timed out" in explain_cli(store, p)
    other, _ = make_store(tmp_path, lora=None, remote=remote)  # another process put it in REMOTE
    put(other, p)
    other.wait_for_writes()
    with inject_remote_faults(remote, FaultPlan([Fault("get", "timeout", delay_s=0.01)])):
        loaded, missed = load(store, p)
    # each read job's first block times out; a block after it in the same job is skipped
    # (the backend reports it missing): a load failure of its own
    assert loaded == 0 and missed[(misses.REMOTE_UNAVAILABLE, "REMOTE")] >= BS
    assert set(missed) <= {(misses.REMOTE_UNAVAILABLE, "REMOTE"), (misses.LOAD_FAILED, "REMOTE"),
                           (misses.PARTIAL_TAIL, "")}
    other.close()
    store.close()


def test_beyond_the_top_pools_capacity(tmp_path, explain_cli):
    store, ctx = make_store(tmp_path, gpu=4, cpu=8)
    p = prompt(6 * BS + 1, ctx, seed=8)
    assert put(store, p) == 6
    tiers = [str(store.medium_of(h)) for h in p.hashes]
    loaded, missed = load(store, p)
    expected = Counter({(misses.BEYOND_TOP_CAPACITY, t): BS for t in tiers[4:]} if tiers[4] != tiers[5] else
                       {(misses.BEYOND_TOP_CAPACITY, tiers[4]): 2 * BS})
    expected[(misses.PARTIAL_TAIL, "")] = 1
    assert loaded == 4 * BS and missed == expected
    tiers = [str(store.medium_of(h)) for h in p.hashes]  # the load moved blocks around
    assert f"miss: in {tiers[5]}, but beyond the top pool's capacity" in explain_cli(store, p)
    store.close()


def test_no_free_slot_when_every_top_slot_is_pinned(tmp_path, explain_cli):
    ctx = make_store(tmp_path)[1]
    p = prompt(2 * BS + 1, ctx, seed=9)
    store = _on_disk_only(tmp_path, p)
    busy = prompt(4 * BS, ctx, seed=10)
    put(store, busy)
    lease = store.lookup(busy.hashes, pin=True).lease  # four requests hold the whole top pool
    out = explain_cli(store, p)
    assert "miss: in DISK, but no free top-pool slot" in out
    loaded, missed = load(store, p)
    assert loaded == 0 and missed == {(misses.NO_FREE_SLOT, "DISK"): 2 * BS, (misses.PARTIAL_TAIL, ""): 1}
    lease.release()
    assert "hit DISK" in explain_cli(store, p)
    store.close()


def test_miss_tokens_are_exported_by_reason_and_tier(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from kvtier import metrics
    from kvtier.dashboard.stats import StatsHistory

    store, ctx = make_store(tmp_path)
    load(store, prompt(3 * BS + 5, ctx, seed=11))
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="m")
    text = generate_latest(registry).decode()
    assert 'kvtier_miss_tokens_total{namespace="m",reason="never_stored",tier=""} 48.0' in text
    assert 'kvtier_miss_tokens_total{namespace="m",reason="partial_tail",tier=""} 5.0' in text
    doc = StatsHistory(lambda: {"m": store}).document()
    assert doc["namespaces"]["m"]["miss_tokens"] == [
        {"reason": "never_stored", "tier": "", "tokens": 48}, {"reason": "partial_tail", "tier": "", "tokens": 5}]
    assert doc["total"]["miss_tokens"] == doc["namespaces"]["m"]["miss_tokens"]
    store.close()


@pytest.mark.slow  # loads a model twice
def test_explain_a_local_data_dir_with_the_connectors_key(tmp_path):
    """``kvtier explain --model tiny-llama --data-dir DIR``: the key the transformers
    connector uses for that model, the DISK tier a stopped engine left."""
    from kvtier.app.models import load_model
    from kvtier.connectors.hf import HFConnector

    model, _, model_id = load_model("tiny-llama")
    config = StoreConfig(gpu_bytes=0, cpu_bytes=1 << 24, disk_bytes=1 << 26, data_dir=tmp_path / "d")
    connector = HFConnector.from_model(model, config, model_id=model_id)
    tokens = list(range(100, 100 + 3 * BS + 2))
    prefill = model(torch.tensor([tokens]), use_cache=True)
    connector.after_request(tokens, prefill.past_key_values)
    connector.close()  # flushes to DISK
    args = ["explain", "--model", "tiny-llama", "--data-dir", str(tmp_path / "d"), "--tokens",
            ",".join(map(str, tokens + list(range(7000, 7000 + BS))))]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "0-2 0-47 hit DISK" in out and "3 48-63 miss: never stored" in out
    missing = CliRunner().invoke(main, ["explain", "--model", "tiny-llama", "--data-dir", str(tmp_path / "x"),
                                        "--tokens", "1,2,3"])
    assert missing.exit_code == 1 and "no DISK tier" in missing.output
