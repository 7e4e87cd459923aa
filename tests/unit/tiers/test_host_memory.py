"""kvtier.tiers.host_memory: host buffers on transparent huge pages."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from kvtier.tiers.host_memory import HUGE_PAGE_NBYTES, host_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _anon_huge_kib(address: int) -> int | None:
    """AnonHugePages of the mapping holding ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16], ids=str)
def test_host_empty_is_an_aligned_tensor_of_its_own(dtype: torch.dtype) -> None:
    """2 MiB aligned, contiguous, of the asked size and dtype, not a view, its storage's only
    user (what HostHitBuffer's reuse test counts), and usable memory."""
    numel = (3 * HUGE_PAGE_NBYTES + 4096) // dtype.itemsize
    t = host_empty(numel, dtype)
    assert t.dtype == dtype and tuple(t.shape) == (numel,) and t.is_contiguous() and t._base is None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % HUGE_PAGE_NBYTES == 0
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is not None:
        assert use_count(t.untyped_storage()._cdata) == 2
    t.fill_(1)
    assert float(t.float().sum()) == numel


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages off here")
def test_host_empty_memory_is_on_huge_pages() -> None:
    """Written memory of a host_empty tensor is on huge pages (the kernel may refuse one
    under fragmentation: at least half of 16 MiB must be), a torch.empty one in madvise mode
    is not, and the mapping goes when the tensor is freed."""
    t = host_empty(16 << 20)
    t.fill_(7)
    huge = _anon_huge_kib(t.data_ptr())
    assert huge is not None and huge >= 8 << 10, huge
    if _thp_mode() == "madvise":
        plain = host_empty(16 << 20, huge_pages=False)
        plain.fill_(7)
        assert not _anon_huge_kib(plain.data_ptr())
    address = t.data_ptr()
    del t
    gc.collect()
    assert _anon_huge_kib(address) in (None, 0)


def test_host_empty_small_or_empty_is_torch_empty() -> None:
    assert host_empty(0).numel() == 0
    assert host_empty(100, torch.float32).shape == (100,)
    with pytest.raises(ValueError):
        host_empty(-1)


def test_cpu_pool_and_hit_buffer_start_on_a_huge_page() -> None:
    """The CPU pool's slab (its slots one FRAME_PAD_NBYTES in) and the HF connector's kept hit
    buffer are host_empty memory."""
    from kvtier.connectors.hf_cache import HostHitBuffer
    from kvtier.tiers.pool import FRAME_PAD_NBYTES, BlockPool
    from kvtier.types import KVSpec, Medium

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE here")
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, head_major=True)
    pool = BlockPool(Medium.CPU, spec, 64 * spec.block_nbytes)
    assert (pool.tensor.data_ptr() - FRAME_PAD_NBYTES) % HUGE_PAGE_NBYTES == 0
    kv = HostHitBuffer(spec, 1 << 30).take(16 * 64)
    assert kv is not None and kv.data_ptr() % HUGE_PAGE_NBYTES == 0
