"""Host memory for kvtier's large, long-lived buffers (the CPU pool's slab, the HF
connector's kept hit buffer) on transparent huge pages.

A hit gathers each block of a request into its place in the cache tensors: per block,
``num_layers * 2 * num_kv_heads`` runs of ``block_size * head_dim`` elements (4 KiB for
SmolLM2-135M fp32), each into another row of the destination, so every run is a new 4 KiB
page on both sides. On 2 MiB pages the same gather walks 512x fewer pages: on this project's
2-core VM (THP ``madvise`` mode) a CPU hit of 1-4k tokens took 1.03-1.13x (best) / 1.25-1.42x
(median) of one ``Tensor.copy_`` of the same bytes between ordinary allocations, vs
1.14-1.32x / 1.47-1.51x with the pool and the buffer on 4 KiB pages, interleaved in one
process (bench/results/2026-12-02-hit-5/README.md).

:func:`host_empty` maps private anonymous memory aligned to 2 MiB and asks the kernel for
huge pages (``madvise(MADV_HUGEPAGE)``: honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``; a hint, never
an error). Memory is committed page by page as it is first written, in 2 MiB steps where the
kernel grants huge pages.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE_NBYTES = 2 << 20
"""The x86-64 / arm64 (4 KiB base page) transparent huge page size: the alignment used."""

MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
"""``madvise`` advice for transparent huge pages (Linux only; ``None`` elsewhere): used here
and for LMDB's map (:func:`kvtier.tiers.disk.advise_huge_pages`)."""


def host_empty(numel: int, dtype: torch.dtype = torch.uint8, huge_pages: bool = True) -> torch.Tensor:
    """An uninitialised ``[numel]`` CPU tensor of ``dtype`` starting on a 2 MiB boundary, on
    transparent huge pages where the kernel grants them.

    Args:
        numel: the number of elements (>= 0).
        dtype: the element type.
        huge_pages: ``False``: a plain ``torch.empty`` (ordinary pages, torch's allocator).

    Returns:
        a contiguous tensor; its memory (an anonymous private mapping) is unmapped when the
        last tensor using it is freed. Without ``mmap.MADV_HUGEPAGE`` (not Linux) or for
        fewer bytes than one huge page, ``torch.empty``. Not a view (``._base`` is
        ``None``): the tensor is its storage's only user.

    Raises:
        ValueError: ``numel`` < 0. ``OSError`` (ENOMEM) when the mapping cannot be made.
    """
    if numel < 0:
        raise ValueError(f"expected numel >= 0, got {numel}")
    nbytes = numel * dtype.itemsize
    if not huge_pages or MADV_HUGEPAGE is None or nbytes < HUGE_PAGE_NBYTES:
        return torch.empty(numel, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_NBYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until its storage is freed
    start = -whole.data_ptr() % HUGE_PAGE_NBYTES
    try:
        mapping.madvise(MADV_HUGEPAGE, start, nbytes - nbytes % mmap.PAGESIZE)
    except OSError:  # THP off or unsupported here: ordinary pages
        pass
    # a tensor of its own on the mapping's storage, not a view of ``whole`` (a view keeps
    # ``whole`` as its base: one more use of the storage, which HostHitBuffer's test of
    # "nothing else holds the buffer" counts)
    return torch.empty(0, dtype=dtype).set_(whole.untyped_storage(), start // dtype.itemsize, (numel,))
