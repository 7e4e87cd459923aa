"""The prefill after a hit runs causal SDPA, not the masked rectangle (kvtier.connectors.hf_attention)."""

from __future__ import annotations

import pytest
import torch

from kvtier.app.families import SUPPORTED, tiny_model
from kvtier.config import StoreConfig
from kvtier.connectors import hf_attention
from kvtier.connectors.hf import HFConnector, cache_kwarg
from kvtier.connectors.hf_attention import ATTN_IMPLEMENTATION, PrefixAttention, prefix_causal_sdpa

sdpa = pytest.importorskip("transformers.integrations.sdpa_attention").sdpa_attention_forward
BLOCK = 16


class _Module(torch.nn.Module):
    """What sdpa_attention_forward reads of an attention layer."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _qkv(q_len: int, kv_len: int, heads: int = 4, kv_heads: int = 2, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    full_q = torch.randn(1, heads, kv_len, dim, generator=g)
    k, v = (torch.randn(1, kv_heads, kv_len, dim, generator=g) for _ in range(2))
    return full_q, full_q[:, :, kv_len - q_len:], k, v


def _lower_right(q_len: int, kv_len: int) -> torch.Tensor:
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]


@pytest.fixture
def calls(monkeypatch):
    """The masks prefix_causal_sdpa hands to transformers' sdpa_attention_forward."""
    hf_attention._register()
    seen: list[torch.Tensor | None] = []
    real = hf_attention._sdpa_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(hf_attention, "_sdpa_forward", spy)
    return seen


@pytest.mark.parametrize("q_len, kv_len", [(40, 48), (33, 40), (2, 3)])
def test_rows_equal_the_causal_full_prefill_bit_for_bit(calls, q_len, kv_len):
    full_q, q, k, v = _qkv(q_len, kv_len)
    module = _Module(groups=2)
    full, _ = sdpa(module, full_q, k, v, None, scaling=0.25)  # the prefill without a cache
    masked, _ = sdpa(module, q, k, v, _lower_right(q_len, kv_len), scaling=0.25)  # transformers after a hit
    out, _ = prefix_causal_sdpa(module, q, k, v, _lower_right(q_len, kv_len), scaling=0.25)
    assert calls == [None]  # the causal call, no mask
    assert out.shape == (1, q_len, 4, 16)
    assert torch.equal(out, full[:, kv_len - q_len:])
    assert torch.allclose(out, masked, atol=1e-6)


def _sliding(q_len: int, kv_len: int, window: int) -> torch.Tensor:
    mask = _lower_right(q_len, kv_len).clone()
    mask[0, 0] &= ~torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len - window)
    return mask


@pytest.mark.parametrize("case", ["sliding window", "float mask", "prefix over 40%", "decode step", "batch of 2",
                                  "no prefix", "softcap"])
def test_every_other_call_is_transformers_sdpa_with_its_mask(calls, case):
    q_len, kv_len, batch, kwargs = 40, 48, 1, {}
    mask = _lower_right(q_len, kv_len)
    if case == "sliding window":
        mask = _sliding(q_len, kv_len, window=8)
    elif case == "float mask":
        mask = torch.zeros(1, 1, q_len, kv_len).masked_fill(~mask, float("-inf"))
    elif case == "prefix over 40%":
        q_len = 20
        mask = _lower_right(q_len, kv_len)
    elif case == "decode step":
        q_len = 1
        mask = _lower_right(q_len, kv_len)
    elif case == "batch of 2":
        batch, mask = 2, mask.expand(2, 1, q_len, kv_len)
    elif case == "no prefix":
        q_len, mask = kv_len, None
    elif case == "softcap":
        kwargs = {"softcap": 30.0}
    _, q, k, v = _qkv(q_len, kv_len)
    q, k, v = (t.expand(batch, *t.shape[1:]) for t in (q, k, v))
    module = _Module(groups=2)
    if case == "softcap":  # transformers' sdpa refuses it; so does the prefix path, the same way
        with pytest.raises(ValueError, match="softcap"):
            prefix_causal_sdpa(module, q, k, v, mask, **kwargs)
        assert len(calls) == 1 and calls[0] is mask
        return
    out, _ = prefix_causal_sdpa(module, q, k, v, mask)
    expected, _ = sdpa(module, q, k, v, mask)
    assert len(calls) == 1 and calls[0] is mask
    assert torch.equal(out, expected)


