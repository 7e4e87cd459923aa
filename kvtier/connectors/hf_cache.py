"""transformers caches <-> kvtier blocks: which models the HF connector serves, the spec of
their blocks, the cache it hands to ``generate``, the check of a cache before a store, and
the copies between a cache and the block pool.

Which models (checked at ``HFConnector.from_model``; anything else raises
:class:`UnsupportedModelError` naming the layer type or class):

- decoder-only models whose transformers cache (``DynamicCache(config=...)``, the cache
  ``generate`` builds) has only ``DynamicLayer`` (full attention) and
  ``DynamicSlidingWindowLayer`` (``sliding_attention`` / ``chunked_attention``) layers:
  Llama, Qwen2 (``layer_types``), Qwen3, Mistral, Gemma 2, Gemma 3 text, gpt-oss, Llama 4
  text (chunked), DeepSeek-V2/V3 (MLA: transformers 5.x caches the compressed latent as K
  and the RoPE key as V);
- refused: encoder-decoder models (T5, Whisper), linear attention / Mamba / hybrid-SSM
  layers (``LinearAttentionLayer``: Mamba, Jamba, Bamba, Qwen3-Next), layers that reuse
  another layer's cache (``DummyLayer``: Gemma 3n/4 KV sharing), indexed or compressed
  attention, models that keep their own cache class, any layer class not listed above.

Sliding and chunked layers: the connector's cache keeps every position in every layer
(plain ``DynamicLayer`` s); the model builds its sliding/chunked masks from its config, so
attention is the same as with transformers' own windowed cache (suffix-prefill logits equal
to a full prefill, tests/unit/connectors/test_families.py), and a stored block holds that
position's K/V for any later cut. transformers' ``DynamicSlidingWindowLayer`` keeps only the
window's tail: a cache that dropped positions is never stored from (:func:`check_cache`).

The shapes of each layer's K and V come from the model itself: one forward of one token
into an empty cache (:func:`kv_spec_for`), so a transformers release that caches other
shapes (MLA's latent vs expanded heads) gets a spec, and a namespace, of its own.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvtier.kernels import gather_blocks_to_layers, scatter_contiguous_to_blocks
from kvtier.types import KVSpec, LayerGroup

_WINDOWED_TYPES = {"sliding_attention": "sliding", "chunked_attention": "chunked"}


class UnsupportedModelError(ValueError):
    """A model whose K/V kvtier cannot serve exactly (raised by ``HFConnector.from_model``)."""


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the cache argument of ``model.forward``/``generate``: ``cache`` in
    transformers >= 5.2x, ``past_key_values`` before."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache() -> Any:
    """An empty ``DynamicCache`` whose every layer keeps every position (a ``DynamicLayer``,
    created on first use): the cache the connector gives ``generate``."""
    from transformers import DynamicCache

    return DynamicCache()


def kv_spec_for(model: torch.nn.Module, block_size: int) -> KVSpec:
    """Block spec of a decoder-only transformers model: its layer groups (attention kind
    from the cache transformers builds for it, K/V shapes from one probe forward).

    Args:
        model: a transformers ``*ForCausalLM`` (any dtype and device).
        block_size: tokens per block.

    Raises:
        UnsupportedModelError: the model is not one kvtier serves exactly (the message names
            the layer type or class).
    """
    kinds = _layer_kinds(model)
    shapes, dtype = _probe_shapes(model, len(kinds))
    groups = [
        LayerGroup(kind, (layer,), heads, k_dim, v_dim, window)
        for layer, ((kind, window), (heads, k_dim, v_dim)) in enumerate(zip(kinds, shapes))
    ]
    return KVSpec.from_groups(groups, block_size, dtype)


def _text_config(model: torch.nn.Module) -> Any:
    config = model.config
    try:
        return config.get_text_config(decoder=True)
    except (AttributeError, TypeError):
        return config


def _layer_kinds(model: torch.nn.Module) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per layer, from the cache layers transformers builds for the model."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: encoder-decoder models are not supported (decoder-only K/V only)")
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        raise UnsupportedModelError(f"{name}: keeps its own cache class, not a DynamicCache kvtier can read")
    text_config = _text_config(model)
    layer_types = getattr(text_config, "layer_types", None) or []
    layers = DynamicCache(config=config).layers
    if not layers:
        raise UnsupportedModelError(f"{name}: transformers builds no per-layer cache for this config")
    mla = getattr(text_config, "kv_lora_rank", None) is not None
    kinds: list[tuple[str, int | None]] = []
    for i, layer in enumerate(layers):
        layer_type = layer_types[i] if i < len(layer_types) else None
        if type(layer) is DynamicLayer:
            kinds.append(("mla" if mla else "full", None))
        elif type(layer) is DynamicSlidingWindowLayer and not mla:
            kind = _WINDOWED_TYPES.get(layer_type or "sliding_attention")
            if kind is None:
                raise UnsupportedModelError(f"{name}: layer {i} has layer type {layer_type!r}, not supported")
            kinds.append((kind, int(layer.sliding_window)))
        else:
            described = f"layer type {layer_type!r}, " if layer_type else ""
            raise UnsupportedModelError(
                f"{name}: layer {i} ({described}cache layer {type(layer).__name__}) is not supported: kvtier serves "
                "full, sliding-window, chunked and MLA attention layers only"
            )
    return kinds


def _probe_shapes(model: torch.nn.Module, num_layers: int) -> tuple[list[tuple[int, int, int]], torch.dtype]:
    """``(num_kv_heads, k_head_dim, v_head_dim)`` per layer and the cache dtype, read from
    the cache after a forward of one token."""
    name = type(model).__name__
    cache = new_cache()
    device = getattr(model, "device", None) or next(model.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.int64, device=device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    keys, values = cache_layers(cache)
    if len(keys) != num_layers:
        raise UnsupportedModelError(f"{name}: expected K/V in {num_layers} cache layers, got {len(keys)}")
    shapes = []
    for i, (k, v) in enumerate(zip(keys, values)):
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != (1, k.shape[1], 1) or v.shape[:3] != k.shape[:3]:
            raise UnsupportedModelError(
                f"{name}: layer {i} caches K {tuple(k.shape)} and V {tuple(v.shape)}, expected "
                "[batch, num_kv_heads, seq_len, head_dim] each with the same heads"
            )
        if k.dtype != keys[0].dtype or v.dtype != keys[0].dtype:
            raise UnsupportedModelError(f"{name}: layer {i} caches {k.dtype}/{v.dtype}, layer 0 {keys[0].dtype}")
        shapes.append((int(k.shape[1]), int(k.shape[3]), int(v.shape[3])))
    return shapes, keys[0].dtype


def cache_layers(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer ``[1, num_kv_heads, seq_len, head_dim]`` K and V of a transformers cache
    (layers that hold nothing yet are left out).

    Raises:
        TypeError: ``cache`` is not a transformers cache.
    """
    if not (hasattr(cache, "layers") or hasattr(cache, "key_cache")):
        raise TypeError(f"expected a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}")
    if hasattr(cache, "layers"):  # transformers >= 4.56
        layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
        return [layer.keys for layer in layers], [layer.values for layer in layers]
    return list(cache.key_cache), list(cache.value_cache)


