"""bench/tiers.py's store-level DISK rows alone (SECTIONS=store) or after its DISK rows
(SECTIONS=disk,store), to see which state of the raw file makes its write baseline slower."""
import os, shutil, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
import bench.tiers as T
torch.set_num_threads(1)
n = 128
wd = Path(tempfile.mkdtemp(dir="/tmp", prefix="disk3-tiers-"))
src = T.make_blocks(n)
b = T.Bench(n, 32, 32, 3, "best", torch.device("cpu"), wd, src, torch.empty_like(src), torch.empty_like(src))
b.dst.zero_(); b.scratch.zero_()
rows = []
for s in os.environ.get("SECTIONS", "store").split(","):
    rows += {"disk": T.bench_disk, "store": T.bench_store_disk}[s](b)
for r in rows:
    print(f"{r.metric}: {r.value:.2f} vs {r.baseline:.2f} = {r.value / r.baseline:.2f}x load={os.getloadavg()[0]:.2f}")
shutil.rmtree(wd)
