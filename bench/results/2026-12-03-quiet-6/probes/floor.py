import os, sys, time, tempfile
sys.path.insert(0, "/work/main")
from pathlib import Path
import torch
torch.set_num_threads(1)
from bench.tiers import StoreFloor
from bench.transfers import SPEC
n = 128
src = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
d = Path(tempfile.mkdtemp(dir="/work"))
for threads in (1, 2, 1, 2):
    f = StoreFloor(d / f"f{threads}", src, True, threads)
    for r in range(6):
        c0, t0 = time.process_time(), time.perf_counter(); f.run(); w = time.perf_counter() - t0; c = time.process_time() - c0
        if r >= 2: print(f"threads {threads}: {n*SPEC.block_nbytes/w/1e9:.2f} GB/s wall {w*1e3:.0f} ms cpu {c*1e3:.0f} ms")
