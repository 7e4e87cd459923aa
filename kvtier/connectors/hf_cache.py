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

import copy
import math
import threading
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvtier.kernels import gather_blocks_to_contiguous, host_copy, scatter_contiguous_to_blocks, use_triton
from kvtier.records import BlockPlaces
from kvtier.tiers.host_memory import host_empty
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


def kv_spec_for(model: torch.nn.Module, block_size: int, head_major: bool = False) -> KVSpec:
    """Block spec of a decoder-only transformers model: its layer groups (attention kind
    from the cache transformers builds for it, K/V shapes from one probe forward).

    Args:
        model: a transformers ``*ForCausalLM`` (any dtype and device).
        block_size: tokens per block.
        head_major: the head-major layout (:data:`kvtier.types.KV_LAYOUT_HEAD_MAJOR`, the
            HF connector's) when the layers are uniform; ignored otherwise.

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
    return KVSpec.from_groups(groups, block_size, dtype, head_major)


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


def new_layer_tensors(spec: KVSpec, num_tokens: int, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Uninitialised per-layer HF cache tensors of ``num_tokens`` positions, to gather into.

    Returns:
        ``(keys, values)``: per layer K ``[1, num_kv_heads, num_tokens, k_head_dim]`` and V
        (``v_head_dim``) of ``spec.dtype`` on ``device``, each its own allocation (so one can
        be freed or replaced alone, as ``DynamicCache`` does on every update).
    """
    keys, values = [], []
    for heads, k_dim, v_dim in spec.layer_shapes():
        keys.append(torch.empty((1, heads, num_tokens, k_dim), dtype=spec.dtype, device=device))
        values.append(torch.empty((1, heads, num_tokens, v_dim), dtype=spec.dtype, device=device))
    return keys, values


