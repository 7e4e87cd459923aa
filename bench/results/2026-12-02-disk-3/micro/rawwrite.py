"""bench.common.raw_write of 256 MiB in three states of the target file: cached pages
overwritten (transfers.py's baseline), the file dropped from the page cache first (tiers.py's
after its cold-read row), and a new file (truncated first)."""
import os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
from bench.common import raw_write, drop_page_cache
blocks = torch.randn((128, 1 << 20)).to(torch.bfloat16)
p = Path("/tmp/disk3-rawwrite.bin"); raw_write(p, blocks, 32)
def cached(): pass
def dropped(): drop_page_cache([p])
def new(): p.unlink()
for r in range(int(os.environ.get("REPS", 4))):
    out = []
    for name, before in (("cached", cached), ("dropped", dropped), ("new", new)):
        before(); t0 = time.perf_counter(); raw_write(p, blocks, 32); t = time.perf_counter() - t0
        out.append(f"{name}={blocks.numel() * 2 / t / 1e9:.2f}")
    print(" ".join(out), f"load={os.getloadavg()[0]:.2f}", flush=True)
p.unlink()
