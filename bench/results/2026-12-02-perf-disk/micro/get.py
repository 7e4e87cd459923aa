import sys, time, ctypes, hashlib, os, mmap
sys.path.insert(0, "/work/wt/disk")
import numpy as np, torch, xxhash, lmdb
from kvtier.tiers.disk import DiskTier, record_footprint
from kvtier.records import decode_into, HEADER_NBYTES, parse_header, ReadStatus
from bench.common import raw_read, raw_write
N = 128; NB = 2 << 20
src = torch.randint(0, 255, (N, NB), dtype=torch.uint8)
dst = torch.empty_like(src)
d = "/tmp/diskexp/d"; import shutil; shutil.rmtree(d, ignore_errors=True)
disk = DiskTier(d, N * record_footprint(NB) + (1<<20))
ns = b"n" * 32
hs = [hashlib.sha256(str(i).encode()).digest() for i in range(N)]
disk.write_batch([(h, ns, src[i], h) for i, h in enumerate(hs)])
raw_write(__import__("pathlib").Path("/tmp/diskexp/raw.bin"), src, 32)
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = 4096
def addr_of(value):
    return np.frombuffer(value, dtype=np.uint8).ctypes.data
def populate(value):
    a = addr_of(value); s = a & ~(PAGE-1)
    r = libc.madvise(s, a + len(value) - s, 22)
    assert r == 0, ctypes.get_errno()
def get_std():
    for j, h in enumerate(hs):
        assert disk.read_into(h, ns, dst[j], h) is ReadStatus.OK
def get_copyonly():
    with disk.env.begin(buffers=True) as txn:
        for j, h in enumerate(hs):
            v = txn.get(h)
            np.copyto(dst[j].numpy(), np.frombuffer(v, dtype=np.uint8, offset=HEADER_NBYTES))
def get_pop():
    for j, h in enumerate(hs):
        with disk.env.begin(buffers=True) as txn:
            v = txn.get(h); populate(v)
            assert decode_into(v, ns, dst[j], h) is ReadStatus.OK
def get_hashonly():
    with disk.env.begin(buffers=True) as txn:
        for j, h in enumerate(hs):
            v = txn.get(h); xxhash.xxh3_64_intdigest(v)
def raw():
    raw_read(__import__("pathlib").Path("/tmp/diskexp/raw.bin"), dst, 32)
def t(f, n=5):
    best = 1e9
    for _ in range(n):
        t0 = time.perf_counter(); f(); best = min(best, time.perf_counter() - t0)
    return N * NB / best / 1e9
for name in sys.argv[1:]:
    print(name, round(t(globals()[name]), 2))
import kvtier.records as R
def rng(h):
    with disk.env.begin(buffers=True) as txn:
        v = txn.get(h); return np.frombuffer(v, np.uint8).ctypes.data, len(v)
def madv(a, n, adv):
    s = a & ~4095; r = libc.madvise(s, a + n - s, adv); assert r == 0, ctypes.get_errno()
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_vec = ctypes.create_string_buffer(1)
def cold_hint(h):
    a, n = rng(h)
    last = (a + n - 1) & ~4095
    if libc.mincore(last, 4096, _vec) == 0 and _vec.raw[0] & 1:
        return
    madv(a, n, 3)
def win2(k=16):
    if "R" in globals(): R._CHUNK_NBYTES = 512 << 10
    for h in hs[:k]: cold_hint(h)
    for j, h in enumerate(hs):
        if j + k < N: cold_hint(hs[j+k])
        assert disk.read_into(h, ns, dst[j], h) is ReadStatus.OK
def win():
    R._CHUNK_NBYTES = 512 << 10
    k = 16
    for h in hs[:k]: madv(*rng(h), 3)
    for j, h in enumerate(hs):
        if j + k < N: madv(*rng(hs[j+k]), 3)
        assert disk.read_into(h, ns, dst[j], h) is ReadStatus.OK

def mk(c):
    def f():
        R._CHUNK_NBYTES = c; get_std()
    return f
c256, c512, c1m, c2m = mk(256<<10), mk(512<<10), mk(1<<20), mk(2<<20)
for rep in range(6):
    print(" ".join(f"{n}={t(f):.2f}" for n, f in [("raw", raw), ("512k", c512), ("win", win), ("win2", win2)]), flush=True)
