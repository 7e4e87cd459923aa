"""The HF connector on a tiny random Llama under faults and bad input: restarts and corrupt
records give the cold greedy output, bad token ids and caches raise typed errors, a reused
prefetch ticket, a full LMDB map, checkpoints that differ only where no prompt samples."""

from __future__ import annotations

import lmdb
import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.store import TieredStore
from kvtier.types import Medium
from tests.conftest import flip_byte, patch_record


HF_BLOCK = 16


def _hf_config(tmp_path, llama, gpu, cpu=0, disk_bytes=0) -> StoreConfig:
    from kvtier.connectors.hf import kv_spec_for

    nbytes = kv_spec_for(llama, HF_BLOCK).block_nbytes
    return StoreConfig(gpu_bytes=gpu * nbytes, cpu_bytes=cpu * nbytes, disk_bytes=disk_bytes, block_size=HF_BLOCK,
                       data_dir=tmp_path)


@pytest.fixture
def connectors():
    made = []
    yield lambda conn: made.append(conn) or conn
    for conn in made:
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass


def _connector(llama, config, emulate_gpu=False):
    """``emulate_gpu``: the GPU pool of ``config`` in host memory (a model on the CPU gets
    none: its budget joins the CPU pool), for the two-pool hierarchy of a CUDA machine."""
    from kvtier.connectors.hf import HFConnector

    conn = HFConnector.from_model(llama, config, model_id="tiny-llama")
    if not emulate_gpu:
        return conn
    conn.close()
    store = TieredStore(conn.store.spec, config, conn.namespace, device="cpu", emulate_gpu=True)
    return HFConnector(llama, store, conn.key_context)


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


def _generate(llama, input_ids, connector=None, plan=None, max_new_tokens=6):
    kwargs = {}
    if connector is not None:
        plan = plan or connector.before_prefill(input_ids)
        kwargs = plan.generate_kwargs()
    with torch.inference_mode():
        out = llama.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs)
    if connector is not None:
        connector.after_request(out[0], plan.cache)
    return out[0, input_ids.shape[1] :].tolist(), plan


def test_hf_turns_restart_and_a_corrupt_record_give_the_cold_greedy_output(llama, tmp_path, connectors):
    config = _hf_config(tmp_path, llama, gpu=64, disk_bytes=32 << 20)
    history = _prompt(40, seed=1)
    conn = connectors(_connector(llama, config))
    for turn in range(4):
        if turn == 2:  # restart, with one DISK record of the history damaged in between
            hashes = conn.block_hashes(history[0])
            conn.close()
            env = lmdb.open(str(tmp_path / "disk"), map_size=1 << 30)
            with env.begin(write=True) as txn:
                patch_record(txn, hashes[2], flip_byte(500, 0x10))
            env.close()
            conn = connectors(_connector(llama, config))
        cold, _ = _generate(llama, history)
        warm, plan = _generate(llama, history, conn)
        assert warm == cold, f"turn {turn}"
        if turn == 2:
            assert plan.num_cached_tokens == 2 * HF_BLOCK and conn.store.stats.load_failures == {"corrupt": 1}
        elif turn:
            assert plan.num_cached_tokens >= HF_BLOCK * 2
        history = torch.cat([history, torch.tensor([cold]), _prompt(19, seed=10 + turn)], dim=1)
    conn.store.check_invariants()


def test_hf_bad_inputs_raise_value_error_and_leave_the_store_intact(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=16)))
    ids = _prompt(40, seed=3)
    _generate(llama, ids, conn)
    for bad in (torch.zeros(2, 40, dtype=torch.long), torch.zeros(1, 1, 5, dtype=torch.long),
                torch.tensor(5), torch.zeros(1, 0, dtype=torch.long), [-1] * 40, []):
        with pytest.raises(ValueError, match="expected"):
            conn.before_prefill(bad)
        with pytest.raises(ValueError, match="expected"):
            conn.prefetch(bad)
    with torch.inference_mode():
        out = llama(_prompt(40, seed=4), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    with pytest.raises(ValueError, match="expected"):
        conn.after_request(torch.full((40,), -3), cache)
    with pytest.raises(ValueError, match="expected"):
        conn.after_request(torch.zeros(2, 40, dtype=torch.long), cache)
    assert conn.before_prefill(ids).num_cached_tokens == 32
    conn.store.check_invariants()


def test_hf_reused_prefetch_ticket_never_serves_reused_slots(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=4)))
    ids = _prompt(50, seed=1)
    cold, _ = _generate(llama, ids)
    _generate(llama, ids, conn)
    ticket = conn.prefetch(ids)
    first, _ = _generate(llama, ids, conn, plan=conn.before_prefill(ids, ticket))
    assert first == cold
    _generate(llama, _prompt(70, seed=2), conn)  # other traffic takes the slots
    retry, _ = _generate(llama, ids, conn, plan=conn.before_prefill(ids, ticket))
    assert retry == cold


def test_hf_float_token_ids_are_refused(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=4)))
    with pytest.raises((TypeError, ValueError), match="expected"):
        conn.block_hashes(torch.full((16,), 3.7))
    with pytest.raises((TypeError, ValueError), match="expected"):
        conn.before_prefill(torch.full((1, 20), 3.7))


def test_hf_after_request_without_a_cache_raises_a_typed_error(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=4)))
    with pytest.raises((TypeError, ValueError), match="expected"):
        conn.after_request(_prompt(40)[0], None)


