"""Opening a DISK tier after a page-cache drop: time and bytes read, for bench/tiers.py.

The tier holds ``--open-bytes`` of records (2 MiB blocks; 8 GiB for the issue-17 figure,
small in CI), written with ``DiskTier.write_batch``, fsynced and closed. Each round drops the
tier's files from the page cache (:func:`bench.common.drop_page_cache`) and opens it; rows:

- time to ``DiskTier(...)`` (index loaded, ready to serve). Baseline: ``lmdb.open`` + ``stat``
  of the same directory after the same drop (LMDB's own floor).
- bytes read from storage while opening (``/proc/self/io`` read_bytes). Baseline: the bytes
  the records take on disk (allocated blocks of the directory); the ratio is the fraction read.

The directory is removed at the end, also on failure (8 GiB must not be left behind).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import lmdb
import torch

from bench.common import Row, Stat, drop_page_cache, io_read_bytes
from kvtier.tiers.disk import DiskTier, record_footprint


def _allocated_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def write_tier(path: Path, src: torch.Tensor, num_blocks: int, namespace: bytes, batch: int = 32) -> DiskTier:
    """A DISK tier at ``path`` holding ``num_blocks`` records (the blocks of ``src`` in turn,
    under distinct hashes and fingerprints)."""
    tier = DiskTier(path, num_blocks * record_footprint(src[0].numel() * src.element_size()))
    for start in range(0, num_blocks, batch):
        puts = []
        for i in range(start, min(start + batch, num_blocks)):
            h = hashlib.sha256(b"open:%d" % i).digest()
            puts.append((h, namespace, src[i % src.shape[0]], hashlib.sha256(b"fp" + h).digest()))
        assert all(tier.write_batch(puts)), "DISK refused a block while filling the tier"
    return tier


def open_rows(
    work_dir: Path, src: torch.Tensor, open_bytes: int, namespace: bytes, repeats: int, stat: Stat,
    system_drop: bool = False,
) -> list[Row]:
    """The two rows (time, bytes read) of opening a tier of ``open_bytes`` of records."""
    block_nbytes = src[0].numel() * src.element_size()
    num_blocks = open_bytes // block_nbytes
    path = work_dir / "open" / "disk"
    try:
        tier = write_tier(path, src, num_blocks, namespace)
        capacity = tier.capacity_bytes
        tier.close()  # fsyncs: the drop below finds clean pages
        stored = _allocated_bytes(path)
        opened, floor, read = [], [], []
        for _ in range(repeats + 1):  # the first round is a warm-up (first open after writing)
            drop_page_cache([path], system_drop)
            before, start = io_read_bytes(), time.perf_counter()
            tier = DiskTier(path, capacity)
            opened.append(time.perf_counter() - start)
            read.append(io_read_bytes() - before)
            assert len(tier) == num_blocks, f"opened with {len(tier)} of {num_blocks} blocks"
            tier.close()
            drop_page_cache([path], system_drop)
            start = time.perf_counter()
            env = lmdb.open(str(path), readonly=True, lock=False)
            env.stat()
            env.close()
            floor.append(time.perf_counter() - start)
        pick = min if stat == "best" else (lambda xs: sorted(xs)[len(xs) // 2])
        gib = num_blocks * block_nbytes / (1 << 30)
        return [
            Row(f"DISK open, {gib:.1f} GiB of records, page cache dropped: time", pick(opened[1:]) * 1e3, "ms",
                pick(floor[1:]) * 1e3, "lmdb.open + stat, page cache dropped"),
            Row(f"DISK open, {gib:.1f} GiB of records, page cache dropped: read from disk (most)", max(read[1:]) / 1e6, "MB",
                stored / 1e6, "bytes the records take on disk"),
        ]
    finally:
        shutil.rmtree(work_dir / "open", ignore_errors=True)
