"""bench/tiers.py's DISK rows (put over freed pages, warm/cold get, put into a fresh tier) under LMDB flag variants, alternating."""
import sys, os, shutil, tempfile, ctypes
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch, lmdb
from bench import tiers as T
from bench.common import print_table
import kvtier.tiers.disk as D
torch.set_num_threads(1)
N = int(sys.argv[1]); reps = int(sys.argv[2]); variants = sys.argv[3].split(","); rounds = int(sys.argv[4])
orig_open = lmdb.open
FLAGS = {"wm": {}, "nowm": {"writemap": False}}
class L:
    def __getattr__(self, k): return getattr(lmdb, k)
src = T.make_blocks(N)
allrows = {}
for r in range(rounds):
    for v in variants:
        def o(path, **kw):
            if "map_size" in kw and kw.get("writemap"):
                kw.update(FLAGS[v])
            return orig_open(path, **kw)
        lm = L(); lm.open = o; D.lmdb = lm
        wd = Path(tempfile.mkdtemp(prefix="grow-", dir="/tmp/grow"))
        b = T.Bench(N, 32, 32, reps, "median", torch.device("cpu"), wd, src, torch.empty_like(src), torch.empty_like(src))
        b.dst.zero_(); b.scratch.zero_()
        rows = [T.bench_disk_growth(b)] + T.bench_disk(b)
        shutil.rmtree(wd)
        for row in rows:
            allrows.setdefault((row.metric, v), []).append(row.ratio)
for (m, v), rs in allrows.items():
    print(f"{v:6s} {m[:60]:60s} " + " ".join(f"{x:.2f}x" for x in rs))
print("load", os.getloadavg())
