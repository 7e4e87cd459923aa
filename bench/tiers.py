"""Put and get throughput of each kvtier tier on 2 MiB blocks, beside a same-run baseline.

    python bench/tiers.py [--total-bytes 1GiB] [--repeats 3] [--json PATH] [--dir DIR]

Blocks have the Llama-3-8B shape (32 layers, 8 KV heads, head_dim 128, 16 tokens, bf16), so one
block is exactly 2 MiB; every measurement moves ``--total-bytes`` (default 1 GiB = 512 blocks).

Each row is a kvtier path and, beside it, a baseline moving the same bytes in the same chunks
in the same run:

- GPU / CPU put: ``TieredStore.store`` in requests of ``--request-blocks`` into a store whose only
  pool is that tier; after the warm-up the pool is full, so every block also evicts an LRU victim.
  Baseline: torch ``dst.copy_(src)`` on the same devices.
- GPU / CPU get: ``TieredStore.load`` + gather of ``top.tensor[block_ids]`` into a preallocated
  tensor (the work an engine's gather does; see :func:`gather`) + ``lease.release()``.
  Baseline: torch copy.
- CPU -> GPU promotion: ``load`` of blocks held only in the CPU slab under a GPU pool (H2D on
  CUDA). Baseline: torch copy from a (pinned) host tensor to the pool's device.
- DISK put / get: ``DiskTier.write_batch`` in batches of ``--disk-batch``; ``DiskTier.read_into``
  per block, page cache warm. Baselines: a raw sequential write of the same bytes over a file
  written just before (cached pages overwritten in place; no fsync for either, as LMDB runs with
  ``sync=False``; :data:`bench.common.RAW_WRITE_NOTE`, the same as bench/transfers.py's) and a
  ``readinto`` of that file into a preallocated tensor.
- DISK put into a fresh tier: ``DiskTier.write_batch`` as above into a tier opened on a new
  directory before each run, so every record goes into pages LMDB has never used (its file
  grows into the map: the case of a DISK tier filling up, or a daemon taking its first puts).
  Baseline: a raw sequential write of the same bytes into a new file (the previous run's
  file deleted first, as the previous run's tier directory is).
- DISK get, page cache dropped: the tier closed, its files dropped from the page cache
  (``--drop-caches``), reopened, then read as above. Baseline: ``readinto`` of the raw file
  after the same drop. The footnote says how much of the bytes came from storage.
- DISK open (``--open-bytes``, e.g. 8GiB; skipped by default): :mod:`bench.disk_open`.
- DISK spill / DISK -> CPU promotion (store level): ``store`` into a full CPU slab whose LRU
  victims spill to DISK; ``load`` of blocks held only on DISK. Baselines: raw write / raw read.
  The spill also runs beside its floor (:class:`StoreFloor`: the two copies and the hash a
  verified store into a full slab makes, in numpy, no kvtier), timed in the same rounds: a
  row for the floor against the raw write (what that work reaches on this machine: measured,
  not a proven bound) and one for kvtier against the floor.

Where there is no CUDA the GPU pool sits in host memory (``emulate_gpu``: the store itself
builds no GPU pool without CUDA), so GPU rows are host copies there. Case and baseline run interleaved after one warm-up round
(:func:`bench.common.measure`); the table reports the best (or ``--stat median``) run.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script (python bench/tiers.py): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import Case, Row, raw_read, raw_write, Stat, apply_threads, arg_parser, measure, print_table, write_outputs  # noqa: E402
from bench.common import RAW_WRITE_BASELINE, RAW_WRITE_NOTE, MappedFile, disk_warmup_rounds, drop_page_cache, io_read_bytes, prime_raw_file  # noqa: E402
from bench.disk_open import open_rows  # noqa: E402
from kvtier.config import StoreConfig, parse_bytes  # noqa: E402
from kvtier.hashing import KeyContext  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.tiers.disk import DiskTier, ReadStatus, record_footprint  # noqa: E402
from kvtier.types import BlockHash, KVSpec, Medium  # noqa: E402

NAME = "tiers"
SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
assert SPEC.block_nbytes == 2 << 20, "the bench is specified on 2 MiB blocks"
NAMESPACE = KeyContext(model_id="kvtier-bench", dtype="bfloat16", block_size=SPEC.block_size).namespace()
LMCACHE_NOTE = (
    "LMCache 0.5.6 reference (the project's design figures; same machine class, 2 MiB blocks, vs a 16.8 GB/s torch "
    "copy in its run): CPU put 0.73x, CPU get 0.87x of copy; DISK put 1.09 GB/s; DISK get from "
    "page cache 7.35 GB/s = 0.44x of copy."
)


@dataclass
class Bench:
    """What every section needs: sizes, buffers, where files go, how to time."""

    num_blocks: int
    request_blocks: int
    disk_batch: int
    repeats: int
    stat: Stat
    device: torch.device  # of the GPU pool
    work_dir: Path
    src: torch.Tensor  # [num_blocks, *SPEC.block_shape] host: the blocks every put writes
    dst: torch.Tensor  # same shape, host: where every get lands
    scratch: torch.Tensor  # same shape, host: the baselines' pool stand-in

    system_drop: bool = False  # page-cache drops also via /proc/sys/vm/drop_caches

    def __post_init__(self) -> None:
        self.notes: list[str] = []  # printed under the table
        self._chains = itertools.count()
        self.fingerprints: dict[BlockHash, bytes] = {}  # each hash's token fingerprint (made up, 32 bytes)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * SPEC.block_nbytes

    def fresh_chain(self) -> list[BlockHash]:
        """``num_blocks`` block hashes never used before in this run."""
        tag = next(self._chains)
        hashes = [BlockHash(hashlib.sha256(f"{tag}:{i}".encode()).digest()) for i in range(self.num_blocks)]
        self.fingerprints.update((h, hashlib.sha256(b"fingerprint" + h).digest()) for h in hashes)
        return hashes

    def sync(self) -> Callable[[], None] | None:
        """What :func:`measure` must call to count queued device work."""
        return torch.cuda.synchronize if self.device.type == "cuda" else None

    def sample(self) -> list[int]:
        """A few block indices to verify (first, last and some between): a full compare of
        1 GiB costs more than the bench on a busy 2-core machine."""
        n = self.num_blocks
        return sorted({0, n // 3, n // 2, (2 * n) // 3, n - 1})

    def poison(self, dst: torch.Tensor) -> None:
        """Zero the sampled blocks of ``dst`` (untimed), so a run that skips them is caught."""
        for i in self.sample():
            dst[i].zero_()

    def check(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        """The sampled blocks of ``got`` equal those of ``want``."""
        for i in self.sample():
            if not torch.equal(got[i], want[i].to(got.device)):
                raise RuntimeError(f"{what}: block {i} read back differs from the block written")

    def check_store(self, store: TieredStore, hashes: list[BlockHash], what: str) -> None:
        """The sampled blocks of ``hashes`` load from ``store`` with the bytes of ``src``."""
        for i in self.sample():
            result = store.load([hashes[i]], fingerprints=[self.fingerprints[hashes[i]]])
            with result.lease:
                assert result.block_ids, f"{what}: block {i} is no longer stored"
                got = store.top.tensor[result.block_ids[0]]
                if not torch.equal(got, self.src[i].to(got.device)):
                    raise RuntimeError(f"{what}: block {i} read back differs from the block written")

    def row(self, metric: str, value: Case, baseline: Case, baseline_name: str) -> Row:
        """Time ``value`` and ``baseline`` interleaved into one GB/s row. The baseline runs
        first in each round, so what ``value`` wrote last is still there to check."""
        baseline, value = measure([baseline, value], self.repeats, sync=self.sync())
        return Row(
            metric, value.throughput(self.nbytes, self.stat), "GB/s",
            baseline.throughput(self.nbytes, self.stat), baseline_name,
        )

    def store(self, gpu_blocks: int = 0, cpu_blocks: int = 0, disk_blocks: int = 0) -> TieredStore:
        """A store with the given capacities (blocks), its files under ``work_dir``."""
        disk_bytes = disk_blocks * record_footprint(SPEC.block_nbytes) + (1 << 20) if disk_blocks else 0
        config = StoreConfig(
            gpu_bytes=gpu_blocks * SPEC.block_nbytes, cpu_bytes=cpu_blocks * SPEC.block_nbytes,
            disk_bytes=disk_bytes, block_size=SPEC.block_size, data_dir=self.work_dir / "store",
            flush_on_close=False,
        )
        return TieredStore(SPEC, config, NAMESPACE, device=self.device, emulate_gpu=True)


# -- building blocks -------------------------------------------------------------------------
def make_blocks(num_blocks: int, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
    """``[num_blocks, *SPEC.block_shape]`` random, non-zero, pairwise different blocks (one
    random block tiled, then a random head per block: fast to make, touches every page)."""
    out = torch.empty((num_blocks, *SPEC.block_shape), dtype=SPEC.dtype, device=device, pin_memory=pin_memory)
    g = torch.Generator().manual_seed(0)
    out.copy_(torch.randn(SPEC.block_shape, generator=g).to(SPEC.dtype).to(device).expand_as(out))
    out.view(num_blocks, -1)[:, :1024] = torch.randn(num_blocks, 1024, generator=g).to(SPEC.dtype).to(device)
    return out


def copy_chunks(dst: torch.Tensor, src: torch.Tensor, chunk: int) -> None:
    """The baseline: ``dst[i:i+chunk].copy_(src[i:i+chunk])`` over dim 0."""
    for i in range(0, src.shape[0], chunk):
        dst[i : i + chunk].copy_(src[i : i + chunk], non_blocking=True)


def put_requests(
    store: TieredStore, hashes: list[BlockHash], blocks: torch.Tensor, chunk: int, fingerprints: dict
) -> None:
    """``store`` each request with its blocks' fingerprints (as a connector does)."""
    for i in range(0, len(hashes), chunk):
        part = hashes[i : i + chunk]
        stored = store.store(part, blocks[i : i + chunk], [fingerprints[h] for h in part])
        assert stored == len(hashes[i : i + chunk]), f"store() kept {stored} of {chunk} blocks"


