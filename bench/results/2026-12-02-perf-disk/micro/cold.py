import sys, time, ctypes, hashlib, os, shutil, pathlib
sys.path.insert(0, "/work/wt/disk")
import numpy as np, torch
from kvtier.tiers.disk import DiskTier, record_footprint
from kvtier.records import ReadStatus
from bench.common import raw_read, raw_write, drop_page_cache
N = 128; NB = 2 << 20
src = torch.randint(0, 255, (N, NB), dtype=torch.uint8); dst = torch.empty_like(src)
d = pathlib.Path("/tmp/diskexp/c"); shutil.rmtree(d, ignore_errors=True)
cap = N * record_footprint(NB) + (1<<20)
disk = DiskTier(d, cap); ns = b"n"*32
hs = [hashlib.sha256(str(i).encode()).digest() for i in range(N)]
for i in range(0, N, 32):
    disk.write_batch([(h, ns, src[j], h) for j, h in list(enumerate(hs))[i:i+32]])
rawp = pathlib.Path("/tmp/diskexp/rawc.bin"); raw_write(rawp, src, 32)
libc = ctypes.CDLL(None, use_errno=True); libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
def madv(a, n, adv):
    s = a & ~4095; r = libc.madvise(s, a + n - s, adv); assert r == 0, ctypes.get_errno()
def reopen():
    global disk
    disk.close(); drop_page_cache([d]); disk = DiskTier(d, cap)
def rng(h):
    with disk.env.begin(buffers=True) as txn:
        v = txn.get(h); return np.frombuffer(v, np.uint8).ctypes.data, len(v)
def plain():
    for j, h in enumerate(hs): assert disk.read_into(h, ns, dst[j], h) is ReadStatus.OK
def mapbase():
    ino = os.stat(d / "data.mdb").st_ino
    for line in open("/proc/self/maps"):
        f = line.split()
        if len(f) >= 6 and int(f[4]) == ino:
            lo, hi = (int(x, 16) for x in f[0].split("-")); return lo, hi - lo
def seqmap():
    base, n = mapbase(); madv(base, n, 2)  # SEQUENTIAL
    plain()
def willall():
    for h in hs: madv(*rng(h), 3)
    plain()
def fadv_all():
    fd = os.open(d / "data.mdb", os.O_RDONLY); base = mapbase()[0]
    for h in hs:
        a, n = rng(h); os.posix_fadvise(fd, a - base, n, os.POSIX_FADV_WILLNEED)
    os.close(fd); plain()
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
def window(k=8):
    for h in hs[:k]: madv(*rng(h), 3)
    for j, h in enumerate(hs):
        if j + k < N: madv(*rng(hs[j+k]), 3)
        assert disk.read_into(h, ns, dst[j], h) is ReadStatus.OK
def window16(): window(16)
def window4(): window(4)
import xxhash
from kvtier.records import parse_header, HEADER_NBYTES
def pread_all(seq=False):
    fd = os.open(d / "data.mdb", os.O_RDONLY); base = mapbase()[0]
    if seq: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    for j, h in enumerate(hs):
        a, n = rng(h)
        hdr = os.pread(fd, HEADER_NBYTES, a - base)
        rec = parse_header(hdr, n)
        out = memoryview(dst[j].numpy())
        got = os.preadv(fd, [out], a - base + HEADER_NBYTES)
        assert got == n - HEADER_NBYTES
        dig = rec.digest(hdr); dig.update(out); assert dig.intdigest() == rec.checksum
    os.close(fd)
def pread_seq(): pread_all(True)
def mincore_cost():
    pass
def raw():
    drop_page_cache([rawp]); t0=time.perf_counter(); raw_read(rawp, dst, 32); return time.perf_counter()-t0
def t(name):
    if name == "raw": return raw()
    reopen(); t0 = time.perf_counter(); globals()[name](); return time.perf_counter() - t0
for rep in range(int(os.environ.get("REPS", 2))):
    for name in sys.argv[1:]:
        print(name, round(N*NB/t(name)/1e9, 2), flush=True)
