import sys, cProfile, pstats, tempfile, shutil, time
sys.path.insert(0, "/work/wt/disk")
from pathlib import Path
import torch
import bench.tiers as T
from bench.common import Stat
torch.set_num_threads(1)
n = 128
wd = Path(tempfile.mkdtemp(dir="/tmp"))
src = T.make_blocks(n)
b = T.Bench(n, 32, 32, 3, "best", torch.device("cpu"), wd, src, torch.empty_like(src), torch.empty_like(src))
store = b.store(cpu_blocks=n, disk_blocks=2 * n)
disk = store.disk
hashes = b.fresh_chain()
T.put_requests(store, hashes, src, 32, b.fingerprints)
pr = cProfile.Profile()
for i in range(4):
    disk.remove(list(disk.lru_order()))
    hashes = b.fresh_chain()
    t0 = time.perf_counter()
    if i == 3: pr.enable()
    T.put_requests(store, hashes, src, 32, b.fingerprints)
    if i == 3: pr.disable()
    print("spill", round(n * 2 / 1024 / (time.perf_counter() - t0), 2), "GB/s-ish")
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
store.close(); shutil.rmtree(wd)