@pytest.mark.xfail(strict=True, reason="LIMITATION: a load lands in the top pool, so HFConnector.before_prefill "
                   "serves at most top.num_blocks blocks (here 4 of 10, all stored, from CPU); fix: load and gather "
                   "in chunks of the top pool")
def test_hf_after_request_stores_a_request_longer_than_the_gpu_pool(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=4, cpu=64), emulate_gpu=True))
    ids = _prompt(10 * HF_BLOCK + 3, seed=5)
    cold, _ = _generate(llama, ids, conn)
    assert conn.store.lookup(conn.block_hashes(ids[0])).num_hit_blocks == 10
    warm, plan = _generate(llama, ids, conn)
    assert plan.num_cached_tokens == 10 * HF_BLOCK and warm == cold


def test_hf_after_request_with_a_grad_cache_keeps_the_pool_out_of_autograd(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=8)))
    ids = _prompt(40, seed=6)
    out = llama(ids, use_cache=True)  # no torch.no_grad(): K/V require grad
    cache = getattr(out, "cache", None) or out.past_key_values
    assert conn.after_request(ids[0], cache) == 2
    assert not conn.store.top.tensor.requires_grad and conn.store.top.tensor.grad_fn is None


def test_hf_prefill_counts_queried_and_hit_blocks_once_regression_m1(llama, tmp_path, connectors):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=16)))
    ids = _prompt(5 * HF_BLOCK + 1, seed=7)
    _generate(llama, ids[:, : 2 * HF_BLOCK + 1], conn)  # blocks 0-1 cached
    before_lookups, before_hits = conn.store.stats.lookup_blocks, sum(conn.store.stats.hit_blocks.values())
    plan = conn.before_prefill(ids)
    assert plan.num_cached_tokens == 2 * HF_BLOCK
    assert conn.store.stats.lookup_blocks - before_lookups == 5
    assert sum(conn.store.stats.hit_blocks.values()) - before_hits == 2


def _served_vs_own_keys(llama_a, llama_b, tmp_path, ids) -> tuple[int, float]:
    """Store ``ids`` through model A, then prefill model B from the same data_dir; returns
    (cached tokens served to B, max |served K - B's own K|) over every layer."""
    config = _hf_config(tmp_path, llama_a, gpu=64, disk_bytes=32 << 20)
    first = _connector(llama_a, config)
    try:
        _generate(llama_a, ids, first)
    finally:
        first.close()
    second = _connector(llama_b, config)
    try:
        plan = second.before_prefill(ids)
        n = plan.num_cached_tokens
        if n == 0:
            return 0, 0.0
        with torch.inference_mode():
            out = llama_b(ids, use_cache=True)
        own = getattr(out, "cache", None) or out.past_key_values
        from kvtier.connectors.hf import _cache_layers

        served_keys, _ = _cache_layers(plan.cache)
        own_keys, _ = _cache_layers(own)
        diff = max((s - o[:, :, :n]).abs().max().item() for s, o in zip(served_keys, own_keys))
        return n, diff
    finally:
        second.close()


def test_hf_checkpoints_differing_in_unsampled_weights_do_not_share_blocks(llama, tmp_path):
    import copy

    edited = copy.deepcopy(llama)
    with torch.no_grad():  # row 201 of the 256x64 embedding holds no sampled element
        edited.model.embed_tokens.weight[201] = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    ids = _prompt(50, seed=3)
    ids[0, 5] = 201
    n, diff = _served_vs_own_keys(llama, edited, tmp_path, ids)
    assert n == 0 or diff <= 1e-5, f"{n} cached tokens served with K off by {diff:.3f}"


def test_hf_same_weights_with_another_rope_config_do_not_share_blocks(llama, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=500.0,
    )
    other = transformers.LlamaForCausalLM(cfg).eval()
    other.load_state_dict(llama.state_dict())
    n, diff = _served_vs_own_keys(llama, other, tmp_path, _prompt(50, seed=3))
    assert n == 0 or diff <= 1e-5, f"{n} cached tokens served with K off by {diff:.3f}"


def test_hf_turns_with_a_full_lmdb_map_match_cold_output_and_never_raise_regression_d3(
    llama, tmp_path, connectors, caplog
):
    conn = connectors(_connector(llama, _hf_config(tmp_path, llama, gpu=2, disk_bytes=32 << 20)))
    first = _prompt(40, seed=11)
    _generate(llama, first, conn)
    _generate(llama, _prompt(40, seed=12), conn)  # pushes `first` down to DISK
    assert conn.store.medium_of(conn.block_hashes(first[0])[0]) is Medium.DISK
    env = conn.store.disk.env
    env.set_mapsize((env.info()["last_pgno"] + 4) * conn.store.disk.page_nbytes)  # the map is now full
    history = _prompt(40, seed=13)
    for turn in range(3):  # every turn spills; the writes find no room
        cold, _ = _generate(llama, history)
        warm, _ = _generate(llama, history, conn)
        assert warm == cold, f"turn {turn}"
        history = torch.cat([history, torch.tensor([cold]), _prompt(19, seed=20 + turn)], dim=1)
    cold, _ = _generate(llama, first)
    warm, plan = _generate(llama, first, conn)
    assert plan.num_cached_tokens == 32 and warm == cold  # written before the map filled: still read
    assert any("DISK write" in r.getMessage() for r in caplog.records), "the map never filled: nothing tested"
    conn.store.check_invariants()

