"""SGLang host-pool pages <-> kvtier blocks: one strided view per page, no staging copy.

SGLang's HiCache host pool (L2) keeps K/V in one pinned tensor, ``kv_buffer``, whose layout
is chosen by ``--hicache-mem-layout`` (sglang/srt/mem_cache/pool_host/mha.py and mla.py,
``init_kv_buffer``); a page is ``page_size`` consecutive token slots starting at a
page-aligned host index::

    MHA  layer_first        [2, num_layers, size, num_heads, head_dim]
         page_first         [2, size, num_layers, num_heads, head_dim]
         page_first_direct  [2, num_pages, num_layers, page_size, num_heads, head_dim]
         page_head          [2, num_pages, num_heads, page_size, num_layers, head_dim]
    MLA  layer_first        [num_layers, size, 1, kv_dim]
         page_first         [size, num_layers, 1, kv_dim]
         page_first_direct  [num_pages, num_layers, page_size, 1, kv_dim]

Every layout maps to one canonical page, so engines with different host layouts share
pages (the host layout is not part of the key)::

    MHA  [num_layers, 2, page_size, num_heads, head_dim]   = a kvtier block (KVSpec.block_shape)
    MLA  [num_layers, page_size, 1, kv_dim]                stored as a kvtier block of shape
                                                           [num_layers, 2, page_size, 1, kv_dim/2]
                                                           (the same bytes, viewed)

Layouts SGLang has that this module does not know (``page_unified``, ``page_first_kv_split``,
split heads, asymmetric K/V head dims, FP4/FP8 scale sidecars) are refused when the host pool
is registered (:func:`page_layout_for`), never guessed at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from kvtier.types import KVSpec, dtype_name

Kind = Literal["MHA", "MLA"]

# host layout -> (host-order page from kv_buffer at page start `index`, host-order page -> canonical)
_Slicer = Callable[[torch.Tensor, int, int], torch.Tensor]
_MHA: dict[str, tuple[_Slicer, Callable[[torch.Tensor], torch.Tensor]]] = {
    "layer_first": (lambda kv, i, ps: kv[:, :, i : i + ps], lambda p: p.transpose(0, 1)),
    "page_first": (lambda kv, i, ps: kv[:, i : i + ps], lambda p: p.permute(2, 0, 1, 3, 4)),
    "page_first_direct": (lambda kv, i, ps: kv[:, i // ps : i // ps + 1], lambda p: p.select(1, 0).transpose(0, 1)),
    "page_head": (lambda kv, i, ps: kv[:, i // ps : i // ps + 1], lambda p: p.select(1, 0).permute(3, 0, 2, 1, 4)),
}
_MLA: dict[str, tuple[_Slicer, Callable[[torch.Tensor], torch.Tensor]]] = {
    "layer_first": (lambda kv, i, ps: kv[:, i : i + ps], lambda p: p),
    "page_first": (lambda kv, i, ps: kv[i : i + ps], lambda p: p.transpose(0, 1)),
    "page_first_direct": (lambda kv, i, ps: kv[i // ps : i // ps + 1], lambda p: p.select(0, 0)),
}
SUPPORTED_LAYOUTS: dict[Kind, tuple[str, ...]] = {"MHA": tuple(_MHA), "MLA": tuple(_MLA)}


@dataclass(frozen=True)
class PageLayout:
    """How one SGLang host page maps onto one kvtier block.

    Attributes:
        kind: ``"MHA"`` (K and V per head; GQA included) or ``"MLA"`` (one compressed latent
            per token, the same on every TP rank).
        host_layout: SGLang's ``--hicache-mem-layout`` of the host pool.
        num_layers, page_size: layers in the host pool (this PP stage's), tokens per page.
        num_heads, head_dim: MHA K/V heads on this rank and elements per head; MLA: 1 and
            ``kv_dim`` (``kv_lora_rank + qk_rope_head_dim``).
        dtype: the host pool's element type.
    """

    kind: Kind
    host_layout: str
    num_layers: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        if self.kind == "MHA":
            return (self.num_layers, 2, self.page_size, self.num_heads, self.head_dim)
        return (self.num_layers, self.page_size, 1, self.head_dim)

    @property
    def spec(self) -> KVSpec:
        """The kvtier block spec one page is stored as."""
        if self.kind == "MHA":
            return KVSpec(self.num_layers, self.num_heads, self.head_dim, self.page_size, self.dtype)
        return KVSpec(self.num_layers, 1, self.head_dim // 2, self.page_size, self.dtype)

    @property
    def name(self) -> str:
        """Layout and geometry, for the namespace: ``sglang/MHA/LKVTHD/L2.H2.D8``."""
        order = "LKVTHD" if self.kind == "MHA" else "LT1D"
        return f"sglang/{self.kind}/{order}/L{self.num_layers}.H{self.num_heads}.D{self.head_dim}"

    @property
    def host_page_shape(self) -> tuple[int, ...]:
        """Shape of one page in host order: SGLang's ``get_data_page(i, flat=False)``; a flat
        page of the generic (non-v1) path is this shape, flattened."""
        L, ps, H, D = self.num_layers, self.page_size, self.num_heads, self.head_dim
        return {
            ("MHA", "layer_first"): (2, L, ps, H, D),
            ("MHA", "page_first"): (2, ps, L, H, D),
            ("MHA", "page_first_direct"): (2, 1, L, ps, H, D),
            ("MHA", "page_head"): (2, 1, H, ps, L, D),
            ("MLA", "layer_first"): (L, ps, 1, D),
            ("MLA", "page_first"): (ps, L, 1, D),
            ("MLA", "page_first_direct"): (1, L, ps, 1, D),
        }[(self.kind, self.host_layout)]

    def _ops(self):
        return (_MHA if self.kind == "MHA" else _MLA)[self.host_layout]

    def host_page(self, kv_buffer: torch.Tensor, index: int) -> torch.Tensor:
        """The page at host token index ``index`` (page-aligned), in host order: a view."""
        return self._ops()[0](kv_buffer, index, self.page_size)

    def page(self, kv_buffer: torch.Tensor, index: int) -> torch.Tensor:
        """The page at host token index ``index`` as a canonical-shaped view into ``kv_buffer``."""
        return self._ops()[1](self.host_page(kv_buffer, index))

    def flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page of the generic path (``[numel]``, host order) as a canonical view.

        Raises:
            ValueError: ``flat`` has the wrong size or dtype.
        """
        numel = math.prod(self.host_page_shape)
        if not isinstance(flat, torch.Tensor) or flat.numel() != numel or flat.dtype != self.dtype:
            got = (flat.numel(), flat.dtype) if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise ValueError(f"expected a flat page of {numel} {self.dtype} elements, got {got}")
        return self._ops()[1](flat.reshape(self.host_page_shape))

    def block(self, block: torch.Tensor) -> torch.Tensor:
        """A kvtier block slot (``[*spec.block_shape]``, contiguous) as a canonical page view."""
        return block.view(self.canonical_shape)


def page_layout_for(host_pool: Any, is_mla: bool) -> PageLayout:
    """The page layout of a registered SGLang host pool (``MHATokenToKVPoolHost`` or
    ``MLATokenToKVPoolHost``), checked against its buffer and, where the pool has it, its own
    page accessor ``get_data_page``: the views this module takes must address exactly the
    bytes SGLang's own code does.

    Raises:
        ValueError: a layout, geometry or dtype this module cannot serve exactly.
    """
    kind: Kind = "MLA" if is_mla else "MHA"
    layout = getattr(host_pool, "layout", None)
    if layout not in SUPPORTED_LAYOUTS[kind]:
        raise ValueError(
            f"kvtier's SGLang backend serves {kind} host layouts {list(SUPPORTED_LAYOUTS[kind])}, "
            f"got {layout!r} (--hicache-mem-layout)"
        )
    kv = getattr(host_pool, "kv_buffer", None)
    if not isinstance(kv, torch.Tensor) or not kv.is_contiguous() or kv.device.type != "cpu":
        raise ValueError(f"expected the host pool's kv_buffer to be one contiguous CPU tensor, got {type(kv).__name__}")
    dtype_name(kv.dtype)  # ValueError for a dtype kvtier does not store
    if kind == "MHA":
        heads, head_dim = int(host_pool.head_num), int(host_pool.head_dim)
        if int(getattr(host_pool, "v_head_dim", head_dim)) != head_dim:
            raise ValueError(f"expected v_head_dim == head_dim ({head_dim}), got {host_pool.v_head_dim}")
    else:
        heads, head_dim = 1, int(host_pool.kv_cache_dim)
        if head_dim % 2:
            raise ValueError(f"expected an even MLA kv_cache_dim, got {head_dim}")
    result = PageLayout(kind, layout, int(host_pool.layer_num), int(host_pool.page_size), heads, head_dim, kv.dtype)
    _check_buffer(result, kv)
    _check_against_pool(result, host_pool, kv)
    return result


def _check_buffer(layout: PageLayout, kv: torch.Tensor) -> None:
    """The buffer's dimensions other than its token/page axis are what the layout says."""
    page_shape = layout.host_page_shape
    try:
        probe_shape = tuple(layout.host_page(kv, 0).shape)
    except IndexError:  # fewer dimensions than the layout has
        probe_shape = ()
    if probe_shape != page_shape:
        raise ValueError(
            f"expected a {layout.kind} {layout.host_layout} kv_buffer whose page is {page_shape}, "
            f"got kv_buffer {tuple(kv.shape)}"
        )


def _check_against_pool(layout: PageLayout, host_pool: Any, kv: torch.Tensor) -> None:
    get_data_page = getattr(host_pool, "get_data_page", None)
    if get_data_page is None:
        return
    num_tokens = kv.numel() // math.prod(layout.host_page_shape) * layout.page_size
    for index in {0, max(0, num_tokens - layout.page_size)}:
        ours, theirs = layout.host_page(kv, index), get_data_page(index, flat=False)
        same = (
            tuple(ours.shape) == tuple(theirs.shape)
            and ours.stride() == theirs.stride()
            and ours.data_ptr() == theirs.data_ptr()
        )
        if not same:
            raise ValueError(
                f"the host pool's page {index} is not where kvtier expects it for layout "
                f"{layout.host_layout!r}: SGLang's get_data_page gives shape {tuple(theirs.shape)}, "
                f"stride {theirs.stride()}; kvtier computed {tuple(ours.shape)}, {ours.stride()}"
            )
