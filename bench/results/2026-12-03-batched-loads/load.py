"""store.load of 64 DISK blocks of 720 KiB (SmolLM2-135M shape, 1k tokens) into an emptied top pool, 21 rounds, median and best, beside one torch copy_ of the same bytes; page cache warm. TREE=<checkout> picks the tree (A/B with a worktree). Run: flock -x /tmp/kvtier-cpu.lock .venv/bin/python bench/results/2026-12-03-batched-loads/load.py"""
import os, sys, time, tempfile, shutil, statistics as st
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
import torch
torch.set_num_threads(1)
from kvtier.config import StoreConfig
from kvtier.store import TieredStore
from kvtier.types import KVSpec
spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32, head_major=True)
root = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(os.environ.get("TREE", "."))))
n = 64
cfg = StoreConfig(gpu_bytes=0, cpu_bytes=(n + 8) * spec.block_nbytes, disk_bytes=1 << 30, data_dir=root, flush_on_close=True, num_io_threads=2)
hashes = [os.urandom(16) for _ in range(n)]
blocks = torch.randn(n, *spec.block_shape)
s = TieredStore(spec, cfg, b"n" * 32); assert s.store(hashes, blocks) == n; s.close()
s = TieredStore(spec, cfg, b"n" * 32)
src = torch.randn(blocks.numel()); dst = torch.empty_like(src)
loads, copies = [], []
for r in range(21):
    s.top.clear()
    t = time.perf_counter(); dst.copy_(src); copies.append(time.perf_counter() - t)
    t = time.perf_counter(); res = s.load(hashes); loads.append(time.perf_counter() - t)
    assert len(res.block_ids) == n; res.lease.release()
print(f"store.load of {n} DISK blocks: median {st.median(loads)*1e3:.2f} ms best {min(loads)*1e3:.2f}; copy median {st.median(copies)*1e3:.2f} best {min(copies)*1e3:.2f}")
s.close(); shutil.rmtree(root)
