"""store() into a full CPU slab with a DISK tier below (bench/transfers.py's case: 128 x 2 MiB blocks,
the slab refilled before each round), round by round: the LMDB data file's size (MiB) after each
round, then each round's GB/s, then best/median of the rounds after the first 5 against a raw
sequential write over a primed file. Usage: TREE=<tree> [R=rounds] python slab_rounds.py"""
import os, sys, time, tempfile, shutil, statistics
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from pathlib import Path
import torch
torch.set_num_threads(1)
from bench.transfers import _store, SPEC, NAMESPACE
from bench.common import raw_write, prime_raw_file
from kvtier.hashing import block_hashes_for
root = Path(tempfile.mkdtemp(prefix="slab-", dir="/work"))
n = int(os.environ.get("NB", 128))
hashes = block_hashes_for(list(range(n * 16)), NAMESPACE, 16)
spill_hashes = block_hashes_for(list(range(10**6, 10**6 + n * 16)), NAMESPACE, 16)
blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
store = _store(root / "kv", n, 2)
store.store(hashes, blocks); store.flush()
raw = prime_raw_file(root / "raw.bin", blocks, 32)
def fill():
    store.top.clear(); store.disk.remove(hashes + spill_hashes); store.store(hashes, blocks)
S, W = [], []
for i in range(int(os.environ.get("R", 12))):
    fill()
    t = time.perf_counter(); assert store.store(spill_hashes, blocks) == n; S.append(time.perf_counter() - t); print(os.path.getsize(store.disk.path / "data.mdb") >> 20, end=" ")
    t = time.perf_counter(); raw_write(raw, blocks, 32); W.append(time.perf_counter() - t)
nb = n * SPEC.block_nbytes
print(" ".join(f"{nb/s/1e9:.1f}" for s in S)); print(f"store into full: best {nb/min(S)/1e9:.2f} GB/s med {nb/statistics.median(S)/1e9:.2f}; raw best {nb/min(W)/1e9:.2f} med {nb/statistics.median(W)/1e9:.2f}; ratio best {min(W)/min(S):.2f} med {statistics.median(W)/statistics.median(S):.2f}")
store.close(); shutil.rmtree(root, ignore_errors=True)
