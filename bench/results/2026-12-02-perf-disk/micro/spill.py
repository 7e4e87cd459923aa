"""Store 128 x 2 MiB blocks into a full CPU slab (the spill to DISK) a few rounds, printing
GiB/s per round; with --profile, cProfile of the last round by own time.

    python spill.py TREE [--rounds N] [--profile]   (TREE: the kvtier checkout to import)
"""
import argparse, cProfile, pstats, shutil, sys, tempfile, time
from pathlib import Path

args = argparse.ArgumentParser()
args.add_argument("tree")
args.add_argument("--rounds", type=int, default=4)
args.add_argument("--profile", action="store_true")
opts = args.parse_args()
sys.path.insert(0, opts.tree)
import torch
import bench.tiers as T

torch.set_num_threads(1)
n = 128
wd = Path(tempfile.mkdtemp(dir="/tmp"))
src = T.make_blocks(n)
b = T.Bench(n, 32, 32, 3, "best", torch.device("cpu"), wd, src, torch.empty_like(src), torch.empty_like(src))
store = b.store(cpu_blocks=n, disk_blocks=2 * n)
disk = store.disk
T.put_requests(store, b.fresh_chain(), src, 32, b.fingerprints)
pr = cProfile.Profile()
for i in range(opts.rounds):
    disk.remove(list(disk.lru_order()))
    hashes = b.fresh_chain()
    last = opts.profile and i == opts.rounds - 1
    t0 = time.perf_counter()
    if last:
        pr.enable()
    T.put_requests(store, hashes, src, 32, b.fingerprints)
    if last:
        pr.disable()
    print("spill", round(n * 2 / 1024 / (time.perf_counter() - t0), 2), "GiB/s")
if opts.profile:
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)
store.close()
shutil.rmtree(wd)