def load_requests(
    store: TieredStore, hashes: list[BlockHash], chunk: int, fingerprints: dict, dst: torch.Tensor | None = None
) -> None:
    """``load`` each request (checking its fingerprints, as a connector does), gather its
    blocks into ``dst`` (when given), release the lease."""
    for i in range(0, len(hashes), chunk):
        part = hashes[i : i + chunk]
        result = store.load(part, fingerprints=[fingerprints[h] for h in part])
        assert len(result.block_ids) == len(hashes[i : i + chunk]), "load() missed a stored block"
        if dst is not None:
            gather(store.top.tensor, result.block_ids, dst[i : i + chunk])
        result.lease.release()


def gather(pool: torch.Tensor, block_ids: list[int], out: torch.Tensor) -> None:
    """``out[k] = pool[block_ids[k]]``: one ``index_select`` on a device; on the CPU one copy per
    run of consecutive ids (``index_select`` there copies row by row, one parallel region per
    2 MiB row, which costs a scheduler slice per row when other jobs hold the cores)."""
    if pool.device.type != "cpu":
        torch.index_select(pool, 0, torch.tensor(block_ids, dtype=torch.int64, device=pool.device), out=out)
        return
    start = 0
    for k in range(1, len(block_ids) + 1):
        if k == len(block_ids) or block_ids[k] != block_ids[k - 1] + 1:
            first = block_ids[start]
            out[start:k].copy_(pool[first : first + k - start])
            start = k




