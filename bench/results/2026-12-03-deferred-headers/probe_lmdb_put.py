import os, sys, time, tempfile, mmap, numpy as np, lmdb, shutil
from pathlib import Path
sys.path.insert(0, os.getcwd())
from kvtier.tiers.disk import advise_huge_pages
B = 2 << 20; N = 256
root = Path(tempfile.mkdtemp(dir=os.environ.get("DIR", "/tmp")))
map_size = 4 * N * (B + 8192) + (64 << 20)
env = lmdb.open(str(root / "db"), map_size=map_size, writemap=True, sync=False, metasync=False, max_dbs=4, readahead=False)
print("huge advised", advise_huge_pages(root / "db", map_size) if os.environ.get("ADV") else "no")
src = np.random.randint(0, 255, (N, B), dtype=np.uint8)
keys = lambda r: [f"{r}-{i}".encode().ljust(32, b"x") for i in range(N)]
def rnd(r, per=32):
    t_put = 0.0
    for k0 in range(0, N, per):
        with env.begin(write=True) as txn:
            if r >= 3:
                for k in keys(r - 3)[k0:k0 + per]: txn.delete(k)
            for i, k in enumerate(keys(r)[k0:k0 + per]):
                t = time.perf_counter(); txn.put(k, src[k0 + i]); t_put += time.perf_counter() - t
    return t_put
for r in range(12):
    t = time.perf_counter(); tp = rnd(r); w = time.perf_counter() - t
    if r >= 4: print(f"round {r}: {N*B/w/1e9:.2f} GB/s wall, txn.put {tp/N*1e6:.0f} us per 2 MiB ({N*B/tp/1e9:.2f} GB/s)")
# compare plain copy into a dirty shared file mapping
f = open(root / "raw.bin", "w+b"); f.truncate(N * B); m = mmap.mmap(f.fileno(), N * B); arr = np.frombuffer(m, np.uint8).reshape(N, B); arr[:] = 1
for r in range(3):
    t = time.perf_counter()
    for i in range(N): np.copyto(arr[i], src[i])
    w = time.perf_counter() - t; print(f"mapped file copy {N*B/w/1e9:.2f} GB/s, {w/N*1e6:.0f} us per 2 MiB")
del arr; m.close(); f.close(); env.close(); shutil.rmtree(root)
