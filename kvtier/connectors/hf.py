"""Hugging Face transformers connector: the two hooks an inference loop calls.

    connector = HFConnector.from_model(model)                  # one per model
    ticket = connector.prefetch(input_ids)                     # optional: when the request arrives
    plan = connector.before_prefill(input_ids, ticket)         # lookup + load the hit prefix
    out = model.generate(input_ids, **plan.generate_kwargs(), max_new_tokens=32)
    connector.after_request(out[0], plan.cache)                # store new full blocks

``before_prefill`` hashes the prompt's full blocks, loads the longest cached prefix into the
store's top pool and gathers it into a fresh ``DynamicCache`` (per layer a K ``[1,
num_kv_heads, num_cached_tokens, k_head_dim]`` and a V ``[..., v_head_dim]``, the shapes of
the layer's group), so ``generate`` prefills only the
suffix. A full hit still leaves work: at most ``(prompt_len - 1) // block_size`` blocks are
loaded, so prefill always has at least one token to produce logits from (case B1).

``prefetch`` starts the load as soon as the request is known (DISK reads on the store's I/O
threads, CPU->GPU on a side stream), so the copy hides behind whatever the engine does before
this request's prefill; ``before_prefill`` then only waits for what is still in flight. The
gather into the cache is done layer by layer with ``handle.wait_layer(i)``, so on CUDA layer i
is gathered as soon as its own copy landed.

On a host-memory top pool (no CUDA) the hit's K/V go to the model as views of one kept host
buffer (:class:`~kvtier.connectors.hf_cache.HostHitBuffer`). Blocks in the top pool are
gathered into it; blocks on DISK are read straight into it by the I/O threads, each
verified as it is copied (a block that fails ends the prefix), and then read again into
their top-pool slots off the hit's path: that load is published (resident in the top pool,
counted, LRU, events) by the connector's next hook or :meth:`HFConnector.finish_loads`.

The prefill after a hit: transformers gives SDPA a materialized mask once cached tokens
precede the queries, and the masked kernel computes the whole query x key rectangle (a
small hit then cost more than no cache: 1.37x at 2k tokens). ``before_prefill`` arms
:class:`~kvtier.connectors.hf_attention.PrefixAttention` when it served a hit, so the model's
next forward (the prefill) runs causal SDPA with zero query rows in front instead, exactly
what the full prefill computes for those rows; other forwards and other attention
implementations are untouched (:mod:`kvtier.connectors.hf_attention`).

``after_request`` stores every full block of ``prompt + output`` whose K/V the cache holds
(the last generated token has none: it was sampled, never fed back).

Both hooks pass the store the token fingerprint of every block (:func:`block_keys_for`): a
block is stored with the tokens it was computed from, and a load serves only blocks whose
tokens are the prompt's (a hash collision or a forged record is a miss).

Images (vision-language models such as LLaVA): pass the processor outputs as ``media`` to
``prefetch``/``before_prefill`` and ``after_request``. The blocks holding an image's
placeholder tokens are keyed by the image's content (:mod:`kvtier.connectors.hf_media`), a
hit never ends inside an image, and ``plan.generate_kwargs()`` holds the processor outputs
of the images after the cached prefix only (pass it instead of them). Images that cannot be
keyed make the prompt uncached (``generate_kwargs()`` then holds all of them).

TTFT saved (:mod:`kvtier.connectors.ttft`): the model's first forward after ``before_prefill``
(the prefill) is timed; at ``after_request`` the connector counts the computed tokens and the
seconds the cached ones saved (their count times the fitted prefill cost per token, minus
the time ``before_prefill`` spent loading) into ``store.stats``. ``explain(input_ids)`` says
block by block where the prompt would hit and why the rest would miss.

Batch size 1 (one request per call). Model families: those of
:mod:`kvtier.connectors.hf_cache` (full, sliding-window, chunked and MLA attention; others are
refused by ``from_model`` with :class:`UnsupportedModelError`). The cache ``before_prefill``
returns keeps every position in every layer (the model's masks do the windowing), so pass it
to ``generate``: ``after_request`` checks the cache against the spec and never stores from a
cache that dropped positions or has other shapes (it logs an error and stops storing).
Works with transformers 4.56+ and 5.x.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.config import StoreConfig
from kvtier.connectors.hf_attention import PrefixAttention
from kvtier.connectors.hf_cache import (
    HostHitBuffer,
    LayerGather,
    UnsupportedModelError,
    block_places,
    cache_from_layers,
    cache_kwarg,
    cache_layers,
    check_cache,
    gather_into,
    kv_spec_for,
    new_cache,
    new_layer_tensors,
    scatter_from_layers,
)
from kvtier.connectors.hf_media import PromptMedia, prompt_media
from kvtier.connectors.ttft import ForwardTimer, PrefillRate
from kvtier.hashing import KeyContext, LazyContentKeys, PrefixKeys, block_hashes_for
from kvtier.model_keys import kv_config_bytes, kv_config_fields
from kvtier.records import BlockPlaces
from kvtier.store import PrefetchHandle, ResetResult, TieredStore
from kvtier.store.misses import Explanation
from kvtier.store.results import PromptInfo
from kvtier.tiers.backend import RemoteBackend
from kvtier.types import BlockHash, KVSpec, Medium, dtype_name

__all__ = ["HFConnector", "PrefetchTicket", "PrefillPlan", "UnsupportedModelError", "cache_kwarg", "kv_spec_for",
           "weights_fingerprint"]
_cache_layers = cache_layers  # the name tests and benchmarks used

logger = logging.getLogger(__name__)
HIT_BUFFER_BYTES = 1 << 30
"""Default ``hit_buffer_bytes``: a 1 GiB hit at most keeps its memory for the next one
(about 23k tokens of SmolLM2-135M in fp32, 8k of Llama-3-8B in bf16)."""


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Digest of everything in the model that changes its K/V: every weight's bytes (xxh3-128,
    one pass: ~0.1 s per GB on the CPU) and the model config (a RoPE scaling or theta change
    alters K with the same weights). Pass ``model_revision`` explicitly to skip the pass and
    key on a published revision instead.

    Raises:
        ValueError: the config cannot be serialised.
    """
    import xxhash

    digest = xxhash.xxh3_128()
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
            flat = tensor.detach().reshape(-1)
            step = max(1, (64 << 20) // max(1, flat.element_size()))  # 64 MiB at a time
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step].to("cpu").contiguous()
                digest.update(chunk.view(torch.uint8).numpy())
    return digest.hexdigest()