# -- sections --------------------------------------------------------------------------------
def bench_pool(b: Bench, medium: Medium) -> list[Row]:
    """Put and get of a store whose only pool is ``medium`` (``disk_bytes=0``)."""
    device = b.device if medium is Medium.GPU else torch.device("cpu")
    if device.type == "cpu":
        src, dst, scratch = b.src, b.dst, b.scratch
    else:
        src = b.src.to(device)
        dst, scratch = torch.empty_like(src), torch.empty_like(src)
    store = b.store(gpu_blocks=b.num_blocks) if medium is Medium.GPU else b.store(cpu_blocks=b.num_blocks)
    R, state, copy_name = b.request_blocks, {}, f"torch copy on {device}"
    try:
        put = Case(lambda: put_requests(store, state["hashes"], src, R, b.fingerprints),
                   lambda: state.update(hashes=b.fresh_chain()))
        rows = [b.row(f"{medium} put: store(), pool full (LRU evicts)", put,
                      Case(lambda: copy_chunks(scratch, src, R)), copy_name)]
        b.check_store(store, state["hashes"], f"{medium} put")
        get = Case(lambda: load_requests(store, state["hashes"], R, b.fingerprints, dst), lambda: b.poison(dst))
        rows.append(b.row(f"{medium} get: load() + gather + release", get,
                          Case(lambda: copy_chunks(dst, scratch, R)), copy_name))
        b.check(dst, src, f"{medium} get")
        return rows
    finally:
        store.close()


