import mmap, os, sys, time, ctypes, statistics
import numpy as np
N = int(sys.argv[1]); BLK = 2 << 20; MAP = 3 * N * BLK
src = np.random.randint(0, 255, N * BLK, dtype=np.uint8)
path = "/tmp/grow/mm.bin"
def run(mode):
    if os.path.exists(path): os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if mode == "pwrite":
        t = time.perf_counter()
        for i in range(N):
            os.pwrite(fd, memoryview(src[i*BLK:(i+1)*BLK]), 4096 + i * (BLK + 4096))
        dt = time.perf_counter() - t; os.close(fd); return dt
    os.ftruncate(fd, MAP)
    m = mmap.mmap(fd, MAP, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    if mode in ("random", "rpopw"): m.madvise(mmap.MADV_RANDOM)
    if mode == "seq": m.madvise(mmap.MADV_SEQUENTIAL)
    if mode == "nohuge": m.madvise(mmap.MADV_NOHUGEPAGE)
    if mode.startswith("huge"): m.madvise(mmap.MADV_HUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    t = time.perf_counter()
    for i in range(N):
        off = 4096 + i * (BLK + 4096)
        if mode in ("popw", "hugepopw", "rpopw"):
            m.madvise(23, off & ~4095, BLK + 8192)  # MADV_POPULATE_WRITE
        ctypes.memmove(base + off, src[i*BLK:].ctypes.data, BLK)
    dt = time.perf_counter() - t
    del base; m.close(); os.close(fd); return dt
modes = sys.argv[2].split(",")
res = {m: [] for m in modes}
for r in range(int(sys.argv[3])):
    for m in modes:
        res[m].append(N * BLK / run(m) / 1e9)
for m, v in res.items():
    print(f"{m:8s} median {statistics.median(v):6.2f} GB/s  runs {' '.join(f'{x:.2f}' for x in v)}")
print("load", os.getloadavg())
