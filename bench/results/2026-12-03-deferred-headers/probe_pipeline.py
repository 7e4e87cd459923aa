import os, sys, time, mmap, tempfile, numpy as np, xxhash, threading
from concurrent.futures import ThreadPoolExecutor
B = 2 << 20; N = 256
src = np.random.randint(0, 255, (N, B), dtype=np.uint8)
slab = np.random.randint(0, 255, (N, B), dtype=np.uint8)
d = tempfile.mkdtemp(dir=os.environ.get("DIR", "/dev/shm")); f = open(d + "/m", "w+b"); f.truncate(N * B)
m = mmap.mmap(f.fileno(), N * B); out = np.frombuffer(m, np.uint8).reshape(N, B); out[:] = 1
w = ThreadPoolExecutor(1)
def copy_in(i): np.copyto(slab[i], src[i])
def mode_split(hash_where):
    futs = []
    t0 = time.perf_counter()
    ahead = {}
    for i in range(N):
        if hash_where == "writer_ahead" and i + 1 < N: ahead[i + 1] = w.submit(xxhash.xxh3_64_intdigest, slab[i + 1])
        if hash_where == "writer_ahead" and i == 0: ahead[0] = w.submit(xxhash.xxh3_64_intdigest, slab[0])
        if hash_where == "main_before": xxhash.xxh3_64_intdigest(slab[i])
        np.copyto(out[i], slab[i])
        if hash_where == "main_after_map": xxhash.xxh3_64_intdigest(out[i])
        if hash_where == "writer_ahead": ahead.pop(i).result()
        futs.append(w.submit(copy_in, i))
    for x in futs: x.result()
    return N * B / (time.perf_counter() - t0) / 1e9
def floor():
    def run(lo, hi):
        for i in range(lo, hi):
            xxhash.xxh3_64_intdigest(slab[i]); np.copyto(out[i], slab[i]); np.copyto(slab[i], src[i])
    t0 = time.perf_counter(); x = w.submit(run, N // 2, N); run(0, N // 2); x.result()
    return N * B / (time.perf_counter() - t0) / 1e9
for r in range(3):
    print(" ".join(f"{k}={fn():.2f}" for k, fn in [("writer_ahead", lambda: mode_split("writer_ahead")), ("main_before", lambda: mode_split("main_before")), ("main_after_map", lambda: mode_split("main_after_map")), ("floor", floor)]))
