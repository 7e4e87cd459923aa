"""kvtier's SGLang HiCache backend vs SGLang's own file backend (HiCacheFile): put and get
throughput of the same pages, in the same run.

    python bench/sglang_backend.py [--total-bytes 512MiB] [--page-size 16] [--layout page_first]
                                   [--repeats 3] [--json PATH] [--dir DIR]

Needs the sglang package (run it with the venv `.ci/sglang-tests` builds). Pages have the
Llama-3-8B shape at TP 1 (32 layers, 8 K/V heads, head_dim 128, bf16): 2 MiB per 16-token page.
Both backends are driven as SGLang's HiCacheController drives them, with its own page functions
(tests/sglang/sglang_source.py): kvtier on the zero-copy path (``interface_v1``: host-pool
indices), HiCacheFile on the generic path it implements (flat pages: ``get_data_page`` /
``get_dummy_flat_data_page`` + ``set_from_flat_data_page``). Keys are SGLang's ``get_hash_str``
of the pages' token ids; batches of ``STORAGE_BATCH_SIZE`` pages as the controller sends them.

Steady state, as in a long-running server: each backend is opened once, its DISK capacity
is 1.5x the pages of one run (HiCacheFile's ``max_size`` the same), and every put run writes
new pages (new token ids), so from the second run on each put also evicts earlier runs'
pages. kvtier's CPU pool is held to ``--cpu-bytes`` (default 32 MiB) so that gets come from its
DISK tier (the count is checked and printed). Rows (value = kvtier, baseline = HiCacheFile,
interleaved after one warm-up round):

- put: the backup of every page until the bytes are in the file system: HiCacheFile writes one
  file per page; kvtier copies each page into its CPU pool and writes LMDB records on its I/O
  threads (timed until they are done, ``store.wait_for_writes``). Neither fsyncs.
- get from disk: the read of the last put's pages into the host pool (every kvtier record
  verified: namespace, shape, dtype, xxh3); the page cache is warm for both.
- exists: ``batch_exists`` of every key (pages per second).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import GB, Case, Row, apply_threads, arg_parser, measure, print_table, write_outputs  # noqa: E402
from kvtier.config import parse_bytes  # noqa: E402

NAME = "sglang_backend"
NUM_LAYERS, NUM_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16


class Bench:
    """Both backends over one host pool holding the pages (and room to read them back)."""

    def __init__(self, args, work_dir: Path) -> None:
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
        from sglang.srt.mem_cache.utils import get_hash_str
        from tests.sglang.sglang_source import host_pool

        page_nbytes = 2 * NUM_LAYERS * args.page_size * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
        self.num_pages = max(1, args.total_bytes // page_nbytes)
        self.nbytes = self.num_pages * page_nbytes
        self.args, self.work_dir, self.batch = args, work_dir, STORAGE_BATCH_SIZE
        self.host = host_pool("MHA", args.layout, num_pages=2 * self.num_pages, page_size=args.page_size,
                              num_layers=NUM_LAYERS, dtype=DTYPE, num_heads=NUM_HEADS, head_dim=HEAD_DIM)
        self.src = self.host.alloc(self.num_pages * args.page_size)
        self.dst = self.host.alloc(self.num_pages * args.page_size)
        self.host.kv_buffer.copy_(torch.randn(self.host.kv_buffer.shape, generator=torch.Generator().manual_seed(0)))
        self.get_hash_str, self.round = get_hash_str, 0
        self.keys = self.new_keys()
        self.kvtier_ctrl, self.file_ctrl = self.open_kvtier(), self.open_file()

    def new_keys(self) -> list[str]:
        """Keys of pages no run wrote before (token ids offset by the round)."""
        n = self.num_pages * self.args.page_size
        self.round += 1
        return self.get_hash_str(list(range(self.round * n, (self.round + 1) * n)), None, page_size=self.args.page_size)

    # -- backends ------------------------------------------------------------------------------
    def open_kvtier(self):
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        from kvtier.tiers.disk import record_footprint
        from tests.sglang.conftest import storage_config
        from tests.sglang.sglang_source import controller

        disk_bytes = self.num_pages * record_footprint(self.nbytes // self.num_pages) * 3 // 2
        config = storage_config(self.work_dir / "kvtier", cpu_bytes=self.args.cpu_bytes, disk_bytes=disk_bytes,
                                num_io_threads=2)
        self.kvtier = StorageBackendFactory.create_backend("dynamic", config, self.host)
        self.kvtier.register_mem_pool_host(self.host)
        return controller(self.kvtier, self.host, zero_copy=True)

    def open_file(self):
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        from tests.sglang.conftest import storage_config
        from tests.sglang.sglang_source import controller

        path = self.work_dir / "hicache-file"
        path.mkdir(exist_ok=True)
        self.file = HiCacheFile(storage_config(path, max_size=str(self.nbytes * 3 // 2)), file_path=str(path))
        return controller(self.file, self.host, zero_copy=False)

    # -- the controller's operations -------------------------------------------------------------
    def _batches(self, indices: torch.Tensor):
        ps = self.args.page_size
        for start in range(0, self.num_pages, self.batch):
            keys = self.keys[start : start + self.batch]
            yield keys, indices[start * ps : (start + len(keys)) * ps]

    def put(self, ctrl) -> None:
        for keys, idx in self._batches(self.src):
            assert ctrl.page_set_func(keys, idx), "a put failed"

    def get(self, ctrl) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        op = ctrl.PrefetchOperation("bench", [])
        for keys, idx in self._batches(self.dst):
            assert ctrl.page_get_func(op, keys, idx, HiCacheStorageExtraInfo()) == len(keys), "a get missed"

    def exists(self, backend) -> None:
        for start in range(0, self.num_pages, self.batch):
            keys = self.keys[start : start + self.batch]
            assert backend.batch_exists(keys) == len(keys), "a page is missing"


def run(b: Bench, repeats: int, stat) -> tuple[list[Row], float]:
    def kvtier_put():
        b.put(b.kvtier_ctrl)
        b.kvtier.store.wait_for_writes()

    def new_round():
        b.keys = b.new_keys()

    puts = measure([Case(kvtier_put, new_round), Case(lambda: b.put(b.file_ctrl))], repeats)
    stats = b.kvtier.store.stats
    assert not stats.store_failures, f"kvtier dropped writes: {dict(stats.store_failures)}"
    loaded_before = sum(stats.loaded_blocks.values()), stats.loaded_blocks["DISK"]
    gets = measure([Case(lambda: b.get(b.kvtier_ctrl)), Case(lambda: b.get(b.file_ctrl))], repeats)
    loaded = sum(stats.loaded_blocks.values()) - loaded_before[0]
    from_disk = (stats.loaded_blocks["DISK"] - loaded_before[1]) / loaded
    for ctrl in (b.kvtier_ctrl, b.file_ctrl):  # each backend read the right bytes
        poison_dst(b)
        b.get(ctrl)
        assert equal_pages(b), "pages read back differ"
    exists = measure([Case(lambda: b.exists(b.kvtier)), Case(lambda: b.exists(b.file))], repeats)
    b.kvtier.close()
    file_name = "SGLang HiCacheFile, same pages"
    return [
        Row("put (backup to disk)", puts[0].throughput(b.nbytes, stat), "GB/s", puts[1].throughput(b.nbytes, stat),
            file_name),
        Row("get from disk (into the host pool)", gets[0].throughput(b.nbytes, stat), "GB/s",
            gets[1].throughput(b.nbytes, stat), file_name),
        Row("batch_exists", b.num_pages / exists[0].seconds(stat), "pages/s", b.num_pages / exists[1].seconds(stat),
            file_name),
    ], from_disk


def poison_dst(b: Bench) -> None:
    nan = torch.full_like(b.host.get_dummy_flat_data_page(), float("nan"))
    for d in b.dst[:: b.args.page_size].tolist():
        b.host.set_from_flat_data_page(d, nan)


def equal_pages(b: Bench) -> bool:
    ps = b.args.page_size
    return all(torch.equal(b.host.get_data_page(int(s)), b.host.get_data_page(int(d)))
               for s, d in zip(b.src[::ps], b.dst[::ps]))


def memcpy_gbs(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16).fill_(1)
    dst = torch.empty_like(src).zero_()
    (timing,) = measure([Case(lambda: dst.copy_(src))], repeats=3)
    return timing.throughput(src.numel() * 2, "best")


def main(argv: list[str] | None = None) -> list[Row]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--total-bytes", type=parse_bytes, default=512 << 20, help="bytes of pages (default 512MiB)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16: 2 MiB pages)")
    parser.add_argument("--layout", default="page_first", help="SGLang host layout (--hicache-mem-layout)")
    parser.add_argument("--cpu-bytes", default="32MiB", help="kvtier's CPU pool (default 32MiB: gets come from DISK)")
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[2],
                        help="a temporary directory is made (and removed) in here (default: the repo's parent)")
    args = parser.parse_args(argv)
    threads = apply_threads(args.threads)
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-sglang-bench-", dir=args.dir))
    try:
        b = Bench(args, work_dir)
        rows, from_disk = run(b, args.repeats, args.stat)
        copy = memcpy_gbs(min(b.nbytes, 256 << 20))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    title = (
        f"kvtier SGLang backend vs SGLang HiCacheFile: {b.num_pages} pages x {b.nbytes / b.num_pages / 2**20:.0f} MiB "
        f"({b.nbytes / GB:.2f} GB; {args.layout}, {args.page_size} tokens/page, bf16), {args.stat} of "
        f"{args.repeats} after 1 warm-up; {threads} torch threads; load average {os.getloadavg()[0]:.1f}"
    )
    print_table(title, rows, footnote=(
        f"kvtier gets: {from_disk:.0%} of pages from its DISK tier (the rest from its {args.cpu_bytes} CPU pool); "
        f"both at capacity (1.5x one run's pages): puts evict earlier runs' pages on both sides; no fsync on either side; "
        f"scale: torch copy in memory on this host {copy:.1f} GB/s"))
    write_outputs(args, NAME, rows)
    return rows


if __name__ == "__main__":
    main()
