"""Daemon and client CPU per GB of batch puts by block size (1, 2, 4 MiB blocks, 32 MiB a call,
256 MiB rounds, medians of 5 after 3 warm-up; daemon CPU from /proc schedstat): the slope is the
daemon's cost per frame. Run from the tree root."""
import os, sys, tempfile, time, statistics, hashlib
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from bench.server import start_daemon, stop
from kvtier.tiers.remote import RemoteTier
from kvtier.types import KVSpec
torch.set_num_threads(1)
def cpu_ns(pid):
    t = 0
    for d in os.listdir(f"/proc/{pid}/task"):
        try: t += int(open(f"/proc/{pid}/task/{d}/schedstat").read().split()[0])
        except OSError: pass
    return t
ROUND = 256 << 20
for kib, per in [(1024, 32), (2048, 16), (4096, 8), (2048, 16), (1024, 32), (4096, 8)]:
    spec = KVSpec(num_layers=8, num_kv_heads=8, head_dim=128, block_size=kib // 32, dtype=torch.float16)
    n = ROUND // spec.block_nbytes
    dp, url = start_daemon(Path(tempfile.mkdtemp()), ROUND + (16 << 20))
    try:
        c = RemoteTier(url, timeout_s=30.0); ns = hashlib.sha256(str(kib).encode()).digest()
        c.register(ns, spec)
        blocks = list(torch.randn((n, *spec.block_shape)).to(spec.dtype))
        res = []
        for r in range(8):
            hs = [os.urandom(32) for _ in range(n)]
            s0, c0, t0 = cpu_ns(dp.pid), time.thread_time(), time.perf_counter()
            for k in range(0, n, per):
                assert all(c.put(ns, hs[k:k + per], blocks[k:k + per]))
            s1, c1, t1 = cpu_ns(dp.pid), time.thread_time(), time.perf_counter()
            if r >= 3: res.append((ROUND / (t1 - t0) / 1e9, (s1 - s0) / 1e6 / (ROUND / 1e9), (c1 - c0) * 1e3 / (ROUND / 1e9)))
        g, d, cl = (statistics.median(x) for x in zip(*res))
        print(f"{kib:5d} KiB x {per:3d}: {g:.2f} GB/s daemon {d:.0f} ms/GB client {cl:.0f} ms/GB ({1e9 / spec.block_nbytes * 1.0:.0f} frames/GB)")
        c.close()
    finally:
        stop(dp)
