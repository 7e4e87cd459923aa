"""transformers' paged cache seen by kvtier: block views, block tables, block sharing.

Terms. transformers allocates its cache in *paged blocks* of ``page_size`` tokens (all layers
of a block are allocated together; a request's ``block_table`` lists its paged block ids in
order). kvtier keys *blocks* of ``block_size`` tokens. ``page_size`` must be a multiple of
``block_size`` (``ratio = page_size // block_size``): kvtier block ``j`` of a request lives in
paged block ``block_table[j // ratio]`` at token offset ``(j % ratio) * block_size``. So a hit
may end inside a paged block (the request then computes the rest of that block), and blocks
stored by ``model.generate`` through :class:`kvtier.connectors.hf.HFConnector` with the same
``block_size`` and ``head_major=False`` are hits here too (same namespace, same bytes).

Every layout gives the kernels per-layer K and V *block views* ``[num_views, block_size,
num_kv_heads, head_dim]`` (strided views of the engine's cache tensor, no copy), one set per
offset ``k`` in ``range(ratio)``, and maps (paged block id, ``k``) to a view index. Two
layouts, one per transformers generation (:mod:`.compat`):

- :class:`AllocatorsLayout` (5.18 - 5.25): one flat cache tensor; paged block ``b`` holds, per
  layer ``i``, K at rows ``b * stride + 2 * i * page_size`` and V at ``... + (2 * i + 1) *
  page_size`` of the ``[rows, num_kv_heads, head_dim]`` view (``stride`` =
  ``block_physical_stride`` = ``2 * num_layers * page_size``).
- :class:`BlockManagerLayout` (5.17): per layer a K and a V tensor ``[(num_blocks + 2) *
  page_size, num_kv_heads, head_dim]``; paged block ``b`` is rows ``b * page_size ...``. Its
  scheduler counts a matched prefix in whole paged blocks, so hits load whole paged blocks only.

A layout also reserves paged blocks for loaded tokens (:meth:`append`), registers the full ones
with transformers' block sharing (:meth:`register`) so that later requests share them, and
undoes a reservation (:meth:`truncate`). All of it runs on transformers' generation thread.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import torch

from kvtier.connectors.hf_cache import UnsupportedModelError

__all__ = ["AllocatorsLayout", "BlockManagerLayout", "PagedLayout", "UnsupportedModelError", "make_layout"]

Views = tuple[list[torch.Tensor], list[torch.Tensor]]


class PagedLayout(Protocol):
    page_size: int
    ratio: int
    partial_blocks: bool
    """Whether a hit may end inside a paged block (else it is cut to whole paged blocks)."""

    def views(self, k: int) -> Views: ...

    def view_id(self, paged_id: int, k: int) -> int: ...

    def block_table(self, request_id: str) -> list[int] | None: ...

    def complete_blocks(self, request_id: str) -> int: ...

    def append(self, request_id: str, past_tokens: int, num_tokens: int) -> int: ...

    def register(self, request_id: str, token_ids: list[int], num_blocks: int) -> None: ...

    def truncate(self, request_id: str, num_blocks: int) -> None: ...


def _check_ratio(page_size: int, block_size: int) -> int:
    if block_size <= 0 or page_size % block_size:
        raise ValueError(
            f"expected transformers' page_size ({page_size}) to be a multiple of kvtier's block_size "
            f"({block_size}); set ContinuousBatchingConfig's page size or StoreConfig.block_size so that it is"
        )
    return page_size // block_size


class AllocatorsLayout:
    """transformers 5.18 - 5.25 (``cache_allocators``): see the module docstring.

    Args:
        cache: a ``PagedAttentionCache`` with one full-attention allocator.
        block_size: kvtier's tokens per block, dividing the cache's ``page_size``.

    Raises:
        UnsupportedModelError: the cache has other layer types than full attention.
        ValueError: ``page_size`` is not a multiple of ``block_size``.
    """

    partial_blocks = True

    def __init__(self, cache: Any, block_size: int) -> None:
        from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

        if list(cache.cache_allocators) != [FULL_ATTENTION]:
            raise UnsupportedModelError(
                f"expected only full-attention layers, got layer types {list(cache.cache_allocators)}"
            )
        allocator = cache.cache_allocators[FULL_ATTENTION]
        if type(allocator).__name__ != "FullAttentionCacheAllocator":  # 5.25: MLA layers are FULL_ATTENTION too
            raise UnsupportedModelError(
                f"expected the full-attention allocator's page layout, got {type(allocator).__name__} "
                "(MLA latents: serve such models through HFConnector)"
            )
        if list(allocator.layer_indices) != list(range(len(allocator.layer_indices))):
            raise UnsupportedModelError(f"expected layers 0..L-1 in order, got {allocator.layer_indices}")
        self.cache, self.allocator = cache, allocator
        self.page_size = allocator.tokens_per_page
        self.ratio = _check_ratio(self.page_size, block_size)
        self._views = [self._build_views(k, block_size) for k in range(self.ratio)]

    def _build_views(self, k: int, block_size: int) -> Views:
        a = self.allocator
        heads, head_dim = a.num_key_value_heads, a.head_dim
        rows = a.cache_tensor.view(-1, heads, head_dim)  # [2 * total_tokens, H, D]
        stride = a.block_physical_stride  # rows per paged block
        num_paged = rows.shape[0] // stride
        size = (num_paged, block_size, heads, head_dim)
        strides = (stride * heads * head_dim, heads * head_dim, head_dim, 1)
        keys, values = [], []
        for i in range(len(a.layer_indices)):
            for kv, out in ((0, keys), (1, values)):
                first_row = (2 * i + kv) * self.page_size + k * block_size
                out.append(rows.as_strided(size, strides, rows.storage_offset() + first_row * heads * head_dim))
        return keys, values

    def views(self, k: int) -> Views:
        return self._views[k]

    def view_id(self, paged_id: int, k: int) -> int:
        return paged_id

    def block_table(self, request_id: str) -> list[int] | None:
        return self.allocator.block_table.get(request_id)

    def complete_blocks(self, request_id: str) -> int:
        hashed = self.allocator.ledger.block_to_hash
        count = 0
        for block_id in self.allocator.block_table.get(request_id, ()):
            if block_id not in hashed:
                break
            count += 1
        return count

    def append(self, request_id: str, past_tokens: int, num_tokens: int) -> int:
        """Give the request the paged blocks for ``num_tokens`` tokens after its first
        ``past_tokens``, as far as free blocks and sectors allow, and, past those, paged
        blocks that transformers keeps only for its own prefix cache (hashed, held by no
        request): the oldest of them are evicted, only as many as the load needs. The request
        needs those blocks anyway (to load into, or to compute into once transformers evicts
        its cached blocks under pressure), and vLLM's block pool hands cached free blocks to
        an allocation the same way, least recently freed first. A block a request holds is
        never taken. Returns the tokens covered (``num_tokens`` or fewer)."""
        a, pool = self.allocator, self.cache.pool
        have = len(a.block_table.get(request_id, ()))
        wanted = -(-(past_tokens + num_tokens) // self.page_size) - have
        room = self._room()
        if wanted > room:
            self._evict_cached(wanted - room)
            room = self._room()
        num_tokens = min(num_tokens, (have + room) * self.page_size - past_tokens)
        if num_tokens <= 0:
            return 0
        for _ in range(a.needs_new_sectors(request_id, past_tokens, num_tokens)):
            pool.allocate_sector(a.index)
        a.allocate_cache_to_request(request_id, past_tokens, num_tokens)
        return num_tokens

    def _room(self) -> int:
        a, pool = self.allocator, self.cache.pool
        return pool.count_free_blocks(a.index) + pool.num_free_sectors * a.blocks_per_sector

    def _evict_cached(self, num_blocks: int) -> None:
        """Evict up to ``num_blocks`` of transformers' cached paged blocks, least recently
        freed first (``BlockLedger.cached_blocks`` is an ordered set, appended on release),
        forgetting their hashes as ``BlockLedger.evict_cached_blocks`` does for all of them."""
        ledger = self.allocator.ledger
        victims = list(itertools.islice(ledger.cached_blocks, num_blocks))
        for block_id in victims:
            del ledger.cached_blocks[block_id]
            block_hash = ledger.block_to_hash.pop(block_id, None)
            if block_hash is not None and ledger.hash_to_block.get(block_hash) == block_id:
                del ledger.hash_to_block[block_hash]
        if victims:
            self.cache.pool.free_blocks(self.allocator.index, victims)

    def register(self, request_id: str, token_ids: list[int], num_blocks: int) -> None:
        """Hash the first ``num_blocks`` unhashed paged blocks of the request (full ones, K/V
        written) into the ledger, so the prefix match of later requests shares them."""
        if num_blocks > 0 and self.cache.allow_block_sharing:
            self.allocator.mark_complete_blocks(request_id, token_ids, num_blocks)

    def truncate(self, request_id: str, num_blocks: int) -> None:
        """Give back the request's paged blocks after its first ``num_blocks``."""
        table = self.allocator.block_table.get(request_id)
        if table is None:
            return
        extra = table[num_blocks:]
        del table[num_blocks:]
        freed = [b for b in extra if self.allocator.ledger.release(b)]
        self.cache.pool.free_blocks(self.allocator.index, freed)


