"""The K/V-relevant config fields in the namespace (kvtier.model_keys; issue 11, item 4)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashing import KeyContext
from kvtier.model_keys import KV_CONFIG_FIELDS, canonical, kv_config_bytes, kv_config_fields

transformers = pytest.importorskip("transformers")


def namespace_of(fields: dict, revision: str = "r1") -> bytes:
    return KeyContext(model_id="m", model_revision=revision, kv_config=kv_config_bytes(fields)).namespace()


# -- the encoding ------------------------------------------------------------------------------
_scalars = st.one_of(
    st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8,
)
_configs = st.dictionaries(st.sampled_from(KV_CONFIG_FIELDS), _values, min_size=1, max_size=10)


def same_meaning(a, b) -> bool:
    """The oracle: equal values of the same kind (a bool is not a number; 1 and 1.0 are the
    same number; a list and a tuple the same sequence), written apart from kvtier's code."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_meaning(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same_meaning(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(base=_configs, field=st.sampled_from(KV_CONFIG_FIELDS), value=_values)
def test_contexts_that_differ_in_any_kv_config_field_give_different_namespaces(base, field, value):
    changed = dict(base)
    changed[field] = value
    same = same_meaning(changed[field], base.get(field))
    assert (namespace_of(changed) == namespace_of(base)) == same
    # whatever the model_revision string says
    assert (namespace_of(changed, "same-revision") == namespace_of(base, "same-revision")) == same


@settings(max_examples=100, deadline=None)
@given(base=_configs)
def test_the_encoding_is_canonical_key_order_and_number_types(base):
    reordered = dict(reversed(list(base.items())))
    assert kv_config_bytes(reordered) == kv_config_bytes(base)
    floats = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**52 else v
              for k, v in base.items()}
    assert kv_config_bytes(floats) == kv_config_bytes(base)


def test_canonical_values():
    assert canonical(10000.0) == 10000 and canonical(0.5) == 0.5
    assert canonical(True) is True and canonical(1) == 1 and canonical(True) != canonical(1.5)
    assert canonical(float("nan")) == "nan" and canonical(float("-inf")) == "-inf"
    assert canonical({"b": (1, 2.0), "a": None}) == {"a": None, "b": [1, 2]}
    with pytest.raises(TypeError, match="plain types"):
        canonical(object())


def test_kv_config_is_a_tagged_field_that_never_collides_with_another():
    # the same bytes in kv_config and in another field's place give other namespaces (K2)
    fields = kv_config_bytes({"rope_theta": 1})
    a = KeyContext(model_id="m", kv_config=fields).namespace()
    b = KeyContext(model_id="m", model_revision=fields.hex()).namespace()
    c = KeyContext(model_id="m").namespace()
    assert len({a, b, c}) == 3
    with pytest.raises(ValueError, match="kv_config"):
        KeyContext(model_id="m", kv_config="not bytes")  # type: ignore[arg-type]


# -- real transformers configs -----------------------------------------------------------------
def _set(cfg, path: str, value) -> None:
    """``rope_parameters.rope_theta`` style assignment on a config (copy first)."""
    head, _, rest = path.partition(".")
    if not rest:
        setattr(cfg, head, value)
        return
    inner = copy.deepcopy(getattr(cfg, head))
    inner[rest] = value
    setattr(cfg, head, inner)


def _llama():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=128)


KV_CHANGES = [
    (_llama, "rope_parameters.rope_theta", 500000.0),
    (_llama, "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    (_llama, "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    (_llama, "max_position_embeddings", 4096),
    (_llama, "head_dim", 32),
    (_llama, "num_key_value_heads", 4),
    (_llama, "num_hidden_layers", 3),
    (_llama, "rms_norm_eps", 1e-5),
    (_llama, "hidden_act", "gelu"),
    (lambda: transformers.Qwen2Config(num_hidden_layers=4), "sliding_window", 2048),
    (lambda: transformers.Qwen2Config(num_hidden_layers=4), "layer_types",
     ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    (lambda: transformers.MistralConfig(), "sliding_window", 1024),
    (lambda: transformers.Gemma2Config(), "query_pre_attn_scalar", 128),
    (lambda: transformers.Gemma2Config(), "attn_logit_softcapping", 30.0),
    (lambda: transformers.Gemma3TextConfig(), "rope_parameters.sliding_attention",
     {"rope_type": "default", "rope_theta": 20000.0}),
    (lambda: transformers.GptOssConfig(), "rope_parameters.factor", 16.0),
    (lambda: transformers.DeepseekV3Config(), "kv_lora_rank", 256),
    (lambda: transformers.DeepseekV3Config(), "qk_rope_head_dim", 32),
    (lambda: transformers.DeepseekV3Config(), "qk_nope_head_dim", 64),
    (lambda: transformers.DeepseekV3Config(), "v_head_dim", 64),
    (lambda: transformers.Llama4TextConfig(), "attention_chunk_size", 4096),
    (lambda: transformers.Llama4TextConfig(), "no_rope_layers", [1, 0, 1, 0]),
]


@pytest.mark.parametrize("make, path, value", KV_CHANGES, ids=[f"{m().model_type}:{p}" for m, p, _ in KV_CHANGES])
def test_a_kv_relevant_change_to_a_real_config_changes_the_namespace(make, path, value):
    base, changed = make(), make()
    _set(changed, path, value)
    assert kv_config_fields(changed) != kv_config_fields(base)
    assert namespace_of(kv_config_fields(changed)) != namespace_of(kv_config_fields(base))


@pytest.mark.parametrize("path, value", [("use_cache", False), ("output_attentions", True), ("bos_token_id", 7),
                                         ("attention_dropout", 0.1), ("initializer_range", 0.5)])
def test_fields_that_never_change_kv_stay_out_of_the_key_k3(path, value):
    base, changed = _llama(), _llama()
    _set(changed, path, value)
    assert kv_config_bytes(kv_config_fields(changed)) == kv_config_bytes(kv_config_fields(base))


def test_kv_cache_dtype_variants_give_different_namespaces():
    cfg = _llama()
    names = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "fp8", "fp8_e4m3", "fp8_e5m2", "auto"]
    spaces = {namespace_of(kv_config_fields(cfg, kv_cache_dtype=name)) for name in names}
    assert len(spaces) == len(names)


def test_multimodal_configs_key_their_text_config_and_media_fields():
    base = transformers.LlavaConfig(text_config=_llama().to_dict())
    text = copy.deepcopy(base)
    text.text_config.rope_parameters = {"rope_type": "default", "rope_theta": 123.0}
    media = copy.deepcopy(base)
    media.image_token_index = 5
    vision = copy.deepcopy(base)
    vision.vision_config.image_size = 448
    fields = [kv_config_bytes(kv_config_fields(c)) for c in (base, text, media, vision)]
    assert len(set(fields)) == 4
    assert kv_config_fields(base)["rope_parameters"] == {"rope_theta": 10000, "rope_type": "default"}
