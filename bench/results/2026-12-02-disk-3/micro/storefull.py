"""store() of 128 x 2 MiB new blocks into a full CPU slab (every victim spills to DISK), as
bench/transfers.py's row, vs a raw sequential write of the same bytes; rounds interleaved.
usage: storefull.py [--rounds N] [--request R]  (R: blocks per store() call; 0 = all 128)"""
import argparse, os, shutil, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
from bench.common import raw_write
from bench.transfers import SPEC, NAMESPACE, _store
from kvtier.hashing import block_hashes_for
p = argparse.ArgumentParser(); p.add_argument("--rounds", type=int, default=5); p.add_argument("--request", type=int, default=0)
a = p.parse_args()
torch.set_num_threads(1)
n = 128; R = a.request or n
root = Path(tempfile.mkdtemp(dir="/tmp", prefix="disk3-store-"))
blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
store = _store(root / "kv", n, 2)
cpu = store.top
chains = [block_hashes_for(list(range(k * 10**6, k * 10**6 + n * 16)), NAMESPACE, 16) for k in range(2)]
store.store(chains[0], blocks)
raw = root / "raw.bin"
def fill():
    cpu.clear(); store.disk.remove(chains[0] + chains[1]); store.store(chains[0], blocks)
def into_full():
    for i in range(0, n, R):
        assert store.store(chains[1][i:i + R], blocks[i:i + R]) == min(R, n - i)
for r in range(a.rounds + 1):
    fill(); t0 = time.perf_counter(); into_full(); ts = time.perf_counter() - t0
    t0 = time.perf_counter(); raw_write(raw, blocks, 32); tw = time.perf_counter() - t0
    if r: print(f"store={n * SPEC.block_nbytes / ts / 1e9:.2f} raw={n * SPEC.block_nbytes / tw / 1e9:.2f} ratio={tw / ts:.2f} load={os.getloadavg()[0]:.2f}", flush=True)
store.close(); shutil.rmtree(root)