def bench_promotion_to_gpu(b: Bench) -> Row:
    """``load`` of blocks held only in the CPU slab under a GPU pool (H2D copies on CUDA)."""
    cuda = b.device.type == "cuda"
    store = b.store(gpu_blocks=b.num_blocks, cpu_blocks=2 * b.num_blocks)
    host = make_blocks(b.num_blocks, pin_memory=True) if cuda else b.src  # the baseline's slab
    pool = torch.empty_like(b.scratch, device=b.device) if cuda else b.scratch
    try:
        chains = [b.fresh_chain(), b.fresh_chain()]
        for hashes in chains:  # the second store spills the first chain to the CPU slab
            put_requests(store, hashes, b.src, b.request_blocks, b.fingerprints)
        turn = itertools.count()  # warm-up loads chain 0 (spilling chain 1), then they alternate
        promote = Case(lambda: load_requests(store, chains[next(turn) % 2], b.request_blocks, b.fingerprints))
        row = b.row("CPU -> GPU promotion: load()" + (" (H2D)" if cuda else ""), promote,
                    Case(lambda: copy_chunks(pool, host, b.request_blocks)),
                    "H2D torch copy, pinned" if cuda else "torch copy on cpu")
        assert store.stats.loaded_blocks[Medium.CPU] >= b.num_blocks * (b.repeats + 1), "a load skipped the slab"
        b.check_store(store, chains[next(turn) % 2], "CPU -> GPU promotion")
        return row
    finally:
        store.close()


def bench_disk(b: Bench) -> list[Row]:
    """``DiskTier.write_batch`` / ``read_into`` against a raw file of the same bytes."""
    disk = DiskTier(b.work_dir / "disk", b.num_blocks * record_footprint(SPEC.block_nbytes))
    raw_path, B, state = b.work_dir / "raw.bin", b.disk_batch, {"hashes": []}

    def before_put() -> None:  # drop the previous run's records: their pages are reused
        disk.remove(state["hashes"])
        state["hashes"] = b.fresh_chain()

    def put() -> None:
        hashes = state["hashes"]
        for i in range(0, b.num_blocks, B):
            fps = b.fingerprints
            batch = range(i, min(i + B, b.num_blocks))
            ok = disk.write_batch([(hashes[j], NAMESPACE, b.src[j], fps[hashes[j]]) for j in batch])
            assert all(ok), "DISK write_batch refused a block"

    def get() -> None:
        for j, h in enumerate(state["hashes"]):
            assert disk.read_into(h, NAMESPACE, b.dst[j], b.fingerprints[h]) is ReadStatus.OK, "DISK read failed"

    def drop_disk() -> None:  # closed (LMDB's mapped pages stay cached), dropped, reopened
        nonlocal disk
        b.poison(b.dst)
        capacity = disk.capacity_bytes
        disk.close()
        drop_page_cache([b.work_dir / "disk"], b.system_drop)
        disk = DiskTier(b.work_dir / "disk", capacity)
        state["read_bytes"] = io_read_bytes()

    def cold_get() -> None:
        get()
        state["cold_read"] = io_read_bytes() - state["read_bytes"]

    try:
        prime_raw_file(raw_path, b.src, B)
        rows = [b.row(f"DISK put: write_batch({B})", Case(put, before_put),
                      Case(lambda: raw_write(raw_path, b.src, B)), RAW_WRITE_BASELINE)]
        rows.append(b.row("DISK get: read_into, page cache warm", Case(get, lambda: b.poison(b.dst)),
                          Case(lambda: raw_read(raw_path, b.dst, B)), "raw file readinto"))
        b.check(b.dst, b.src, "DISK get")
        rows.append(b.row("DISK get: read_into, page cache dropped", Case(cold_get, drop_disk),
                          Case(lambda: raw_read(raw_path, b.dst, B), lambda: drop_page_cache([raw_path], b.system_drop)),
                          "raw file readinto, page cache dropped"))
        b.check(b.dst, b.src, "DISK get, page cache dropped")
        b.notes.append(f"DISK get, page cache dropped: the last run read {state['cold_read'] / b.nbytes:.0%} of its "
                       "bytes from storage (/proc/self/io read_bytes; ~100% means the drop worked)")
        return rows
    finally:
        disk.close()