def check_cache(cache: Any, spec: KVSpec) -> str | None:
    """Why ``cache`` cannot be stored from under ``spec`` (``None``: it can): every layer a
    ``DynamicLayer`` (or a sliding layer that has not dropped a position yet) holding the
    same positions, with the spec's heads, head dims and dtype."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    if not hasattr(cache, "layers"):
        return f"expected a transformers DynamicCache, got {type(cache).__name__}"
    if len(cache.layers) != spec.num_layers:
        return f"expected {spec.num_layers} cache layers, got {len(cache.layers)}"
    lengths = []
    for i, (layer, (heads, k_dim, v_dim)) in enumerate(zip(cache.layers, spec.layer_shapes())):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) or k is None or v is None:
            return f"layer {i}: expected a filled DynamicLayer, got {type(layer).__name__}"
        if type(layer) is DynamicSlidingWindowLayer and int(layer.cumulative_length) != k.shape[-2]:
            return (
                f"layer {i}: a DynamicSlidingWindowLayer kept {k.shape[-2]} of {int(layer.cumulative_length)} "
                "positions (the window's tail); pass the connector's plan.cache to generate"
            )
        if tuple(k.shape) != (1, heads, k.shape[2], k_dim) or tuple(v.shape) != (1, heads, k.shape[2], v_dim):
            return f"layer {i}: expected K [1, {heads}, n, {k_dim}] and V [1, {heads}, n, {v_dim}], got {tuple(k.shape)} and {tuple(v.shape)}"
        if k.dtype != spec.dtype or v.dtype != spec.dtype:
            return f"layer {i}: expected dtype {spec.dtype}, got {k.dtype}/{v.dtype}"
        lengths.append(k.shape[2])
    if len(set(lengths)) > 1:
        return f"expected every layer to hold the same positions, got lengths {lengths}"
    return None


def gather_into_layers(
    spec: KVSpec, pool: torch.Tensor, ids: torch.Tensor, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer`` of blocks ``ids``, in order, as HF cache tensors.

    Args:
        pool: ``[num_blocks, *spec.block_shape]``.
        ids: ``[n]`` int64 block ids on the pool's device (known good).

    Returns:
        K ``[1, num_kv_heads, n * block_size, k_head_dim]`` and V (``v_head_dim``), new tensors.
    """
    if spec.is_uniform:
        k, v = gather_blocks_to_layers(pool[:, layer : layer + 1], ids, check_ids=False)
        return k[0], v[0]
    k_view, v_view = spec.layer_views(pool)[layer]
    return tuple(_blocks_to_hf(view.index_select(0, ids)) for view in (k_view, v_view))  # type: ignore[return-value]


def scatter_from_layers(
    spec: KVSpec,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    pool: torch.Tensor,
    ids: torch.Tensor,
    start_token: int,
) -> None:
    """Write tokens ``start_token ..`` of every layer's HF K/V into blocks ``ids`` (in order).

    Args:
        keys, values: per layer ``[1, num_kv_heads, seq_len, k_head_dim / v_head_dim]``.
        pool: ``[num_blocks, *spec.block_shape]``, written.
        ids: ``[n]`` int64 distinct block ids on the pool's device.
    """
    if spec.is_uniform:
        scatter_contiguous_to_blocks(keys, values, pool, ids, start_token=start_token)
        return
    n, size = ids.numel(), spec.block_size
    end = start_token + n * size
    for (k_view, v_view), k, v in zip(spec.layer_views(pool), keys, values):
        for view, src in ((k_view, k), (v_view, v)):
            heads, dim = src.shape[1], src.shape[3]
            blocks = src[0, :, start_token:end].transpose(0, 1).reshape(n, size, heads, dim)
            view.index_copy_(0, ids, blocks.to(view.device))


def _blocks_to_hf(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, block_size, heads, dim]`` -> ``[1, heads, n * block_size, dim]`` (contiguous)."""
    n, size, heads, dim = blocks.shape
    return blocks.reshape(n * size, heads, dim).transpose(0, 1).unsqueeze(0).contiguous()