def test_a_mask_that_is_not_lower_right_causal_is_recognised():
    assert hf_attention.is_lower_right_causal(_lower_right(5, 9), 5, 9)
    padded = _lower_right(5, 9).clone()
    padded[..., 0] = False  # left padding
    assert not hf_attention.is_lower_right_causal(padded, 5, 9)
    assert not hf_attention.is_lower_right_causal(_lower_right(5, 9).transpose(-1, -2), 9, 5)
    assert not hf_attention.is_lower_right_causal(_lower_right(5, 9)[0], 5, 9)
    assert not hf_attention.is_lower_right_causal(None, 5, 9)


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_armed_forward_runs_on_the_prefix_attention_then_sdpa_again(model, calls, monkeypatch):
    assert model.config._attn_implementation == "sdpa"
    compared = []
    real_equal = torch.equal
    monkeypatch.setattr(hf_attention.torch, "equal", lambda a, b: compared.append(1) or real_equal(a, b))
    prefix = PrefixAttention(model)
    assert prefix.enabled
    seen: list[str] = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a: seen.append(m.config._attn_implementation))
    try:
        ids = _prompt(64)  # a 16-token prefix: 25% of the keys
        with torch.inference_mode():
            cache_out = model(ids[:, :16], use_cache=True)
            prefix.arm()
            model(ids[:, 16:], use_cache=True, **{cache_kwarg(model): cache_out.past_key_values})
            model(ids[:, :1])  # the next forward: not armed
        assert seen == ["sdpa", ATTN_IMPLEMENTATION, "sdpa"]
        assert model.config._attn_implementation == "sdpa"
        assert calls.count(None) == 3  # the padded call on each of the 3 layers of the armed forward
        assert len(compared) == 1  # the layers share one mask: compared once
    finally:
        hook.remove()
        prefix.close()


def test_a_forward_that_raises_still_gives_the_model_back_its_sdpa(model):
    prefix = PrefixAttention(model)
    hook = model.model.layers[0].register_forward_pre_hook(lambda m, a: 1 / 0)
    try:
        prefix.arm()
        with pytest.raises(ZeroDivisionError), torch.inference_mode():
            model(_prompt(20))
        assert model.config._attn_implementation == "sdpa"
    finally:
        hook.remove()
        prefix.close()


def test_a_model_on_another_implementation_is_left_alone(model, calls):
    model.set_attn_implementation("eager")
    prefix = PrefixAttention(model)
    try:
        prefix.arm()
        with torch.inference_mode():
            model(_prompt(20))
        assert model.config._attn_implementation == "eager" and calls == []
    finally:
        prefix.close()
        model.set_attn_implementation("sdpa")


def test_a_hit_s_prefill_equals_the_full_prefill_and_skips_the_mask(model, calls, tmp_path):
    """The connector arms it: after a 16-token hit on a 64-token prompt the suffix's logits are
    the full prefill's bit for bit, every layer ran causal SDPA, and the model is on sdpa after."""
    config = StoreConfig(gpu_bytes=4 << 20, cpu_bytes=4 << 20, disk_bytes=64 << 20, block_size=BLOCK,
                         data_dir=tmp_path)
    connector = HFConnector.from_model(model, config, model_id="tiny-llama")
    try:
        ids = _prompt(64, seed=3)
        with torch.inference_mode():
            full = model(ids, use_cache=True)
        connector.after_request(ids[0, :17], full.past_key_values)  # stores the first block
        plan = connector.before_prefill(ids)
        assert plan.num_cached_tokens == BLOCK
        calls.clear()
        with torch.inference_mode():
            suffix = model(ids[:, BLOCK:], use_cache=True, **plan.generate_kwargs())
        assert calls == [None] * 3
        assert torch.equal(suffix.logits[0], full.logits[0, BLOCK:])
        assert model.config._attn_implementation == "sdpa"
        calls.clear()
        plan = connector.before_prefill(_prompt(64, seed=4))  # a miss: nothing armed
        assert plan.num_cached_tokens == 0
        with torch.inference_mode():
            model(_prompt(64, seed=4), use_cache=True, **plan.generate_kwargs())
        assert calls == []  # transformers' own sdpa ran, not the prefix attention
    finally:
        connector.close()



FAMILIES = tuple(SUPPORTED)