def bench_disk_growth(b: Bench) -> Row:
    """``DiskTier.write_batch`` into a fresh tier (LMDB growing its file) against a raw
    write into a fresh file; each run's tier directory and file are new (the previous ones
    removed before it, untimed)."""
    capacity, B = b.num_blocks * record_footprint(SPEC.block_nbytes), b.disk_batch
    raw_path, runs = b.work_dir / "raw-fresh.bin", itertools.count()
    state: dict = {"disk": None, "dir": None}

    def fresh_tier() -> None:
        if state["disk"] is not None:
            state["disk"].close()
            shutil.rmtree(state["dir"])
        state["dir"] = b.work_dir / f"fresh-{next(runs)}"
        state["disk"], state["hashes"] = DiskTier(state["dir"], capacity), b.fresh_chain()

    def put() -> None:
        disk, hashes, fps = state["disk"], state["hashes"], b.fingerprints
        for i in range(0, b.num_blocks, B):
            batch = range(i, min(i + B, b.num_blocks))
            ok = disk.write_batch([(hashes[j], NAMESPACE, b.src[j], fps[hashes[j]]) for j in batch])
            assert all(ok), "DISK write_batch refused a block"

    try:
        row = b.row(f"DISK put into a fresh tier: write_batch({B}), LMDB file growing", Case(put, fresh_tier),
                    Case(lambda: raw_write(raw_path, b.src, B), lambda: raw_path.unlink(missing_ok=True)),
                    "raw write into a fresh file, no fsync")
        for i in b.sample():
            h = state["hashes"][i]
            status = state["disk"].read_into(h, NAMESPACE, b.dst[i], b.fingerprints[h])
            assert status is ReadStatus.OK, "DISK read failed"
        b.check(b.dst, b.src, "DISK put into a fresh tier")
        return row
    finally:
        if state["disk"] is not None:
            state["disk"].close()
        raw_path.unlink(missing_ok=True)


