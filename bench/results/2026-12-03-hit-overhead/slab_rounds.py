"""store() into a full CPU slab with a DISK tier below (bench/transfers.py's case: 128 x 2 MiB blocks,
the slab refilled before each round), round by round: the LMDB data file's size (MiB) after each
round, then each round's GB/s, then best/median of the rounds after the first 5 against a raw
sequential write over a primed file. Usage: TREE=<tree> [R=rounds] python slab_rounds.py"""
import os, time, shutil, statistics
from slab_setup import SPEC, fill, raw, raw_write, root, blocks, store, spill_hashes, n
S, W = [], []
for i in range(int(os.environ.get("R", 12))):
    fill()
    t = time.perf_counter(); assert store.store(spill_hashes, blocks) == n; S.append(time.perf_counter() - t); print(os.path.getsize(store.disk.path / "data.mdb") >> 20, end=" ")
    t = time.perf_counter(); raw_write(raw, blocks, 32); W.append(time.perf_counter() - t)
nb = n * SPEC.block_nbytes
print(" ".join(f"{nb/s/1e9:.1f}" for s in S)); print(f"store into full: best {nb/min(S)/1e9:.2f} GB/s med {nb/statistics.median(S)/1e9:.2f}; raw best {nb/min(W)/1e9:.2f} med {nb/statistics.median(W)/1e9:.2f}; ratio best {min(W)/min(S):.2f} med {statistics.median(W)/statistics.median(S):.2f}")
store.close(); shutil.rmtree(root, ignore_errors=True)
