"""The K/V-relevant fields of a model config: a key field of their own (``KeyContext.kv_config``).

A weights digest or revision string names the weights; it does not name how the model uses
them. With the same weights, a changed RoPE theta or scaling, a sliding window, a number of
K/V heads or an attention scale gives other K/V bytes, so those fields enter the namespace on
their own, always, whatever ``model_revision`` says (issue 11: a RoPE change under the same
revision string used to hit K/V computed under the old config).

What is in (:data:`KV_CONFIG_FIELDS`): every config field that the forward pass reads to
compute K and V and that the weights' shapes do not already pin: attention geometry (layers,
heads, K/V heads, head dims, MLA ranks), positions (RoPE type, theta, scaling, partial
rotary factor, the position limits RoPE depends on, layers without RoPE, M-RoPE sections),
windows (sliding window(s), ``layer_types``, chunked attention), attention scaling and
softcapping, and what shapes the hidden states every later layer's K/V is computed from
(norm epsilons, activations, residual/embedding multipliers, MoE routing). The K/V cache
dtype (fp8 variants included) is given by the connector. For a multimodal model the text
config is read (``get_text_config()``), plus the few top-level fields that place and embed
media (:data:`MULTIMODAL_FIELDS`) and the vision config (every field but bookkeeping).

Not in: tokenizer and generation settings, ``vocab_size``, dropout, output flags, the
transformers version: they never change K/V bytes, and a key that changes with them misses
for nothing (case K3). Numerically equivalent kernels (the attention implementation, the
device) are not in the key either: like batch composition, they change only the last bits.

Encoding (:func:`kv_config_bytes`): msgpack of a normalized map, keys sorted, so two equal
configs give equal bytes in every process: ``None`` fields are dropped at the top level
(absent and unset mean the same), an integral float is an int (``1e4 == 10000``; within
int64), other floats are float64, non-finite floats are their names, tuples are lists, dtypes their names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack

KV_CONFIG_FIELDS: tuple[str, ...] = (
    # geometry
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim", "v_head_dim",
    "multi_query", "num_kv_heads", "kv_channels", "n_head_kv",
    # positions (transformers 5.x keeps RoPE in rope_parameters; 4.x in rope_theta / rope_scaling)
    "rope_parameters", "rope_scaling", "rope_theta", "rope_type", "partial_rotary_factor", "rotary_pct",
    "rotary_dim", "rotary_emb_base", "rope_local_base_freq", "rope_interleave", "max_position_embeddings",
    "original_max_position_embeddings", "no_rope_layers", "no_rope_layer_interval", "position_embedding_type",
    "mrope_section", "use_rope",
    # windows
    "sliding_window", "sliding_window_pattern", "layer_types", "use_sliding_window", "max_window_layers",
    "attention_chunk_size",
    # attention scaling, softcapping, norms on q/k
    "query_pre_attn_scalar", "attn_logit_softcapping", "attention_multiplier", "attn_temperature_tuning",
    "floor_scale", "attn_scale", "use_qk_norm", "qk_layernorm", "scale_attn_weights",
    # what the hidden states (so every later layer's K/V) are computed with
    "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "hidden_act", "hidden_activation",
    "embedding_multiplier", "residual_multiplier", "swiglu_alpha", "swiglu_limit", "num_experts_per_tok",
    "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group", "topk_method", "scoring_func",
    "moe_layers", "first_k_dense_replace", "interleave_moe_layer_step", "use_bidirectional_attention",
)
"""Text-config fields that change K/V bytes with the same weights (module docstring)."""

MULTIMODAL_FIELDS: tuple[str, ...] = (
    "image_token_index", "image_token_id", "video_token_id", "vision_start_token_id", "boi_token_index",
    "eoi_token_index", "mm_tokens_per_image", "vision_feature_layer", "vision_feature_select_strategy",
    "projector_hidden_act", "multimodal_projector_bias", "image_seq_length", "spatial_merge_size",
)
"""Top-level fields of a multimodal config that say which tokens are media and how media are
embedded (the embeddings are the inputs of every layer's K/V at those positions)."""

_BOOKKEEPING = frozenset({
    "transformers_version", "architectures", "_name_or_path", "name_or_path", "id2label", "label2id",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "dtype", "torch_dtype",
    "use_cache", "problem_type", "initializer_range", "attention_dropout", "dropout", "chunk_size_feed_forward",
    "tie_word_embeddings", "_attn_implementation", "_attn_implementation_autoset", "model_type",
})
"""Fields of a vision config left out of the key: they never change embeddings."""


def canonical(value: Any) -> Any:
    """``value`` normalized for a canonical encoding (module docstring). Raises
    ``TypeError`` for a value of no known meaning (an object the encoding cannot name)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value) if -(1 << 63) <= value < 1 << 64 else f"int:{value}"  # msgpack's range
    if isinstance(value, float):
        if not math.isfinite(value):
            return repr(value)  # "nan", "inf", "-inf"
        return int(value) if value.is_integer() and abs(value) < 1 << 63 else value
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy or torch scalar
        return canonical(value.item())
    if isinstance(value, Mapping):
        return {str(k): canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if hasattr(value, "to_dict"):  # a nested transformers config
        return canonical(value.to_dict())
    raise TypeError(f"expected a config value of plain types, got {type(value).__name__}")


def kv_config_fields(config: Any, kv_cache_dtype: str | None = None, **extra: Any) -> dict[str, Any]:
    """The K/V-relevant fields of ``config``, normalized (keys sorted, ``None`` dropped).

    Args:
        config: a transformers ``PretrainedConfig`` (the effective, in-memory one: with any
            change made after loading) or any object with the same attributes. For a
            multimodal config, its text config is read, plus :data:`MULTIMODAL_FIELDS` and
            its ``vision_config``.
        kv_cache_dtype: the K/V cache dtype name (``"bfloat16"``, ``"float8_e4m3fn"``, vLLM's
            ``"fp8_e5m2"``, ...), as the engine stores K/V.
        extra: engine settings that change K/V (e.g. vLLM's ``disable_sliding_window``).

    Returns:
        ``{field: canonical value}`` in key order; what :func:`kv_config_bytes` encodes.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields: dict[str, Any] = {name: getattr(text, name, None) for name in KV_CONFIG_FIELDS}
    if text is not config:
        fields.update({f"mm.{name}": getattr(config, name, None) for name in MULTIMODAL_FIELDS})
        vision = getattr(config, "vision_config", None)
        if vision is not None:
            items = vision.to_dict() if hasattr(vision, "to_dict") else dict(vars(vision))
            fields["mm.vision_config"] = {k: v for k, v in items.items() if k not in _BOOKKEEPING}
    fields["kv_cache_dtype"] = kv_cache_dtype
    fields.update(extra)
    return {k: v for k, v in canonical(fields).items() if v is not None}


def kv_config_bytes(fields: Mapping[str, Any]) -> bytes:
    """Canonical msgpack bytes of a :func:`kv_config_fields` map (the ``KeyContext.kv_config``
    field): equal maps give equal bytes, whatever their key order or number types."""
    return msgpack.packb(canonical(dict(fields)), use_bin_type=True)
