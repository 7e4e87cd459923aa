"""HF connector keys (issue 11, item 4): a K/V-relevant config change under one explicit
``model_revision`` misses, and the output equals a cold run."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier.config import StoreConfig
from kvtier.connectors.hf import HFConnector

BLOCK = 16


def tiny_llama(rope_theta: float = 10000.0, state_dict=None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )
    model = LlamaForCausalLM(cfg).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def greedy(model, ids, connector=None, max_new_tokens=6):
    kwargs, plan = {}, None
    if connector is not None:
        plan = connector.before_prefill(ids)
        kwargs = plan.generate_kwargs()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs)
    if connector is not None:
        connector.after_request(out[0], plan.cache)
    return out[0, ids.shape[1]:].tolist(), plan


@pytest.fixture
def config(tmp_path):
    return StoreConfig(gpu_bytes=0, cpu_bytes=4 << 20, disk_bytes=64 << 20, block_size=BLOCK, data_dir=tmp_path)


def test_rope_change_under_one_explicit_revision_misses_and_matches_cold(config):
    """Issue 11: ``model_revision`` replaced the config fingerprint, so a RoPE theta change
    with the same revision string hit K/V computed under the old theta."""
    ids = torch.randint(3, 256, (1, 50), generator=torch.Generator().manual_seed(1))
    old = tiny_llama(10000.0)
    conn = HFConnector.from_model(old, config, model_id="llama", model_revision="v1")
    greedy(old, ids, conn)
    conn.close()

    new = tiny_llama(500000.0, state_dict=old.state_dict())  # same weights, same revision string
    cold, _ = greedy(new, ids)
    conn = HFConnector.from_model(new, config, model_id="llama", model_revision="v1")
    try:
        warm, plan = greedy(new, ids, conn)
        assert plan.num_cached_tokens == 0
        assert warm == cold
    finally:
        conn.close()

    # the same config under the same revision still hits from DISK (keys not too strict: K3)
    again = tiny_llama(10000.0, state_dict=old.state_dict())
    conn = HFConnector.from_model(again, config, model_id="llama", model_revision="v1")
    try:
        warm, plan = greedy(again, ids, conn)
        assert plan.num_cached_tokens == 48
        assert warm == greedy(again, ids)[0]
    finally:
        conn.close()


@pytest.mark.slow  # three generate runs of a tiny model; the RoPE test is the fast lane's
def test_a_block_hash_collision_never_serves_another_prompts_kv(monkeypatch, config):
    """Issue 11, item 5: a hit was decided by the block hash alone. With a weak hash against
    an adversary (simulated: a block hash that ignores the tokens, so every prompt of one
    length collides), the second prompt must get no K/V of the first: the blocks' token
    fingerprints differ, the hit is a miss counted ``token_mismatch``, the output is cold's."""
    import kvtier.hashing as hashing

    real = hashing._digest
    domain = len(hashing._BLOCK_DOMAIN)
    monkeypatch.setattr(hashing, "_digest", lambda name, data: real(name, data[: domain + 1 + data[domain]]))
    model = tiny_llama()
    first = torch.randint(3, 256, (1, 50), generator=torch.Generator().manual_seed(2))
    second = torch.randint(3, 256, (1, 50), generator=torch.Generator().manual_seed(3))
    conn = HFConnector.from_model(model, config, model_id="llama", model_revision="v1")
    try:
        assert conn.block_hashes(first[0]) == conn.block_hashes(second[0])  # the collision
        greedy(model, first, conn)
        warm, plan = greedy(model, second, conn)
        assert plan.num_cached_tokens == 0
        assert warm == greedy(model, second)[0]
        assert conn.store.stats.load_failures["token_mismatch"] == 1
        # the first prompt still hits its own blocks
        again, plan = greedy(model, first, conn)
        assert plan.num_cached_tokens == 48 and again == greedy(model, first)[0]
    finally:
        conn.close()


def test_multi_turn_keys_reuse_the_last_turns_and_hit_exactly(config):
    """Issue 17: a turn's prompt (the last turn's prompt and output plus a new message) is
    keyed from the last call's keys (``PrefixKeys``); the keys are block_keys_for's and the
    hit's output equals a cold run's."""
    from kvtier.hashing import block_keys_for

    model = tiny_llama()
    conn = HFConnector.from_model(model, config, model_id="llama", model_revision="v1")
    try:
        ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
        cached = 0  # the last turn's whole blocks (its cache holds prompt + output - 1 tokens)
        for _ in range(3):
            cold, _ = greedy(model, ids)
            warm, plan = greedy(model, ids, conn)
            assert warm == cold
            assert plan.num_cached_tokens == cached
            cached = (ids.shape[1] + len(warm) - 1) // BLOCK * BLOCK
            tokens = ids[0].tolist()
            assert conn.block_keys(ids) == block_keys_for(tokens, conn.namespace, BLOCK)
            ids = torch.cat([ids, torch.tensor([warm]), torch.randint(3, 256, (1, 9))], dim=1)
        # each hook after the first keyed the conversation so far from the last call's keys
        assert conn._prefix_keys.reused_blocks >= 10
    finally:
        conn.close()
