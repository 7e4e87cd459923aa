# DISK hit reads in isolation: hash + streaming copy per block (C kernel direct) on 1 or 2 threads, and DiskTier.read_into_views; 64 blocks of SmolLM2-135M (720 KiB) into a head-major hit buffer, vs one torch copy.
import time, os, sys, tempfile, threading, numpy as np, torch, xxhash
sys.path.insert(0, os.getcwd())
torch.set_num_threads(1)
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host_memory import host_empty
from kvtier.records import HEADER_NBYTES
from kvtier.kernels import host_copy as hc
NS = b"n" * 32
L, H, bs, D = 30, 3, 16, 64; shape = (L, 2, H, bs, D); n = 64
d = tempfile.mkdtemp(dir="/tmp"); tier = DiskTier(d, 1 << 31)
blocks = torch.randn((n, *shape)); hs = [os.urandom(32) for _ in range(n)]
for i in range(0, n, 16): assert all(tier.write_batch([(h, NS, b) for h, b in zip(hs[i:i+16], blocks[i:i+16])]))
kvbuf = host_empty(L * 2 * H * n * bs * D, torch.float32).view(L, 2, H, n * bs, D); kvbuf.zero_()
views = list(kvbuf.view(L, 2, H, n, bs, D).permute(3, 0, 1, 2, 4, 5).unbind(0))
txn = tier.env.begin(buffers=True); vals = [txn.get(h) for h in hs]
srcs = [np.frombuffer(v, np.uint8, offset=HEADER_NBYTES) for v in vals]
vo = [v.view(torch.uint8).numpy() for v in views]
lib = hc.library(); rows, piece, stride = hc.row_layout(vo[0])
def whole(i):
    s = srcs[i]; xxhash.xxh3_64_intdigest(s); lib.kvt_copy_rows(vo[i].ctypes.data, stride, s.ctypes.data, piece, rows, piece, 1)
def chunked(R):
    def f(i):
        s = srcs[i]; d = xxhash.xxh3_64(); base = vo[i].ctypes.data; sp = s.ctypes.data
        for r0 in range(0, rows, R):
            d.update(s[r0 * piece:(r0 + R) * piece])
            lib.kvt_copy_rows(base + r0 * stride, stride, sp + r0 * piece, piece, min(R, rows - r0), piece, 1)
        d.intdigest()
    return f
def run1(f):
    for i in range(n): f(i)
def run2(f):
    t = threading.Thread(target=lambda: [f(i) for i in range(0, n, 2)]); t.start()
    for i in range(1, n, 2): f(i)
    t.join()
def report(fs, width):
    """11 interleaved rounds of every case; best and median against the "copy" case."""
    res = {k: [] for k in fs}
    for _ in range(11):
        for k, g in fs.items():
            t = time.perf_counter(); g(); res[k].append(time.perf_counter() - t)
    c = sorted(res["copy"])
    for k, v in res.items():
        v.sort(); print(f"{k:{width}s} best {v[0]*1e3:.2f} ms ({v[0]/c[0]:.2f}x)  median {v[5]*1e3:.2f} ({v[5]/c[5]:.2f}x)")


src = torch.empty(n * blocks[0].numel()).normal_(); dst = torch.empty_like(src)
fs = {"copy": lambda: dst.copy_(src)}
for name, f in [("whole", whole), ("rows32", chunked(32)), ("rows60", chunked(60)), ("rows16", chunked(16))]:
    fs[name + " 1T"] = (lambda f=f: run1(f)); fs[name + " 2T"] = (lambda f=f: run2(f))
report(fs, 12)
print("--- read_into_views API")
def api1(): tier.read_into_views(hs, NS, views, [None] * n)
def api2():
    half = [(hs[i::2], views[i::2]) for i in (0, 1)]
    t = threading.Thread(target=lambda: tier.read_into_views(half[0][0], NS, half[0][1], [None] * len(half[0][0]))); t.start()
    tier.read_into_views(half[1][0], NS, half[1][1], [None] * len(half[1][0])); t.join()
def api2_jobs():  # contiguous chunks of 11 on two threads, like the prefetcher
    parts = [list(range(k, min(k + 11, n))) for k in range(0, n, 11)]
    from concurrent.futures import ThreadPoolExecutor
    futs = [ex.submit(tier.read_into_views, [hs[i] for i in p], NS, [views[i] for i in p], [None] * len(p)) for p in parts]
    [f.result() for f in futs]
from concurrent.futures import ThreadPoolExecutor
ex = ThreadPoolExecutor(2)
ex1 = ThreadPoolExecutor(1)
def api1_jobs():
    parts = [list(range(k, min(k + 11, n))) for k in range(0, n, 11)]
    futs = [ex1.submit(tier.read_into_views, [hs[i] for i in p], NS, [views[i] for i in p], [None] * len(p)) for p in parts]
    [f.result() for f in futs]
fs = {"copy": lambda: dst.copy_(src), "api 1T": api1, "api 2T": api2, "api jobs 2 threads": api2_jobs, "api jobs 1 thread": api1_jobs}
report(fs, 20)