class LayerGather:
    """Copies one request's blocks, layer by layer, from the pool into HF cache tensors:
    each layer's K and V are written once, in place, at their final positions (no staging
    copy, no per-block concatenation).

    On the torch path each run of consecutive pool slots is one strided ``copy_`` per layer
    and K/V (a fresh store hands out consecutive slots, so a prefix is usually one run); a
    prefix scattered over more runs than half its blocks is gathered per layer with one
    ``index_select`` instead. A uniform spec on a pool the Triton kernels serve
    (:func:`kvtier.kernels.use_triton`: CUDA) runs one gather kernel per layer; a head-major
    spec takes the torch path (its runs are whole blocks per head already).

    Args:
        spec: the block layout.
        pool: ``[num_blocks, *spec.block_shape]``.
        block_ids: ``[n]`` pool slots of the request's blocks, in request order (known good).
    """

    def __init__(self, spec: KVSpec, pool: torch.Tensor, block_ids: Sequence[int]) -> None:
        self.spec, self.pool, self.num_blocks = spec, pool, len(block_ids)
        runs = _runs(block_ids)
        self._triton = spec.is_uniform and not spec.head_major and use_triton(pool)
        self._runs = runs if not self._triton and len(runs) <= max(1, len(block_ids) // 2) else None
        self._ids = None if self._runs is not None else torch.tensor(list(block_ids), dtype=torch.int64, device=pool.device)
        self._views = None if self._triton else spec.layer_views(pool)

    def layer(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write layer ``layer`` of every block into ``key`` / ``value`` (``[1, num_kv_heads,
        >= n * block_size, head_dim]`` of the pool's dtype and device, any strides), tokens
        ``0 .. n * block_size``."""
        if self._triton:
            gather_blocks_to_contiguous(self.pool[:, layer : layer + 1], self._ids, [key], [value], check_ids=False)
            return
        for view, out in zip(self._views[layer], (key, value)):
            blocks = _block_view(out, self.num_blocks, self.spec.block_size)
            if self._runs is None:
                blocks.copy_(view.index_select(0, self._ids))
                continue
            for src, dst, length in self._runs:
                blocks[dst : dst + length].copy_(view[src : src + length])


class HostHitBuffer:
    """Host memory for the K/V of hits, kept from one hit to the next (uniform specs).

    A hit's K/V go to the model as views of one ``[num_layers, 2, num_kv_heads, num_tokens,
    head_dim]`` tensor (:meth:`take`; layer ``l``'s K is ``[l, 0]``, contiguous). A fresh host
    allocation of that size is fresh pages: glibc's malloc serves an allocation above its
    mmap threshold (128 KiB, adapting up to 32 MiB) with a new ``mmap`` and unmaps it on
    free, and the kernel zero-fills every 4 KiB page on its first touch, which costs about
    as much as the copy itself (0.6-0.9x of one ``Tensor.copy_`` of the same bytes on
    bench/hit_path.py's 2-core host, 1-4k tokens of SmolLM2-135M). So the buffer is
    kept once the hit is done with it, and the next hit writes into pages already mapped
    (CUDA's caching allocator does the same for device memory).

    "Done with it": nothing but this object holds the buffer's storage (transformers'
    ``DynamicLayer.update`` concatenates into a new tensor, so after the prefill's forward
    no cache layer points into it any more; a cache the caller keeps, or any view of it,
    holds it and the next hit gets a new buffer). The test is the storage's use count
    (``torch._C._storage_Use_Count``, the check torch's CUDA-graph trees use for the same
    question); a torch without it never reuses.

    Memory: the largest hit's K/V up to ``keep_bytes`` stays allocated between hits; while
    a prefill runs, the buffer lives until its last layer was replaced (the new layers are
    allocated beside it).

    Args:
        spec: a uniform spec (``spec.is_uniform``).
        keep_bytes: the largest buffer kept between hits (a larger hit, or one while the
            buffer is in use, gets per-layer tensors of its own: :meth:`take` is ``None``).
    """

    def __init__(self, spec: KVSpec, keep_bytes: int) -> None:
        assert spec.is_uniform, "HostHitBuffer needs a uniform spec"
        if not isinstance(keep_bytes, int) or isinstance(keep_bytes, bool) or keep_bytes < 0:
            raise ValueError(f"expected hit_buffer_bytes to be an int >= 0, got {keep_bytes!r}")
        self.spec, self.keep_bytes = spec, keep_bytes
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()  # two hits at once never get the same buffer

    def take(self, num_tokens: int) -> torch.Tensor | None:
        """A ``[num_layers, 2, num_kv_heads, num_tokens, head_dim]`` contiguous CPU tensor of
        ``spec.dtype`` (uninitialised) in the kept buffer (allocated, or grown, when none is
        kept or it is too small and free), or ``None`` when the buffer is in use or the hit
        is over ``keep_bytes``: then the caller allocates per layer (:func:`new_layer_tensors`:
        layer-sized blocks that glibc's heap recycles from one hit to the next, where one
        fresh allocation of the whole hit is new pages every time: 6-8x a plain copy's time
        for 1-4k tokens of SmolLM2-135M, bench/hit_path.py's "no kept buffer" rows before
        this fallback)."""
        spec = self.spec
        shape = (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim)
        numel = math.prod(shape)
        if numel * spec.dtype.itemsize > self.keep_bytes:
            return None
        with self._lock:  # the check and the view that makes the buffer taken, as one step
            buffer = self._buffer
            if buffer is not None and not _sole_owner(buffer):
                return None
            if buffer is None or buffer.numel() < numel:
                self._buffer = buffer = None  # the old one first: its pages go back before the new ones
                self._buffer = buffer = host_empty(numel, spec.dtype)  # huge pages: kvtier.tiers.host_memory
            return buffer[:numel].view(shape)

    def release(self) -> None:
        """Drop the kept buffer (the memory returns once no cache uses it)."""
        self._buffer = None


def _sole_owner(tensor: torch.Tensor) -> bool:
    """True when no tensor but ``tensor`` itself uses its storage (no view, no cache layer)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = tensor.untyped_storage()
    return use_count(storage._cdata) == 2  # ``tensor`` and ``storage`` (this Python object)


def gather_into(spec: KVSpec, pool: torch.Tensor, out: torch.Tensor, block_ids: Sequence[int],
                indices: Sequence[int]) -> None:
    """Copy blocks ``block_ids`` of ``pool`` to their request positions ``indices`` of
    ``out``, every layer and K/V at once: one strided ``copy_`` per run of consecutive slots
    at consecutive positions (a fresh store hands out consecutive slots, so a prefix is
    usually one run; a DISK chunk of it one run each).

    A head-major pool (``spec.head_major``) copies runs of ``block_size * head_dim``
    elements, a token-major one runs of ``head_dim`` (1.3-1.7x the time of a plain copy of
    the same bytes here, vs 1.0-1.4x: the head-major layout's reason).

    Head-major: every block in one call of :func:`kvtier.kernels.host_copy.gather_blocks`
    (compiled C, streaming stores: the destination lines are not read first), each slot read
    in order; 0.6-0.7x of one ``Tensor.copy_`` of the same bytes where numpy's per-block copies
    took 1.3-1.45x on the 2026-12-03 VM (bench/results/2026-12-03-nt-gather). Without the
    compiled kernels (no C compiler, ``KVTIER_HOST_KERNELS=off``) and for a token-major pool,
    each block is one numpy ``copyto`` from its slot into its strided place in ``out``, on
    byte views (any dtype, bfloat16 included): 0.84-1.16x of that copy on the 2026-12-02 VM,
    vs 0.96-1.70x for one ``copy_`` of the whole permuted run and 1.12-1.90x for one numpy
    ``copyto`` of it (bench/results/2026-12-02-hit-3/micro/gather.py).

    Args:
        spec: a uniform spec: ``pool`` is ``[num_blocks, *spec.block_shape]``.
        out: ``[num_layers, 2, num_kv_heads, n * block_size, head_dim]`` contiguous
            (:meth:`HostHitBuffer.take`), tokens ``i * block_size ..`` of position ``i``.
        block_ids, indices: ``[k]`` each: slot and request position of each block.
    """
    layers, _, heads, tokens, dim = out.shape
    nbytes = dim * out.element_size()
    copyto = np.copyto
    if spec.head_major:
        # 2-D: a block is L * 2 * H rows of block_size * head_dim contiguous elements in its
        # slot and in ``out`` (its rows n * block_size * head_dim apart there): one numpy
        # iterator of two dimensions per block, 1.4 us less of it than five (64 blocks: ~0.03x
        # of a 1k-token copy, bench/results/2026-12-02-hit-5)
        rows = layers * 2 * heads
        blocks = out.view(torch.uint8).numpy().reshape(rows, tokens // spec.block_size, spec.block_size * nbytes)
        slots = pool.view(torch.uint8).numpy().reshape(pool.shape[0], rows, spec.block_size * nbytes)
        if host_copy.gather_blocks(blocks, slots, block_ids, indices):  # streaming stores, one call
            return
        for slot, index in zip(block_ids, indices):
            copyto(blocks[:, index], slots[slot])
        return
    blocks = out.view(torch.uint8).numpy().reshape(layers, 2, heads, tokens // spec.block_size, spec.block_size, nbytes)
    slots = pool.view(torch.uint8).numpy()
    for slot, index in zip(block_ids, indices):
        copyto(blocks[:, :, :, index], slots[slot].transpose(0, 1, 3, 2, 4))  # [L, 2, B, H, D] -> [L, 2, H, B, D]


def block_views(spec: KVSpec, out: torch.Tensor) -> list[torch.Tensor]:
    """Each block's place in ``out`` as a tensor of ``spec.block_shape`` (views, no copy):
    the destinations :func:`gather_into` writes.

    Args:
        spec: a uniform spec.
        out: ``[num_layers, 2, num_kv_heads, n * block_size, head_dim]`` contiguous.

    Returns:
        ``n`` views, block ``i`` = tokens ``i * block_size ..`` of every layer, K and V:
        ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` head-major, else
        ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.
    """
    layers, _, heads, tokens, dim = out.shape
    blocks = out.view(layers, 2, heads, tokens // spec.block_size, spec.block_size, dim)
    order = (3, 0, 1, 2, 4, 5) if spec.head_major else (3, 0, 1, 4, 2, 5)
    return list(blocks.permute(order).unbind(0))


def block_places(spec: KVSpec, out: torch.Tensor) -> BlockPlaces:
    """:func:`block_views` as a :class:`~kvtier.records.BlockPlaces` (block ``i``'s place is
    block 0's moved by ``i * block_size * head_dim`` elements), for a DISK read to write each
    block there itself without a view per block (``TieredStore.prefetch(sinks=...)``)."""
    first = out[:, :, :, : spec.block_size]
    if not spec.head_major:
        first = first.permute(0, 1, 3, 2, 4)
    return BlockPlaces(first, spec.block_size * out.shape[-1], range(out.shape[3] // spec.block_size))


def cache_from_layers(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Any:
    """A :func:`new_cache` whose layer ``i`` holds ``keys[i]`` / ``values[i]`` themselves
    (``[1, num_kv_heads, seq_len, head_dim]`` each, the same ``seq_len`` in every layer).

    ``DynamicCache.update`` on an empty layer concatenates the tensor to an empty one: a copy
    of every cached byte. Instead each layer is created and initialised by an update with no
    positions, then handed the tensors (``DynamicLayer.keys`` / ``.values``, the attributes
    :func:`cache_layers` reads). Layers after the first are shallow copies of the first one
    so initialised (the same class, device and dtype: what the update would make, without
    its two empty concatenations per layer, ~20 us each on a loaded host: 30 layers were
    0.1-0.2x of a 1k-token hit's copy). A transformers release without cache layers gets
    plain updates (one copy per layer).
    """
    cache = new_cache()
    first = None
    for layer, (key, value) in enumerate(zip(keys, values)):
        layers = getattr(cache, "layers", None)
        if first is not None and layers is not None and len(layers) == layer and key.device == device:
            layers.append(copy_first())
        else:
            cache.update(key[:, :, :0], value[:, :, :0], layer)
            layers = getattr(cache, "layers", None)
        if layers is None or len(layers) <= layer or not hasattr(layers[layer], "keys"):
            cache.update(key, value, layer)  # transformers < 4.56: key_cache / value_cache lists
            continue
        if first is None and _plain_layer(cache, layers[layer]):
            first = copy.copy(layers[layer])  # initialised, still empty: the template
            device, copy_first = first.keys.device, _layer_copier(first)  # the class checked once
        layers[layer].keys, layers[layer].values = key, value
    return cache


_PLAIN = (torch.Tensor, torch.device, torch.dtype, bool, int, float, str, type(None))


def _layer_copier(template: Any) -> Callable[[], Any]:
    """A function returning ``copy.copy(template)``: for a plain class a new instance with
    its ``__dict__`` copied (what ``copy.copy`` does through ``__reduce_ex__`` for a class that
    customises none of it, at a sixth of the cost: 0.2 vs 1.4 us a layer); any other class
    through ``copy.copy``."""
    cls = type(template)
    if _plain_class(cls):
        return partial(_new_with_dict, cls, template.__dict__)
    return partial(copy.copy, template)


def _plain_class(cls: type) -> bool:
    """Whether ``copy.copy`` of an instance of ``cls`` is a new instance with its ``__dict__``
    copied: no ``__copy__``, ``__reduce_ex__``, ``__reduce__`` or ``__getstate__`` of its own."""
    return (getattr(cls, "__copy__", None) is None and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__getstate__", None) is getattr(object, "__getstate__", None))


def _new_with_dict(cls: type, state: dict) -> Any:
    new = cls.__new__(cls)
    new.__dict__.update(state)
    return new


def _plain_layer(cache: Any, layer: Any) -> bool:
    """``layer`` is of the class the cache makes for new layers and holds only values a
    shallow copy does not share mutably (tensors are replaced, never written in place)."""
    return getattr(cache, "layer_class_to_replicate", None) is type(layer) and all(
        isinstance(v, _PLAIN) for v in vars(layer).values()
    )


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
    n, size = ids.numel(), spec.block_size
    end = start_token + n * size
    if spec.head_major:  # [1, H, n * B, D] -> [n, H, B, D]: whole blocks per head
        for layer, (k, v) in enumerate(zip(keys, values)):
            for kv, src in ((0, k), (1, v)):
                heads, dim = src.shape[1], src.shape[3]
                blocks = src[0, :, start_token:end].reshape(heads, n, size, dim).transpose(0, 1)
                pool[:, layer, kv].index_copy_(0, ids, blocks.to(pool.device))
        return
    if spec.is_uniform:
        scatter_contiguous_to_blocks(keys, values, pool, ids, start_token=start_token)
        return
    for (k_view, v_view), k, v in zip(spec.layer_views(pool), keys, values):
        for view, src in ((k_view, k), (v_view, v)):
            heads, dim = src.shape[1], src.shape[3]
            blocks = src[0, :, start_token:end].transpose(0, 1).reshape(n, size, heads, dim)
            view.index_copy_(0, ids, blocks.to(view.device))


def _block_view(cache: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """``[1, heads, >= n * block_size, dim]`` -> its first ``n`` blocks as a
    ``[n, block_size, heads, dim]`` view (no copy)."""
    heads, _, dim = cache.shape[1:]
    if cache.shape[2] == num_blocks * block_size and cache.is_contiguous():  # the usual case: a plain view
        return cache.view(heads, num_blocks, block_size, dim).permute(1, 2, 0, 3)
    return cache[0, :, : num_blocks * block_size].unflatten(1, (num_blocks, block_size)).permute(1, 2, 0, 3)


def _runs(block_ids: Sequence[int], indices: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """``(first_slot, first_index, length)`` of each run of consecutive slots at consecutive
    positions (``indices``, default ``0 .. len(block_ids) - 1``) in ``block_ids``."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in zip(range(len(block_ids)) if indices is None else indices, block_ids):
        if runs and runs[-1][0] + runs[-1][2] == slot and runs[-1][1] + runs[-1][2] == index:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slot, index, 1))
    return runs