def _causal_layers(text, kv_len: int) -> int:
    """Layers whose mask for a prompt of ``kv_len`` tokens is plain causal: full attention, or
    a sliding window / attention chunk no shorter than the prompt (from the config alone)."""
    types = getattr(text, "layer_types", None) or text.num_hidden_layers * [
        "sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"]
    span = {"full_attention": kv_len, "sliding_attention": getattr(text, "sliding_window", None) or kv_len,
            "chunked_attention": getattr(text, "attention_chunk_size", None) or kv_len}
    return sum(span[t] >= kv_len for t in types)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_s_prefill_after_a_hit_equals_its_full_prefill(name, calls, tmp_path):
    """A 64-token hit on a 200-token prompt: the suffix's logits are the full prefill's bit for
    bit; on SDPA models every layer's call went through the prefix attention, the full-attention
    ones causal (no mask), the sliding or chunked ones with their own mask."""
    model = tiny_model(name)
    config = StoreConfig(gpu_bytes=0, cpu_bytes=16 << 20, disk_bytes=0, block_size=BLOCK, data_dir=tmp_path)
    connector = HFConnector.from_model(model, config, model_id=name)
    try:
        ids = torch.randint(3, 250, (1, 200), generator=torch.Generator().manual_seed(1))
        cold = connector.before_prefill(ids)  # a miss: kvtier's cache keeps every position
        with torch.inference_mode():
            full = model(ids, use_cache=True, **cold.generate_kwargs())
        assert connector.after_request(ids[0, :65], cold.cache) == 4
        plan = connector.before_prefill(ids)
        assert plan.num_cached_tokens == 64
        calls.clear()
        with torch.inference_mode():
            out = model(ids[:, 64:], use_cache=True, **plan.generate_kwargs())
        assert torch.equal(out.logits[0], full.logits[0, 64:])
        text = model.config.get_text_config()
        if text._attn_implementation != "sdpa":  # eager (soft-capping, sinks): never swapped
            assert calls == []
            return
        assert len(calls) == text.num_hidden_layers
        assert calls.count(None) == _causal_layers(text, 200)
    finally:
        connector.close()


def test_the_last_mask_checked_is_remembered_until_it_changes(monkeypatch):
    compared = []
    real_equal = torch.equal
    monkeypatch.setattr(hf_attention.torch, "equal", lambda a, b: compared.append(1) or real_equal(a, b))
    mask = _lower_right(5, 9).clone()
    assert hf_attention.is_lower_right_causal(mask, 5, 9)
    assert hf_attention.is_lower_right_causal(mask, 5, 9)  # every layer of a forward: one comparison
    assert len(compared) == 1
    mask[0, 0, 0, 0] = False  # the same tensor edited in place: checked again
    assert not hf_attention.is_lower_right_causal(mask, 5, 9)
    other = _lower_right(5, 9)
    assert hf_attention.is_lower_right_causal(other, 5, 9)
    assert len(compared) == 3


def test_alternating_masks_are_each_compared_once(monkeypatch):
    """gemma3- and qwen2-like stacks alternate sliding and full layers: two masks, two comparisons."""
    compared = []
    real_equal = torch.equal
    monkeypatch.setattr(hf_attention.torch, "equal", lambda a, b: compared.append(1) or real_equal(a, b))
    hf_attention.forget_checked_masks()
    full, sliding = _lower_right(40, 48), _sliding(40, 48, window=8)
    for _ in range(4):
        assert hf_attention.is_lower_right_causal(full, 40, 48)
        assert not hf_attention.is_lower_right_causal(sliding, 40, 48)
    assert len(compared) == 2


@pytest.mark.parametrize("name", ["position_bias", "s_aux", "sinks"])
def test_a_tensor_argument_that_changes_the_scores_falls_back_without_asking_its_truth(calls, name):
    """A position bias or sinks given as a tensor (transformers' Inkling passes position_bias to
    sdpa): transformers' sdpa gets the call as it came, mask included."""
    _, q, k, v = _qkv(40, 48)
    module = _Module(groups=2)
    mask = _lower_right(40, 48)
    extra = torch.randn(1, 4, 40, 48) if name == "position_bias" else torch.zeros(4)
    out, _ = prefix_causal_sdpa(module, q, k, v, mask, **{name: extra})
    assert len(calls) == 1 and calls[0] is mask
    expected, _ = sdpa(module, q, k, v, mask, **{name: extra})
    assert torch.equal(out, expected)


def test_a_forward_interrupted_by_a_base_exception_is_put_right_before_the_next_one(model):
    """torch runs always_call hooks after an Exception only: after a KeyboardInterrupt the next
    forward (or arm, disarm, close) restores sdpa before anything runs on it."""
    prefix = PrefixAttention(model)
    seen: list[str] = []
    interrupt = [True]

    def layer_hook(module, args):
        seen.append(module.config._attn_implementation)
        if interrupt[0]:
            raise KeyboardInterrupt

    hook = model.model.layers[0].self_attn.register_forward_pre_hook(layer_hook)
    try:
        prefix.arm()
        with pytest.raises(KeyboardInterrupt), torch.inference_mode():
            model(_prompt(20))
        interrupt[0] = False
        with torch.inference_mode():
            model(_prompt(20))
        assert seen == [ATTN_IMPLEMENTATION, "sdpa"]
        assert model.config._attn_implementation == "sdpa"
        prefix.arm()
        with pytest.raises(KeyboardInterrupt), torch.inference_mode():
            interrupt[0] = True
            model(_prompt(20))
        prefix.disarm()
        assert model.config._attn_implementation == "sdpa"
    finally:
        hook.remove()
        prefix.close()
