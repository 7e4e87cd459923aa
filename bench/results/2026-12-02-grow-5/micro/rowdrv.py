"""Only the DISK rows of bench/tiers.py that write: put over freed pages, put into a fresh tier."""
import sys, os, shutil, tempfile
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from bench import tiers as T
from bench.common import print_table
torch.set_num_threads(1)
N = int(sys.argv[1]); reps = int(sys.argv[2])
wd = Path(tempfile.mkdtemp(prefix="grow-", dir="/tmp/grow"))
src = T.make_blocks(N)
b = T.Bench(N, 32, 32, reps, "median", torch.device("cpu"), wd, src, torch.empty_like(src), torch.empty_like(src))
b.dst.zero_(); b.scratch.zero_()
rows = [T.bench_disk_growth(b)]
shutil.rmtree(wd)
print_table(f"{N} blocks, median of {reps}", rows)
print("load", os.getloadavg())