class StoreFloor:
    """The least work of a verified store into a full CPU slab, without kvtier: for each
    block, one copy of the victim in its slot into a ``MAP_SHARED`` mapping of a cached file
    (LMDB's copy into its map; the record's checksum needs no pass over the victim: its
    payload digest was taken when it was copied in, ``kvtier.records`` version 3), then the new
    block copied into the victim's slot, hashed on the way (xxh3 of each 512 KiB piece, then
    the piece copied from cache: kvtier's ``copy_hashed``, the digest its spill will use):
    numpy and xxhash calls only, no index, no LRU, no LMDB. The file is mapped as LMDB maps its
    data file (a sparse file, ``MADV_HUGEPAGE``: :func:`kvtier.tiers.disk.advise_huge_pages`;
    without the advice, pages the kernel has written back fault again on each 4 KiB write and
    the floor ran slower than kvtier). GB/s are bytes of the blocks stored per second. Its
    ratio to a raw write is what this implementation of the work reaches on the machine, not
    a proven bound (issue 17's goal is 0.7x): a raw write copies each byte once, a store into
    a full slab twice and hashes it once.

    ``threads``: the blocks split in that many contiguous parts, one per thread (numpy's
    copies and xxhash release the GIL). kvtier's DISK writes of blocks >= 640 KiB use two
    threads (the caller's and the tier's writer: ``kvtier.tiers.disk._WriteOverlap``), so
    the benches compare them with the two-thread floor."""

    WHAT = "copy to a mapped file + copy in, hashed (numpy)"
    WHAT_SPILL = "copy to a mapped file (numpy)"
    PIECE_NBYTES = 512 << 10

    def __init__(self, path: Path, src: torch.Tensor, copy_in: bool = True, threads: int = 2) -> None:
        """``src``: ``[n, ...]`` host blocks, the new ones; ``copy_in=False``: the spill alone
        (evicting a full slab: :data:`WHAT_SPILL`), the slab keeps its blocks."""
        from concurrent.futures import ThreadPoolExecutor

        import xxhash

        from kvtier.tiers.host_memory import host_empty

        self.n, self.block_nbytes, self.copy_in = src.shape[0], src[0].numel() * src.element_size(), copy_in
        nbytes = self.n * self.block_nbytes
        self.src = src.view(torch.uint8).reshape(self.n, -1).numpy()
        self.slab = host_empty(nbytes).view(self.n, -1).numpy()  # as the CPU pool's slab
        self.slab[:] = self.src[::-1]  # victims (the first run's; later runs copy the same bytes again)
        self.digests = [xxhash.xxh3_64_intdigest(block) for block in self.slab]  # each slot's, as kvtier keeps
        self.spilled = [0] * self.n  # the digest each spilled copy's record carries
        self._file = MappedFile(path, nbytes)  # sparse and advised, as LMDB's data file
        self.out = self._file.array.reshape(self.n, -1)
        self.out[:] = 0xA5  # every page in the page cache, mapped and dirty once, untimed;
        # and not the victims' bytes, so that check() sees a spill that never copied
        self.threads = max(1, threads)
        cuts = [self.n * k // self.threads for k in range(self.threads + 1)]
        self._parts = list(zip(cuts, cuts[1:]))
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None

    @property
    def what(self) -> str:
        """The floor's row label: :data:`WHAT` or :data:`WHAT_SPILL`, with its threads."""
        return f"{self.WHAT if self.copy_in else self.WHAT_SPILL}, {self.threads} thread{'s' * (self.threads > 1)}"

    def run(self) -> None:
        futures = [self._pool.submit(self._run, lo, hi) for lo, hi in self._parts[1:]] if self._pool else []
        self._run(*self._parts[0])
        for future in futures:
            future.result()

    def _run(self, lo: int, hi: int) -> None:
        import numpy as np
        import xxhash

        piece = self.PIECE_NBYTES
        for i in range(lo, hi):
            victim = self.slab[i]
            np.copyto(self.out[i], victim)  # the spill: LMDB's one copy into its map
            self.spilled[i] = self.digests[i]  # its record's checksum: from the digest, no pass over the bytes
            if self.copy_in:  # the new block into the freed slot, hashed on the way
                src, digest = self.src[i], xxhash.xxh3_64()
                for start in range(0, src.size, piece):
                    digest.update(src[start : start + piece])
                    np.copyto(victim[start : start + piece], src[start : start + piece])
                self.digests[i] = digest.intdigest()

    def check(self) -> None:
        """The last run's slab holds the new blocks (the victims without ``copy_in``), each
        hashing to the digest recorded for its slot, and each block of the file hashes to
        the digest its victim had (the file starts as other bytes, so a spill that never
        copied fails here)."""
        import xxhash

        assert (self.slab == (self.src if self.copy_in else self.src[::-1])).all(), "floor: the slab is not as run"
        assert all(xxhash.xxh3_64_intdigest(self.slab[i]) == self.digests[i] for i in range(self.n)), \
            "floor: a slot's digest is not its bytes'"
        assert all(xxhash.xxh3_64_intdigest(self.out[i]) == self.spilled[i] for i in range(self.n)), \
            "floor: a spilled copy differs from the victim's digest"

    def close(self) -> None:
        """Unmap and delete the file; stop the threads."""
        if self._pool is not None:
            self._pool.shutdown()
        del self.out
        self._file.close()


def floor_rows(what: str, vs: str, kvtier_gbs: float, floor_gbs: float, raw_gbs: float) -> tuple[list[Row], str]:
    """The two rows a kvtier row gets beside its :class:`StoreFloor` (GB/s): ``what`` (the
    floor's metric) against the raw write, ``vs`` (kvtier's metric) against the floor; and a
    warning for the table's notes ("" unless kvtier ran faster than its floor, which means the
    floor paid for something kvtier did not)."""
    rows = [Row(what, floor_gbs, "GB/s", raw_gbs, RAW_WRITE_BASELINE),
            Row(vs, kvtier_gbs, "GB/s", floor_gbs, "the floor above, same run")]
    warning = "" if kvtier_gbs <= floor_gbs else (
        f"warning: {vs.strip()}: kvtier ran faster than its floor ({kvtier_gbs:.2f} vs {floor_gbs:.2f} GB/s): the "
        "floor paid for something kvtier did not (page faults after writeback?)")
    return rows, warning


def bench_store_disk(b: Bench) -> list[Row]:
    """Store-level DISK paths: spill (store into a full CPU slab) and promotion (DISK -> CPU)."""
    store = b.store(cpu_blocks=b.num_blocks, disk_blocks=2 * b.num_blocks)
    disk, R = store.disk, b.request_blocks
    # its own raw file, written just before: tiers' raw.bin was dropped from the page cache by
    # the cold-read row, and the write baselines overwrite cached pages (RAW_WRITE_NOTE)
    raw_path = prime_raw_file(b.work_dir / "raw-spill.bin", b.src, b.disk_batch)
    assert disk is not None
    try:
        state = {"hashes": b.fresh_chain()}
        put_requests(store, state["hashes"], b.src, R, b.fingerprints)  # fill the slab: every later store spills

        def before_spill() -> None:  # empty DISK, so the previous chain's spill always fits
            disk.remove(list(disk.lru_order()))
            state["prev"], state["hashes"] = state["hashes"], b.fresh_chain()

        spill = Case(lambda: put_requests(store, state["hashes"], b.src, R, b.fingerprints), before_spill)
        floor = StoreFloor(b.work_dir / "floor.bin", b.src)
        try:
            raw, least, kvtier = measure(
                [Case(lambda: raw_write(raw_path, b.src, b.disk_batch)), Case(floor.run), spill], b.repeats,
                warmup=disk_warmup_rounds(disk, b.nbytes), sync=b.sync())  # LMDB's map primed as the raw file
            floor.check()
        finally:
            floor.close()
        spilled, lowest = kvtier.throughput(b.nbytes, b.stat), least.throughput(b.nbytes, b.stat)
        raw_gbs = raw.throughput(b.nbytes, b.stat)
        beside, warning = floor_rows(f"  floor of that store: {floor.what}",
                                     "  DISK spill: store() into full CPU slab, vs its floor", spilled, lowest, raw_gbs)
        rows = [Row("DISK spill: store() into full CPU slab", spilled, "GB/s", raw_gbs, RAW_WRITE_BASELINE), *beside]
        if warning:
            b.notes.append(warning)
        # DISK holds the chain before the last, the slab the last: loading them in turn promotes
        # from DISK only (the warm-up load also spills the last chain, which is not on DISK yet).
        chains, turn = [state["prev"], state["hashes"]], itertools.count()
        promote = Case(lambda: load_requests(store, chains[next(turn) % 2], R, b.fingerprints))
        rows.append(b.row("DISK -> CPU promotion: load()", promote,
                          Case(lambda: raw_read(raw_path, b.dst, b.disk_batch)), "raw file readinto"))
        assert store.stats.loaded_blocks[Medium.DISK] >= b.num_blocks * (b.repeats + 1), "a load skipped DISK"
        b.check_store(store, chains[next(turn) % 2], "DISK -> CPU promotion")
        return rows
    finally:
        store.close()


# -- report ----------------------------------------------------------------------------------
def lmcache_terms(rows: list[Row]) -> str:
    """kvtier's rows restated in the terms of the LMCache 0.5.6 numbers (LMCACHE_NOTE)."""
    by = {r.metric.split(":")[0]: r for r in rows if "page cache dropped" not in r.metric}
    cpu_put, cpu_get = by.get("CPU put"), by.get("CPU get")
    disk_put, disk_get = by.get("DISK put"), by.get("DISK get")
    if not (cpu_put and cpu_get and disk_put and disk_get and cpu_get.baseline):
        return ""
    return (
        f"kvtier, this run, same terms: CPU put {cpu_put.ratio:.2f}x, CPU get {cpu_get.ratio:.2f}x of "
        f"copy; DISK put {disk_put.value:.2f} GB/s; DISK get {disk_get.value:.2f} GB/s = "
        f"{disk_get.value / cpu_get.baseline:.2f}x of this run's CPU torch copy ({cpu_get.baseline:.2f} GB/s)."
    )


def main(argv: list[str] | None = None) -> list[Row]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--total-bytes", type=parse_bytes, default=1 << 30,
                        help="bytes moved per measurement, e.g. 1GiB (default); a multiple of 2 MiB")
    parser.add_argument("--request-blocks", type=int, default=32, help="blocks per store()/load() request")
    parser.add_argument("--disk-batch", type=int, default=32, help="blocks per DiskTier.write_batch")
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[2],
                        help="a temporary directory is made (and removed) in here (default: the repo's parent)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device of the GPU pool (default cuda when available, else cpu)")
    parser.add_argument("--open-bytes", type=parse_bytes, default=0,
                        help="also time opening a DISK tier holding this many bytes of records after a page-cache "
                        "drop, e.g. 8GiB (written under --dir, removed after; default 0: skipped)")
    parser.add_argument("--drop-caches", choices=("files", "system"), default="files",
                        help="page-cache drop: fadvise(DONTNEED) on the bench's files (default), or also "
                        "echo 3 > /proc/sys/vm/drop_caches (root; the whole machine's cache)")
    args = parser.parse_args(argv)
    num_blocks = args.total_bytes // SPEC.block_nbytes
    if num_blocks < 1 or args.total_bytes % SPEC.block_nbytes:
        parser.error(f"expected --total-bytes a positive multiple of {SPEC.block_nbytes}, got {args.total_bytes}")
    if min(args.request_blocks, args.disk_batch, args.repeats, args.threads or 1) < 1:
        parser.error("expected --request-blocks, --disk-batch, --repeats and --threads >= 1")
    device = torch.device(args.device)
    threads = apply_threads(args.threads)
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir))
    try:
        src = make_blocks(num_blocks)
        b = Bench(num_blocks, args.request_blocks, args.disk_batch, args.repeats, args.stat, device,
                  work_dir, src, torch.empty_like(src), torch.empty_like(src), args.drop_caches == "system")
        b.dst.zero_()  # first-touch its pages before anything is timed
        b.scratch.zero_()
        rows = bench_pool(b, Medium.GPU) + bench_pool(b, Medium.CPU)
        gc.collect()
        rows.append(bench_promotion_to_gpu(b))
        gc.collect()
        rows += bench_disk(b)
        rows.append(bench_disk_growth(b))
        rows += bench_store_disk(b)
        if args.open_bytes:
            rows += open_rows(work_dir, src, args.open_bytes, NAMESPACE, args.repeats, args.stat, b.system_drop)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    title = (
        f"kvtier tiers: {num_blocks} x 2 MiB blocks ({b.nbytes / 1e9:.2f} GB) per measurement, "
        f"{args.stat} of {args.repeats} after 1 warm-up; GPU pool on {device}; {threads} torch threads; "
        "DISK: LMDB sync=False vs raw file without fsync, page cache warm unless said"
    )
    print_table(title, rows, footnote="\n".join(filter(None, [LMCACHE_NOTE, lmcache_terms(rows), *b.notes, RAW_WRITE_NOTE])))
    write_outputs(args, NAME, rows)
    return rows


if __name__ == "__main__":
    main()