@dataclass
class PrefetchTicket:
    """A prefetch started by :meth:`HFConnector.prefetch` for one prompt."""

    block_hashes: list[BlockHash]
    handle: PrefetchHandle
    used: bool = False
    fingerprints: list[bytes] = field(default_factory=list)
    """The prompt's token fingerprints: a ticket serves only a prompt of the same tokens (a
    prompt whose hashes collide with it gets a prefetch of its own)."""
    media: PromptMedia | None = None
    buffer: torch.Tensor | None = None
    """The hit buffer the DISK reads also write into (``handle.sunk`` says which blocks), or
    ``None``."""

    def cancel(self) -> None:
        """Give the pins back (the request went away)."""
        self.handle.wait().lease.release()
        self.used = True


@dataclass
class PrefillPlan:
    """What ``before_prefill`` found and loaded.

    Attributes:
        num_cached_tokens: prompt tokens whose K/V are in ``cache`` (a multiple of block_size).
        cache: a ``DynamicCache`` holding them, K ``[1, num_kv_heads, num_cached_tokens,
            k_head_dim]`` and V (``v_head_dim``) per layer, every layer keeping every
            position; pass it to ``generate``/``forward``.
        block_hashes: hashes of the prompt's full blocks.
        sources: the medium each loaded block came from, ``[num_cached_tokens // block_size]``.
        cache_kwarg: ``"cache"`` or ``"past_key_values"`` (see :func:`cache_kwarg`).
        media_inputs: the processor outputs the prefill of the rest of the prompt needs (the
            images after the cached prefix: :meth:`PromptMedia.inputs_after`).
    """

    num_cached_tokens: int
    cache: Any
    block_hashes: list[BlockHash]
    sources: list[Medium] = field(default_factory=list)
    cache_kwarg: str = "past_key_values"
    media_inputs: dict[str, Any] = field(default_factory=dict)

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``generate``/``forward`` beside ``input_ids``: the cache, and
        the media inputs still to embed."""
        return {self.cache_kwarg: self.cache, **self.media_inputs}

    def cached_tokens_by_medium(self, block_size: int) -> dict[str, int]:
        """Cached prompt tokens per tier name, fastest tier first: ``{"CPU": 64, "DISK": 32}``."""
        counts: dict[str, int] = {}
        for medium in sorted(self.sources, key=list(Medium).index):
            counts[str(medium)] = counts.get(str(medium), 0) + block_size
        return counts

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        """:meth:`cached_tokens_by_medium` (every source is one block of the same size)."""
        if not self.sources:
            return {}
        return self.cached_tokens_by_medium(self.num_cached_tokens // len(self.sources))

    def __str__(self) -> str:
        """``"96 cached tokens (CPU 64, DISK 32)"`` or ``"0 cached tokens"``."""
        tiers = ", ".join(f"{tier} {n}" for tier, n in self.cached_tokens_by_tier.items())
        return f"{self.num_cached_tokens} cached tokens" + (f" ({tiers})" if tiers else "")


def check_store_matches(spec: KVSpec, store: TieredStore, key_context: KeyContext) -> None:
    """A connector's store must hold ``spec``'s blocks under ``key_context``'s namespace.

    Raises:
        ValueError: another spec, layout name, block size or namespace.
    """
    if spec != store.spec:
        raise ValueError(f"expected a store for {spec}, got {store.spec}")
    if key_context.kv_layout != spec.layout_name:
        raise ValueError(f"expected key_context.kv_layout {spec.layout_name!r}, got {key_context.kv_layout!r}")
    if key_context.block_size != spec.block_size or key_context.namespace() != store.namespace:
        raise ValueError("expected the store's namespace to be key_context.namespace()")


class HFConnector:
    """Connects one transformers model to a :class:`TieredStore`.

    Args:
        model: a decoder-only transformers model of a supported family (module docstring).
        store: the store; its spec must match the model's K/V layout and dtype.
        key_context: the namespace's fields; its block_size must equal the store's and its
            ``kv_layout`` the spec's ``layout_name``.
        hit_buffer_bytes: with a top pool in host memory, the host memory kept between hits
            for the next hit's K/V (:class:`~kvtier.connectors.hf_cache.HostHitBuffer`: a
            hit into fresh pages pays their first-touch faults, about as much again as
            the copy); 0 keeps none.

    Raises:
        UnsupportedModelError: a model kvtier cannot serve exactly (names the layer type).
        ValueError: spec, layout or block_size mismatch.

    Attributes:
        store_disabled: why storing stopped (a cache that did not match the spec), or ``None``.
    """

    def __init__(
        self, model: torch.nn.Module, store: TieredStore, key_context: KeyContext, *,
        hit_buffer_bytes: int = HIT_BUFFER_BYTES,
    ) -> None:
        spec = kv_spec_for(model, store.spec.block_size, store.spec.head_major)
        check_store_matches(spec, store, key_context)
        self.model, self.store, self.key_context = model, store, key_context
        self.namespace = store.namespace
        self.block_size = spec.block_size
        self._prefix_keys = PrefixKeys(self.namespace, self.block_size, key_context.hash_name)  # the last prompt's keys
        self.store_disabled: str | None = None
        self._cache_kwarg = cache_kwarg(model)
        store.name = store.name or key_context.model_id
        self.prefill_rate = PrefillRate()
        self._timer = ForwardTimer(model)
        self._prefix_attention = PrefixAttention(model)
        self._hit_buffer = HostHitBuffer(spec, hit_buffer_bytes) if spec.is_uniform else None
        self._pending: tuple[int, int, float] | None = None  # (computed, cached tokens, load s) of the last prefill
        self._unpublished: list[PrefetchHandle] = []  # hits served from the hit buffer, not yet published
        self._unpublished_lock = threading.Lock()
        self.last_prefill: dict[str, float] | None = None
        """The last counted prefill: ``computed_tokens``, ``cached_tokens``, ``load_s``,
        ``prefill_s``, ``saved_s``, ``lost_s`` (for logs and tests)."""

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        config: StoreConfig | None = None,
        *,
        model_id: str | None = None,
        model_revision: str | None = None,
        lora_name: str | None = None,
        lora_version: str | None = None,
        cache_salt: str | None = None,
        remote: RemoteBackend | None = None,
        emulate_gpu: bool = False,
        hit_buffer_bytes: int = HIT_BUFFER_BYTES,
        head_major: bool = True,
    ) -> "HFConnector":
        """Build the key context and a store (GPU pool on the model's device) for ``model``.

        ``config`` defaults to ``StoreConfig.from_env()``; ``model_revision`` defaults to
        :func:`weights_fingerprint`; ``remote`` is a REMOTE backend to use instead of the one
        ``config.remote_url`` names (e.g. ``kvtier.testing.MemoryRemote``; not closed with
        the connector); ``hit_buffer_bytes`` as for the constructor; ``head_major``: blocks
        in the head-major layout (:data:`kvtier.types.KV_LAYOUT_HEAD_MAJOR`, the order of
        transformers' caches, gathered at memcpy speed) when the model's layers are uniform,
        else token-major (``LKVTHD``, vLLM's paged order); the layout is in the namespace, so
        connectors of the two layouts share no blocks; ``emulate_gpu`` builds the GPU pool in host memory for a model on
        the CPU (``TieredStore``'s option: the two-pool hierarchy of a CUDA machine, for
        tests). The K/V-relevant fields of ``model.config`` as it is now
        (:mod:`kvtier.model_keys`) are keyed on their own whatever ``model_revision`` says.

        Raises:
            UnsupportedModelError: a model kvtier cannot serve exactly (linear attention,
                Mamba, encoder-decoder, an unknown cache layer class: the message names it).
        """
        config = config or StoreConfig.from_env()
        spec = kv_spec_for(model, config.block_size, head_major=head_major)
        key_context = KeyContext(
            model_id=model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__,
            model_revision=model_revision or weights_fingerprint(model),
            dtype=dtype_name(spec.dtype),
            kv_layout=spec.layout_name,
            block_size=config.block_size,
            lora_name=lora_name,
            lora_version=lora_version,
            cache_salt=cache_salt,
            hash_name=config.hash_name,
            kv_config=kv_config_bytes(kv_config_fields(model.config, kv_cache_dtype=dtype_name(spec.dtype))),
        )
        store = TieredStore(spec, config, key_context.namespace(), model.device, remote, emulate_gpu)
        return cls(model, store, key_context, hit_buffer_bytes=hit_buffer_bytes)

    # -- hooks -------------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int] | torch.Tensor) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``token_ids`` (``[num_tokens]`` ints)."""
        tokens = token_list(token_ids)
        return block_hashes_for(tokens, self.namespace, self.block_size, self.key_context.hash_name)

    def block_keys(
        self, token_ids: Sequence[int] | torch.Tensor, media: PromptMedia | None = None
    ) -> tuple[list[BlockHash], list[bytes]]:
        """Hashes and token fingerprints of the full blocks of ``token_ids``
        (:func:`block_keys_for`), the blocks holding an image of ``media`` keyed by it."""
        return self._keys(token_list(token_ids), media)

    def _keys(self, tokens: list[int], media: PromptMedia | None) -> tuple[list[BlockHash], list[bytes]]:
        """:meth:`block_keys` of tokens already checked (:func:`token_list`)."""
        extra = media.extra_keys(len(tokens) // self.block_size, self.block_size) if media is not None else None
        return self._prefix_keys(tokens, extra)  # block_keys_for, the blocks shared with the last call not hashed again

    def prompt_media(self, media: Any, prompt_ids: list[int]) -> PromptMedia | None:
        """The images of a prompt from its processor outputs (``None`` when none given)."""
        return None if media is None else prompt_media(media, self.model.config, prompt_ids)

    def prefetch(self, input_ids: torch.Tensor | Sequence[int], media: Any = None) -> PrefetchTicket:
        """Start loading the prompt's cached prefix now; pass the ticket to
        :meth:`before_prefill`. Raises ``ValueError`` like :meth:`before_prefill`."""
        self.finish_loads()
        tokens = _prompt_tokens(input_ids)
        prompt_media = self.prompt_media(media, tokens)
        return self._prefetch(tokens, prompt_media, *self._keys(tokens, prompt_media))

    def _prefetch(
        self, tokens: list[int], prompt_media: PromptMedia | None, block_hashes: list[BlockHash],
        fingerprints: list[bytes], into_buffer: bool = False,
    ) -> PrefetchTicket:
        """:meth:`prefetch` of a prompt whose keys are already computed. ``into_buffer``: the
        blocks read from DISK are also written straight into the kept hit buffer
        (:meth:`_sinks`; ``ticket.buffer``), so that they need no gather from the pool."""
        max_blocks = (len(tokens) - 1) // self.block_size  # leave >= 1 token to prefill
        if prompt_media is not None:
            max_blocks = prompt_media.cut(max_blocks, self.block_size)
        prompt = self._prompt_info(tokens, prompt_media)
        taken: list[torch.Tensor] = []
        sinks = partial(self._sinks, taken) if into_buffer and self._hit_buffer is not None else None
        handle = self.store.prefetch(block_hashes[:max_blocks], prompt=prompt, fingerprints=fingerprints[:max_blocks],
                                     sinks=sinks)
        return PrefetchTicket(block_hashes, handle, fingerprints=fingerprints, media=prompt_media,
                              buffer=taken[0] if taken else None)

    def _sinks(self, taken: list[torch.Tensor], num_blocks: int) -> BlockPlaces | None:
        """Block ``i``'s place in the hit buffer (``[num_layers, 2, num_kv_heads, num_tokens,
        head_dim]``, :meth:`HostHitBuffer.take`) in the spec's block shape, one per block
        (:func:`block_places`); the buffer goes to ``taken``. ``None`` when the buffer is not
        free (the store calls this under its lock, with the number of blocks it planned)."""
        spec, size = self.store.spec, self.block_size
        kv = self._hit_buffer.take(num_blocks * size)
        if kv is None:
            return None
        taken.append(kv)
        return block_places(spec, kv)

    def explain(self, input_ids: torch.Tensor | Sequence[int], *, media: Any = None) -> Explanation:
        """Where each block of the prompt would hit now and why the rest would miss (counts
        nothing, loads nothing; kvtier.store.misses). ``media``: as for :meth:`prefetch`."""
        self.finish_loads()
        tokens = _prompt_tokens(input_ids)
        prompt_media = self.prompt_media(media, tokens)
        max_blocks = (len(tokens) - 1) // self.block_size
        if prompt_media is not None:
            max_blocks = prompt_media.cut(max_blocks, self.block_size)
        block_hashes, _ = self._keys(tokens, prompt_media)
        return self.store.explain(block_hashes[:max_blocks], self._prompt_info(tokens, prompt_media))

    def _prompt_info(self, tokens: list[int], media: PromptMedia | None = None) -> PromptInfo:
        """The prompt's length and content keys (the blocks holding an image keyed by it, as
        in :meth:`block_keys`), for miss reasons. The keys are hashed only when a miss needs
        a reason (:class:`LazyContentKeys`: a full hit never does; 0.01x of a hit's copy)."""
        extra = media.extra_keys(len(tokens) // self.block_size, self.block_size) if media is not None else None
        return PromptInfo(len(tokens), LazyContentKeys(tokens, self.block_size, extra), self.namespace)

    def before_prefill(
        self, input_ids: torch.Tensor | Sequence[int], ticket: PrefetchTicket | None = None, *, media: Any = None
    ) -> PrefillPlan:
        """Look up the prompt, load the hit prefix into a new ``DynamicCache``.

        Args:
            input_ids: ``[1, prompt_len]`` or ``[prompt_len]`` token ids (int64).
            ticket: from :meth:`prefetch` for the same prompt (ignored and released if it
                was for another prompt).
            media: the processor outputs of a prompt with images (``pixel_values``, ...;
                module docstring), ``None`` for text.

        Returns:
            a :class:`PrefillPlan`; ``plan.num_cached_tokens`` <= ``prompt_len - 1``.

        Raises:
            ValueError: batch size other than 1, an empty prompt.
        """
        started = time.perf_counter()
        self.finish_loads()
        self._count_prefill()  # the previous request's, if after_request was not called
        tokens = _prompt_tokens(input_ids)
        prompt_media = self.prompt_media(media, tokens)
        block_hashes, fingerprints = self._keys(tokens, prompt_media)
        if ticket is None or ticket.used or (ticket.block_hashes, ticket.fingerprints) != (block_hashes, fingerprints):
            if ticket is not None and not ticket.used:
                ticket.cancel()  # for another prompt
            # a ticket serves one prefill (its lease is gone after); the keys are hashed once
            ticket = self._prefetch(tokens, prompt_media, block_hashes, fingerprints, into_buffer=True)
        ticket.used = True
        with torch.no_grad():
            plan = self._load_into_cache(ticket, block_hashes)
        num_cached = plan.num_cached_tokens
        self._pending = (len(tokens) - num_cached, num_cached, time.perf_counter() - started)
        self._timer.arm()  # the model's next forward is this prompt's prefill
        if num_cached:
            self._prefix_attention.arm()  # causal attention after the prefix (hf_attention)
        else:
            self._prefix_attention.disarm()
        return plan

    def finish_loads(self) -> None:
        """Publish the blocks of the last hits that were read from DISK straight into the hit
        buffer: wait for their copies into the top pool (on the I/O threads, started by the
        hit), then make them resident there and counted (``TieredStore`` load statistics,
        LRU, KV events), as any load. Called by every hook before it does anything else;
        call it yourself to see a hit's blocks in the store right after ``before_prefill``."""
        with self._unpublished_lock:
            handles, self._unpublished = self._unpublished, []
        for handle in handles:
            handle.wait().lease.release()

    def _count_prefill(self) -> None:
        """Count the last prefill's computed tokens and the TTFT its cached tokens saved."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        computed, cached, load_s = pending
        seconds = self._timer.seconds()
        if seconds is None:  # no forward ran (the caller did not prefill): no estimate
            self.store.record_computed_tokens(computed)
            return
        self.prefill_rate.observe(computed, seconds)
        saved, lost = self.prefill_rate.saving(cached, load_s)
        self.store.record_computed_tokens(computed, ttft_saved_s=saved, ttft_lost_s=lost)
        self.last_prefill = {"computed_tokens": computed, "cached_tokens": cached, "load_s": load_s,
                             "prefill_s": seconds, "saved_s": saved, "lost_s": lost}

    def _load_into_cache(self, ticket: PrefetchTicket, block_hashes: list[BlockHash]) -> PrefillPlan:
        """Gather the loaded prefix into a new cache: every layer's K and V allocated once at
        the prefix's length and written in one pass (:class:`LayerGather`), then handed to
        the cache as they are (:func:`cache_from_layers`, no concatenation)."""
        handle, spec = ticket.handle, self.store.spec
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        pool = self.store.top.tensor
        kv, ticket.buffer = ticket.buffer, None
        if kv is None and handle.num_blocks and self._hit_buffer is not None and pool.device.type == "cpu":
            kv = self._hit_buffer.take(handle.num_blocks * self.block_size)
        if kv is not None:
            # host pool: every layer at once, each chunk of blocks as it lands (DISK reads
            # run on the I/O threads meanwhile), into reused host memory; blocks the DISK
            # reads wrote here themselves (handle.sunk) need no gather
            block_ids, sunk = handle.block_ids, handle.sunk
            for indices in handle.landed():
                if sunk:
                    indices = [i for i in indices if i not in sunk]
                if indices:
                    gather_into(spec, pool, kv, [block_ids[i] for i in indices], indices)
            per_layer = kv.unsqueeze(2)  # [L, 2, 1, H, T, D]: each layer's K and V, [1, H, T, D] views
            keys, values = list(per_layer[:, 0].unbind(0)), list(per_layer[:, 1].unbind(0))
        elif handle.num_blocks:
            gather = LayerGather(spec, pool, handle.block_ids)
            keys, values = new_layer_tensors(spec, handle.num_blocks * self.block_size, pool.device)
            for layer in range(spec.num_layers):
                handle.wait_layer(layer)  # on CUDA: this layer's copy only, no host sync
                gather.layer(layer, keys[layer], values[layer])
        if kv is not None and handle.served_from_sinks:
            # the DISK blocks were read and verified straight into kv; their copies into the
            # top pool finish on the I/O threads and are published later (finish_loads)
            num_blocks = handle.delivered_prefix()  # a failed block ends the prefix
            all_sources = [b.source for b in handle.plans]
            with self._unpublished_lock:
                self._unpublished.append(handle)
        else:
            loaded = handle.wait()  # a failed block ends the prefix: use only what arrived
            loaded.lease.release()  # the gathers are queued; later copies into these slots wait for them
            num_blocks, all_sources = len(loaded.block_ids), loaded.sources
        media = ticket.media
        if media is not None:
            num_blocks = media.cut(num_blocks, self.block_size)  # never inside an image
        num_cached = num_blocks * self.block_size
        if num_blocks < handle.num_blocks:  # a shorter prefix: its own tensors, not views of longer ones
            # (this copy also leaves the hit buffer free for the next hit)
            keys = [k[:, :, :num_cached].contiguous() for k in keys]
            values = [v[:, :, :num_cached].contiguous() for v in values]
        device = self.model.device
        if num_cached and keys[0].device != device:
            keys = [k.to(device, non_blocking=True) for k in keys]
            values = [v.to(device, non_blocking=True) for v in values]
        cache = cache_from_layers(keys, values) if num_cached else new_cache()
        media_inputs = media.inputs_after(num_cached) if media is not None else {}
        sources = all_sources[:num_blocks]
        return PrefillPlan(num_cached, cache, block_hashes, sources, self._cache_kwarg, media_inputs)

    def after_request(self, token_ids: torch.Tensor | Sequence[int], cache: Any, *, media: Any = None) -> int:
        """Store the new full blocks of ``token_ids`` (prompt + output, ``[num_tokens]`` or
        ``[1, num_tokens]``) whose K/V ``cache`` holds. Returns the blocks now stored for the
        request (already present ones included). Never raises into the inference loop for
        store pressure: a full store stores fewer blocks. ``media``: the prompt's processor
        outputs, as given to :meth:`before_prefill`; a prompt whose images cannot be keyed is
        not stored (0).

        A cache that does not match the spec (a layer that kept only its sliding window's
        tail, other shapes or dtype, another cache class) is never stored from: the first
        one logs an error and disables storing for this connector (``store_disabled``);
        then 0 is returned.

        Raises:
            TypeError: ``cache`` is not a transformers cache.
        """
        self.finish_loads()  # its own hit's blocks first: a pending block would stop the store
        self._count_prefill()
        tokens = token_list(token_ids)
        keys, values = cache_layers(cache)
        if self.store_disabled is None and (problem := check_cache(cache, self.store.spec)) is not None:
            self.store_disabled = problem
            logger.error("kvtier: storing disabled for %s: %s", type(self.model).__name__, problem)
        if self.store_disabled is not None:
            return 0
        num_tokens = min(len(tokens), keys[0].shape[-2]) if keys else 0
        prompt_ids = media.get("input_ids") if media is not None else None
        prompt = tokens[: prompt_ids.shape[-1]] if isinstance(prompt_ids, torch.Tensor) else tokens
        prompt_media = self.prompt_media(media, prompt)
        if prompt_media is not None and not prompt_media.keyable:
            return 0
        block_hashes, fingerprints = self._keys(tokens[:num_tokens], prompt_media)
        if not block_hashes:
            return 0
        pool, spec = self.store.top.tensor, self.store.spec

        def write(indices: list[int], block_ids: list[int]) -> None:
            for first_index, ids in _consecutive_runs(indices, block_ids):
                ids_tensor = torch.tensor(ids, dtype=torch.int64, device=pool.device)
                scatter_from_layers(spec, keys, values, pool, ids_tensor, first_index * self.block_size)

        with torch.no_grad():
            return self.store.store_with(
                block_hashes, write, prompt=self._prompt_info(tokens[:num_tokens], prompt_media),
                fingerprints=fingerprints,
            )

    def reset(self, remote: bool = True) -> ResetResult:
        """Empty every tier of the store (:meth:`TieredStore.reset`; ``remote``: the REMOTE
        namespace too, for every process sharing it): the next prompts miss. A ticket from
        :meth:`prefetch` taken before loads nothing (``before_prefill`` computes the whole
        prompt). Use it after changing the model's weights in place without a new
        ``model_revision``."""
        self.finish_loads()
        return self.store.reset(remote)

    def close(self) -> None:
        self.finish_loads()
        self._count_prefill()
        self._timer.close()
        self._prefix_attention.close()
        if self._hit_buffer is not None:
            self._hit_buffer.release()
        self.store.close()


def _prompt_tokens(input_ids: torch.Tensor | Sequence[int]) -> list[int]:
    tokens = token_list(input_ids)
    if not tokens:
        raise ValueError("expected a non-empty prompt, got 0 tokens")
    return tokens


def token_list(token_ids: torch.Tensor | Sequence[int]) -> list[int]:
    """Token ids (an int tensor ``[n]`` or ``[1, n]``, or a sequence of ints, numpy ints
    included) as Python ints. Raises ``ValueError`` for float/bool ids, a batch > 1, or
    something that is not a sequence of ids."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ValueError(f"expected a list of token ids, got {type(token_ids).__name__}")
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise ValueError(f"expected integer token ids, got dtype {token_ids.dtype}")
        if token_ids.dim() == 2:
            if token_ids.shape[0] != 1:
                raise ValueError(f"expected batch size 1, got input_ids of shape {tuple(token_ids.shape)}")
            token_ids = token_ids[0]
        elif token_ids.dim() != 1:
            raise ValueError(f"expected [1, n] or [n] token ids, got shape {tuple(token_ids.shape)}")
        return token_ids.tolist()
    tokens = list(token_ids)
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"expected integer token ids, got {type(t).__name__}")
    return [int(t) for t in tokens]


def _consecutive_runs(indices: Sequence[int], block_ids: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Group new blocks into runs of consecutive request positions: ``(first_index, ids)``."""
    runs: list[tuple[int, list[int]]] = []
    for index, block_id in zip(indices, block_ids):
        if runs and runs[-1][0] + len(runs[-1][1]) == index:
            runs[-1][1].append(block_id)
        else:
            runs.append((index, [block_id]))
    return runs
