"""Plumbing every kvtier benchmark shares: rows, timing, the table and the JSON file.

Convention: a benchmark prints one table (rich) and, given ``--json PATH``, writes::

    {"bench": NAME, "rows": [{"metric", "value", "unit", "baseline", "ratio"}, ...]}

``baseline`` is measured in the same run as ``value`` (never copied from an earlier run) and
``ratio = value / baseline``; both are ``null`` where no baseline applies.

Timing: :func:`measure` runs a value case and its baseline *interleaved* (value, baseline,
value, baseline, ...) after one untimed warm-up round, so that a load change on a shared
machine hits both alike; it keeps every sample and :class:`Timing` reports the best (the
usual estimator on a noisy machine: noise only ever adds time) or the median.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

Stat = Literal["best", "median"]
GB = 1e9
"""Throughputs are decimal GB/s (1e9 bytes per second), as in the LMCache figures the benches compare with."""


@dataclass(frozen=True, slots=True)
class Row:
    """One line of a benchmark's table and JSON.

    Attributes:
        metric: what was measured, e.g. ``"CPU put: store()"``.
        value: the measurement, in ``unit``.
        unit: e.g. ``"GB/s"``.
        baseline: the same quantity for the baseline, measured in the same run, or ``None``.
        baseline_name: what the baseline is (table only; not part of the JSON schema).
    """

    metric: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""

    @property
    def ratio(self) -> float | None:
        """``value / baseline``; ``None`` without a (positive) baseline."""
        if self.baseline is None or self.baseline <= 0:
            return None
        return self.value / self.baseline

    def to_json(self) -> dict[str, object]:
        return {
            "metric": self.metric,
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "ratio": self.ratio,
        }


@dataclass(frozen=True, slots=True)
class Case:
    """One timed operation.

    Attributes:
        run: the work to time.
        before: untimed preparation, called before every run (warm-up included).
    """

    run: Callable[[], object]
    before: Callable[[], object] | None = None


@dataclass(frozen=True, slots=True)
class Timing:
    """Wall-clock samples of one case, seconds (warm-up excluded)."""

    samples_s: tuple[float, ...]

    @property
    def best_s(self) -> float:
        return min(self.samples_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    def seconds(self, stat: Stat) -> float:
        return self.best_s if stat == "best" else self.median_s

    def throughput(self, nbytes: int, stat: Stat) -> float:
        """``nbytes`` per :meth:`seconds`, in GB/s."""
        return nbytes / self.seconds(stat) / GB


def measure(
    cases: Sequence[Case],
    repeats: int,
    warmup: int = 1,
    sync: Callable[[], object] | None = None,
) -> list[Timing]:
    """Time ``cases`` round-robin: ``warmup`` untimed rounds, then ``repeats`` timed ones.

    Args:
        cases: usually ``[value_case, baseline_case]``.
        repeats: timed runs per case (>= 1).
        warmup: untimed rounds first (first-touch page faults, allocator, caches).
        sync: called before the clock starts and again before it stops
            (``torch.cuda.synchronize``, so that queued device work is counted).

    Returns:
        one :class:`Timing` per case, in order.
    """
    if repeats < 1:
        raise ValueError(f"expected repeats >= 1, got {repeats}")
    samples: list[list[float]] = [[] for _ in cases]
    for round_index in range(warmup + repeats):
        for case, case_samples in zip(cases, samples):
            if case.before is not None:
                case.before()
            if sync is not None:
                sync()
            start = time.perf_counter()
            case.run()
            if sync is not None:
                sync()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                case_samples.append(elapsed)
    return [Timing(tuple(s)) for s in samples]


def arg_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the options every benchmark takes: ``--json``, ``--repeats``, ``--stat``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows here")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH",
                        help="also draw the rows against their baselines as a PNG here (needs matplotlib)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case, after one warm-up (default 3)")
    parser.add_argument(
        "--stat", choices=("best", "median"), default="best", help="which sample to report (default best)"
    )
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads (default: torch's own choice). On a machine whose cores other "
        "jobs keep busy, 1 avoids waiting for a descheduled worker in every parallel op",
    )
    return parser


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count when ``threads`` is given; return the count in use."""
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"expected --threads >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def print_table(title: str, rows: Sequence[Row], footnote: str = "") -> None:
    """Print ``rows`` as one rich table, ``footnote`` (free text) under it."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("baseline", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("baseline is")
    for row in rows:
        ratio = row.ratio
        table.add_row(
            row.metric, _fmt(row.value), row.unit, _fmt(row.baseline),
            "-" if ratio is None else f"{ratio:.2f}x", row.baseline_name,
        )
    console = Console(width=None if sys.stdout.isatty() else 160)  # a log file: don't wrap at 80
    console.print(table)
    if footnote:
        console.print(footnote, highlight=False)


def write_outputs(args, name: str, rows: Sequence[Row]) -> None:
    """``--json PATH`` and ``--plot PATH`` of :func:`arg_parser`, when given."""
    if getattr(args, "json", None) is not None:
        write_json(args.json, name, rows)
    if getattr(args, "plot", None) is not None:
        write_plot(args.plot, name, rows)


def write_json(path: str | Path, name: str, rows: Sequence[Row]) -> None:
    """Write ``{"bench": name, "rows": [...]}`` to ``path`` (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bench": name, "rows": [r.to_json() for r in rows]}, indent=2) + "\n")


def write_plot(path: str | Path, name: str, rows: Sequence[Row]) -> None:
    """Draw ``rows`` (value beside baseline, per unit) as a PNG (:func:`kvtier.app.plots.plot_bench`)."""
    from kvtier.app.plots import plot_bench

    plot_bench({"bench": name, "rows": [r.to_json() for r in rows]}, path)


# -- raw-file baselines ------------------------------------------------------------------------
def _bytes_view(t: "torch.Tensor") -> memoryview:
    import torch

    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def raw_write(path: Path, blocks: "torch.Tensor", chunk: int) -> None:
    """Sequential write of ``blocks`` to ``path``, overwriting in place (no truncate, no fsync)."""
    with open(path, "r+b" if path.exists() else "wb", buffering=0) as f:
        for i in range(0, blocks.shape[0], chunk):
            view = _bytes_view(blocks[i : i + chunk])
            while view:
                view = view[f.write(view) :]


RAW_WRITE_BASELINE = "raw write over cached file, no fsync"
RAW_WRITE_NOTE = (
    "Raw write baselines (tiers.py and transfers.py alike): a sequential write of the same bytes in the same chunks "
    "over a file written once before the measurement, so its pages are cached (as LMDB reuses its freed, cached "
    "pages); no fsync on either side. On the test VM a new file writes at ~0.5x that and a file dropped from the "
    "page cache at ~0.8x (bench/results/2026-12-02-disk-3/micro/rawwrite.log)."
)


def prime_raw_file(path: Path, blocks: "torch.Tensor", chunk: int) -> Path:
    """Write ``blocks`` to ``path`` once (untimed), so that the timed :func:`raw_write` runs
    overwrite cached pages (:data:`RAW_WRITE_NOTE`). Returns ``path``."""
    raw_write(path, blocks, chunk)
    return path


def disk_warmup_rounds(disk, round_nbytes: int) -> int:
    """Untimed rounds for a case that writes ``round_nbytes`` into the DISK tier ``disk``
    (a :class:`kvtier.tiers.disk.DiskTier`) each round: enough that every page of LMDB's data
    file was written once before the clock starts, as the raw-write baselines overwrite a file
    written once before (:data:`RAW_WRITE_NOTE`). Until its freed pages come around, LMDB
    writes into pages of its sparse map file not touched before (a page fault and a zeroed page
    each): a store into a full CPU slab ran at 3.1 GB/s for the first 6 rounds of 256 MiB into
    a 1.3 GiB file and 7.5 GB/s from then on (bench/results/2026-12-03-hit-overhead/README.md);
    the benches' first-fill rows (a fresh tier) measure that cost on their own.

    Raises:
        ValueError: ``round_nbytes`` is not positive."""
    if not round_nbytes > 0:
        raise ValueError(f"expected round_nbytes > 0, got {round_nbytes!r}")
    size = (Path(disk.path) / "data.mdb").stat().st_size
    return max(1, -(-size // round_nbytes) + 1)


class MappedFile:
    """A file of ``nbytes`` mapped ``MAP_SHARED`` as LMDB maps its data file (advised
    ``MADV_HUGEPAGE`` where the platform has it: :func:`kvtier.tiers.disk.advise_huge_pages`),
    for the benches' floors (:class:`bench.tiers.StoreFloor`, :class:`bench.hit_path.ReadFloor`).
    ``content`` (``nbytes`` bytes) is written first; without it the file is sparse, as LMDB's
    grows. ``array``: a ``uint8`` numpy view of the whole mapping, ``[nbytes]``; writable
    unless ``read_only``. :meth:`close` unmaps and deletes the file."""

    def __init__(self, path: Path, nbytes: int, content: bytes | None = None, read_only: bool = False) -> None:
        import mmap

        import numpy as np

        self.path = path
        with open(path, "wb") as f:
            if content is None:
                f.truncate(nbytes)
            else:
                assert len(content) == nbytes, (len(content), nbytes)
                f.write(content)
        self._file = open(path, "rb" if read_only else "r+b")
        self._map = mmap.mmap(self._file.fileno(), nbytes, prot=mmap.PROT_READ if read_only else
                              mmap.PROT_READ | mmap.PROT_WRITE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def close(self) -> None:
        """Unmap and delete the file; views of :attr:`array` must be gone first."""
        del self.array
        self._map.close()
        self._file.close()
        self.path.unlink(missing_ok=True)


def raw_read(path: Path, out: "torch.Tensor", chunk: int) -> None:
    """Sequential ``readinto`` of ``path`` into the preallocated ``out``."""
    with open(path, "rb", buffering=0) as f:
        for i in range(0, out.shape[0], chunk):
            view = _bytes_view(out[i : i + chunk])
            while view:
                n = f.readinto(view)
                assert n, "raw file shorter than expected"
                view = view[n:]


# -- page cache ----------------------------------------------------------------------------------
def drop_page_cache(paths: Sequence[Path], system: bool = False) -> None:
    """Evict ``paths`` (files, or directories: every file under them) from the page cache,
    as after a reboot: ``sync``, then ``posix_fadvise(DONTNEED)`` on each file; with
    ``system`` also ``echo 3 > /proc/sys/vm/drop_caches`` (root only; the whole machine's
    cache). Pages a process still has mapped stay cached either way: close LMDB first.

    Raises:
        PermissionError: ``system`` without root.
    """
    import os

    os.sync()
    if system:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    for path in paths:
        for file in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def io_read_bytes() -> int:
    """Bytes this process has caused to be read from storage (``read_bytes`` of
    ``/proc/self/io``: page-cache misses, readahead included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")
