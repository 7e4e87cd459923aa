from _common import best
import sys, time, torch, numpy as np, xxhash, mmap, os
from concurrent.futures import ThreadPoolExecutor
torch.set_num_threads(1)
blk = 720 * 1024; n = 64 * int(os.environ.get("K", "1"))
path = "/tmp/kvtier-floor2.bin"
with open(path, "wb") as f: f.write(np.random.default_rng(0).integers(0, 256, n * blk, dtype=np.uint8).tobytes())
fh = open(path, "rb"); mm = mmap.mmap(fh.fileno(), n * blk, prot=mmap.PROT_READ)
rec = np.frombuffer(mm, dtype=np.uint8).reshape(n, blk)
out = np.zeros((n, blk), dtype=np.uint8)
src = torch.empty(n * blk // 4).normal_(); dst = torch.empty_like(src)
def part(lo, hi):
    for i in range(lo, hi):
        xxhash.xxh3_64_intdigest(rec[i]); np.copyto(out[i], rec[i])
pool = ThreadPoolExecutor(2)
def one(): part(0, n)
def two():
    a = pool.submit(part, 0, n // 2); b = pool.submit(part, n // 2, n); a.result(); b.result()
def hashonly2():
    def h(lo, hi):
        for i in range(lo, hi): xxhash.xxh3_64_intdigest(rec[i])
    a = pool.submit(h, 0, n // 2); b = pool.submit(h, n // 2, n); a.result(); b.result()
def cp(): dst.copy_(src)
for _ in range(2):
    c = best(cp); print(f"copy {c*1e3:.2f} ms; floor 1 thread {best(one)/c:.2f}x; 2 threads {best(two)/c:.2f}x; hash only 2 threads {best(hashonly2)/c:.2f}x")
