"""DiskTier advises LMDB's map MADV_HUGEPAGE (kvtier.tiers.disk.advise_huge_pages): the map
of data.mdb carries the kernel's ``hg`` flag, reads and writes through it stay exact, and
the advice is best effort (no mapping, no file: False, nothing raised)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from kvtier.records import ReadStatus
from kvtier.tiers.disk import DiskTier, advise_huge_pages, record_footprint

NS = b"n" * 32
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages off or not Linux",
)


def _vm_flags_of(path: Path) -> list[list[str]]:
    """The VmFlags of each of this process's mappings of ``path`` (from /proc/self/smaps)."""
    st, flags, current = os.stat(path), [], False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's first line
            current = fields[4] == str(st.st_ino)
        elif current and fields[0] == "VmFlags:":
            flags.append(fields[1:])
    return flags


@needs_thp
def test_the_records_map_is_advised_huge_pages_and_reads_stay_exact(tmp_path):
    blocks = torch.randn(6, 2, 1 << 16)  # 512 KiB each
    disk = DiskTier(tmp_path / "disk", 8 * record_footprint(blocks[0].numel() * 4))
    try:
        assert disk.huge_page_map
        maps = _vm_flags_of(tmp_path / "disk" / "data.mdb")
        assert maps and all("hg" in flags for flags in maps), maps
        hashes = [bytes([i]) * 32 for i in range(len(blocks))]
        assert all(disk.write_batch([(h, NS, b, b"f" * 32) for h, b in zip(hashes, blocks)]))
        out = torch.empty_like(blocks[0])
        for h, block in zip(hashes, blocks):
            assert disk.read_into(h, NS, out, b"f" * 32) is ReadStatus.OK and torch.equal(out, block)
    finally:
        disk.close()


@needs_thp
def test_a_reopened_tier_advises_its_new_map(tmp_path):
    disk = DiskTier(tmp_path / "disk", 1 << 24)
    disk.close()
    disk = DiskTier(tmp_path / "disk", 1 << 24)
    try:
        assert disk.huge_page_map and all("hg" in f for f in _vm_flags_of(tmp_path / "disk" / "data.mdb"))
    finally:
        disk.close()


def test_the_advice_is_best_effort(tmp_path):
    unmapped = tmp_path / "plain.bin"
    unmapped.write_bytes(b"x" * 4096)
    assert advise_huge_pages(unmapped, 4096) is False  # not mapped by this process
    assert advise_huge_pages(tmp_path / "absent", 4096) is False  # no such file: no error