class BlockManagerLayout:
    """transformers 5.17 (``cache_manager.BlockManager``): see the module docstring.

    Raises:
        UnsupportedModelError: the cache has more than one layer group (sliding window layers).
        ValueError: the paged block size is not a multiple of ``block_size``.
    """

    partial_blocks = False

    def __init__(self, cache: Any, block_size: int) -> None:
        if cache.num_groups != 1 or cache.num_sliding_attention_groups:
            raise UnsupportedModelError("expected only full-attention layers (one layer group)")
        self.cache = cache
        self.manager = cache.group_cache_managers[0]
        self.page_size = cache.block_size
        self.ratio = _check_ratio(self.page_size, block_size)
        num_layers = len(cache.key_cache)
        order = [cache.layer_index_to_group_indices[layer] for layer in range(num_layers)]
        if order != [(0, j) for j in range(num_layers)]:
            raise UnsupportedModelError(f"expected layers 0..L-1 in one group, got {order}")
        shape = (-1, block_size, cache.num_key_value_heads, cache.head_dim)
        self._views = ([t.view(shape) for t in cache.key_cache], [t.view(shape) for t in cache.value_cache])

    def views(self, k: int) -> Views:
        return self._views

    def view_id(self, paged_id: int, k: int) -> int:
        return paged_id * self.ratio + k

    def block_table(self, request_id: str) -> list[int] | None:
        return self.manager.block_table.get(request_id)

    def complete_blocks(self, request_id: str) -> int:
        blocks = self.cache._block_manager._id_to_block
        count = 0
        for block_id in self.manager.block_table.get(request_id, ()):
            block = blocks.get(block_id)
            if block is None or not block.is_complete:
                break
            count += 1
        return count

    def append(self, request_id: str, past_tokens: int, num_tokens: int) -> int:
        """Whole paged blocks only (this release's scheduler counts a match in paged blocks)."""
        manager = self.cache._block_manager
        num_blocks = min(num_tokens // self.page_size, manager.num_free_blocks)
        if num_blocks <= 0 or self.manager.allocate_blocks(num_blocks, request_id, manager) is None:
            return 0
        return num_blocks * self.page_size

    def register(self, request_id: str, token_ids: list[int], num_blocks: int) -> None:
        if num_blocks > 0 and self.cache.allow_block_sharing:
            self.cache._block_manager.mark_shareable_blocks_as_complete(
                num_complete_blocks=num_blocks, allocated_blocks=self.manager.block_table[request_id],
                prompt_ids=token_ids,
            )

    def truncate(self, request_id: str, num_blocks: int) -> None:
        table = self.manager.block_table.get(request_id)
        if table is None:
            return
        extra = table[num_blocks:]
        del table[num_blocks:]
        self.cache._block_manager.free_blocks(extra, shareable=self.manager.uses_block_sharing)


def make_layout(cache: Any, block_size: int) -> PagedLayout:
    """The layout of ``cache`` for the installed transformers (:func:`.compat.check_transformers`)."""
    from kvtier.connectors.hf_paged.compat import check_transformers

    if check_transformers() == "block_manager":
        return BlockManagerLayout(cache, block_size)
    return AllocatorsLayout(cache, block_size)
