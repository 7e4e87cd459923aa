"""A/B of the overlapped DISK write (kvtier.tiers.disk._WriteOverlap) in one process: store()
into a full CPU slab and the spill of a full slab, with the overlap on (blocks >= 1 MiB) and
off (OVERLAP_MIN_NBYTES raised past the block), interleaved in the same rounds as a raw
sequential write of the same bytes (bench/transfers.py's store). Prints each as GB/s and its
ratio to the raw write, best and median of the rounds.

    python bench/results/2026-12-02-overlap/micro/ab_store.py [MiB] [rounds] [layers] [min_nbytes]

``layers``: the blocks' layers (default 32: 2 MiB blocks of bench/transfers.py's Llama-8B-like
spec; 11 gives SmolLM2-sized blocks of 704 KiB); ``min_nbytes``: OVERLAP_MIN_NBYTES for "on"
(default the shipped one).
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

torch.set_num_threads(1)

import kvtier.tiers.disk as disk  # noqa: E402
from bench.common import prime_raw_file, raw_write  # noqa: E402
import bench.transfers as transfers  # noqa: E402
from bench.transfers import NAMESPACE, _store  # noqa: E402
from kvtier.hashing import block_hashes_for  # noqa: E402

mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
if len(sys.argv) > 3:
    transfers.SPEC = transfers.SPEC._replace(num_layers=int(sys.argv[3])) if hasattr(transfers.SPEC, "_replace") else \
        type(transfers.SPEC)(**{**transfers.SPEC.__dict__, "num_layers": int(sys.argv[3])})
if len(sys.argv) > 4:
    disk.OVERLAP_MIN_NBYTES = int(sys.argv[4])
SPEC = transfers.SPEC
root = Path(tempfile.mkdtemp(dir="/tmp"))
n = (mib << 20) // SPEC.block_nbytes
hashes = block_hashes_for(list(range(n * 16)), NAMESPACE, 16)
other = block_hashes_for(list(range(10**6, 10**6 + n * 16)), NAMESPACE, 16)
blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
store = _store(root / "kv", n, 2)
raw = prime_raw_file(root / "raw.bin", blocks, 32)
on, off = disk.OVERLAP_MIN_NBYTES, 1 << 62


def fill() -> None:
    store.top.clear()
    store.disk.remove(hashes + other)
    store.store(hashes, blocks)


def store_full() -> None:
    assert store.store(other, blocks) == n


def spill() -> None:
    with store.residency.lock:
        store.placement.make_room(0, n)


cases = {
    "store on": (fill, store_full, on), "store off": (fill, store_full, off),
    "spill on": (fill, spill, on), "spill off": (fill, spill, off), "raw write": (None, lambda: raw_write(raw, blocks, 32), on),
}
times: dict[str, list[float]] = {k: [] for k in cases}
for r in range(rounds + 1):
    for name, (before, fn, threshold) in cases.items():
        if before is not None:
            before()
        disk.OVERLAP_MIN_NBYTES = threshold
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if r:
            times[name].append(dt)
    if "store" in cases:
        got = store.top.tensor[store.top.block_id(other[5])]
        assert torch.equal(got, blocks[5]), "a refilled slot holds other bytes"
disk.OVERLAP_MIN_NBYTES = on
store.disk.check()
nbytes = n * SPEC.block_nbytes
raw_best, raw_med = min(times["raw write"]), statistics.median(times["raw write"])
print(f"{mib} MiB, {n} blocks of {SPEC.block_nbytes >> 10} KiB, {rounds} rounds; raw write {nbytes / raw_best / 1e9:.2f} GB/s best")
for name, ts in times.items():
    b, m = min(ts), statistics.median(ts)
    print(f"{name:10s} best {nbytes / b / 1e9:5.2f} GB/s = {raw_best / b:.2f}x raw   median {nbytes / m / 1e9:5.2f} GB/s = {raw_med / m:.2f}x raw")
store.close()

# every record the rounds left on DISK reads back verified, with the bytes stored
from kvtier.records import ReadStatus  # noqa: E402

store = _store(root / "kv", n, 2)  # reopened: the index and the records as a restart sees them
out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
checked = 0
for hs in (hashes, other):
    for i, h in enumerate(hs):
        if h in store.disk:
            status = store.disk.read_into(h, NAMESPACE, out)
            assert status is ReadStatus.OK and torch.equal(out, blocks[i]), (status, i)
            checked += 1
print(f"{checked} records read back verified and equal")
store.close()
