"""DiskTier.read_into_views of 64 blocks of 720 KiB (SmolLM2-135M, 1k tokens) into their places in
a hit buffer, on one thread and split over two threads, with the fused hash+copy kernel
(host_copy.hash_copy_rows, one GIL release a block) and without it (python-xxhash, then the
streaming copy), plus DiskTier.read_into into contiguous slots; best of 7 per cell, ms, four rounds,
against one torch copy_ of the same bytes. Page cache warm.

    flock -x /tmp/kvtier-cpu.lock .venv/bin/python bench/results/2026-12-03-fused-hash/views.py
"""
import os, sys, time, tempfile, shutil, threading
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import numpy as np, torch
torch.set_num_threads(1)
from kvtier.tiers.disk import DiskTier
from kvtier.kernels import host_copy
assert host_copy.library() is not None and host_copy._hashing
n = 64; T = n * 16
shape = (30, 2, 3, 16, 64)
root = tempfile.mkdtemp(dir=os.path.dirname(os.getcwd()))
disk = DiskTier(root, 2 << 30); ns = b"n" * 32
blocks = [torch.randn(shape) for _ in range(n)]
hashes = [os.urandom(16) for _ in range(n)]
disk.write_batch([(h, ns, b) for h, b in zip(hashes, blocks)])
buf = torch.empty((30, 2, 3, T, 64))
views = [buf[:, :, :, i * 16:(i + 1) * 16] for i in range(n)]
pool = torch.empty((n,) + shape)
src = torch.randn(buf.numel()); dst = torch.empty_like(src)
def one(hs, vs): assert all(s.value == "ok" for s in disk.read_into_views(hs, ns, vs, [None] * len(hs)))
def two():
    ts = [threading.Thread(target=one, args=(hashes[k * 32:(k + 1) * 32], views[k * 32:(k + 1) * 32])) for k in range(2)]
    [t.start() for t in ts]; [t.join() for t in ts]
def slots():
    for i, h in enumerate(hashes): assert disk.read_into(h, ns, pool[i]).value == "ok"
def t(f, reps=7):
    best = 1e9
    for _ in range(reps):
        s = time.perf_counter(); f(); best = min(best, time.perf_counter() - s)
    return round(best * 1e3, 2)
ref = torch.stack([b for b in blocks]); one(hashes, views); assert torch.equal(buf.permute(3, 0, 1, 2, 4).reshape(n, 16, 30, 2, 3, 64).permute(0, 2, 3, 4, 1, 5).contiguous(), ref)
for r in range(4):
    d = {"copy": t(lambda: dst.copy_(src))}
    for mode in (True, False):
        host_copy._hashing = mode
        k = "fused" if mode else "old"
        d[k + "1"] = t(lambda: one(hashes, views)); d[k + "2"] = t(two); d[k + "-slots"] = t(slots)
    host_copy._hashing = True
    print(d)
disk.close(); shutil.rmtree(root)
