from _common import best
import sys, time, mmap, torch, numpy as np, xxhash
from concurrent.futures import ThreadPoolExecutor
torch.set_num_threads(1)
from kvtier.tiers.host_memory import host_empty
from bench.common import raw_write, prime_raw_file
from pathlib import Path
n, blk = 128, 2 << 20
src_t = torch.randn(n, blk // 2).to(torch.bfloat16)
src = src_t.view(torch.uint8).reshape(n, -1).numpy()
slab = host_empty(n * blk).view(n, -1).numpy(); slab[:] = src[::-1]
path = Path("/tmp/kvtier-fs2.bin"); path.write_bytes(bytes(n * blk))
f = open(path, "r+b"); mm = mmap.mmap(f.fileno(), n * blk); out = np.frombuffer(mm, dtype=np.uint8).reshape(n, -1); out[:] = slab
raw = prime_raw_file(Path("/tmp/kvtier-fs2raw.bin"), src_t, 32)
def part(lo, hi, copy_in=True):
    for i in range(lo, hi):
        xxhash.xxh3_64_intdigest(slab[i]); np.copyto(out[i], slab[i])
        if copy_in: np.copyto(slab[i], src[i])
pool = ThreadPoolExecutor(2)
def two(copy_in):
    [x.result() for x in [pool.submit(part, 0, n // 2, copy_in), pool.submit(part, n // 2, n, copy_in)]]
def pipelined():  # main thread copies in, the I/O thread spills (hash + copy out) one block ahead
    # spill block i on the pool, then copy in block i on this thread after it is spilled
    futs = [pool.submit(part, i, i + 1, False) for i in range(n)]
    for i, fu in enumerate(futs):
        fu.result(); np.copyto(slab[i], src[i])
for _ in range(3):
    w = best(lambda: raw_write(raw, src_t, 32), 7)
    print(f"raw {n*blk/w/1e9:.2f} GB/s; store floor 1t {w/best(lambda: part(0, n)):.2f}x, 2t {w/best(lambda: two(True)):.2f}x, pipelined {w/best(pipelined):.2f}x; spill floor 1t {w/best(lambda: part(0, n, False)):.2f}x 2t {w/best(lambda: two(False)):.2f}x")
