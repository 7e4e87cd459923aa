"""Cold DISK get: plain vs madvise(MADV_HUGEPAGE / MADV_SEQUENTIAL) on LMDB's map, vs raw readinto."""
import sys, os, time, ctypes, statistics, shutil
sys.path.insert(0, os.getcwd())
import numpy as np, torch
from kvtier.tiers.disk import DiskTier
from kvtier.records import ReadStatus
from kvtier.tiers.disk import record_footprint
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
root = "/work/wt/disk5-cold"; shutil.rmtree(root, ignore_errors=True); os.makedirs(root)
NB, shape = 128, (2 << 20) // 4
src = torch.randn(NB, shape); dst = torch.empty_like(src)
ns = b"n" * 32
disk = DiskTier(root + "/disk", NB * record_footprint(shape * 4) * 2)
hashes = [os.urandom(32) for _ in range(NB)]
for i in range(0, NB, 32):
    assert all(disk.write_batch([(hashes[j], ns, src[j], b"f" * 32) for j in range(i, i + 32)]))
disk.flush()
raw = root + "/raw.bin"
with open(raw, "wb") as f: f.write(src.numpy().tobytes()); os.fsync(f.fileno())
def drop():
    os.sync(); open("/proc/sys/vm/drop_caches", "w").write("3\n")
def map_range(d):
    p = os.path.realpath(os.path.join(d.env.path(), "data.mdb"))
    for l in open("/proc/self/maps"):
        if l.rstrip().endswith(p):
            a, b = (int(x, 16) for x in l.split()[0].split("-")); return a, b - a
def reopen(advice):
    global disk
    cap = disk.capacity_bytes; disk.close(); drop(); disk = DiskTier(root + "/disk", cap)
    if advice:
        a, n = map_range(disk)
        r = libc.madvise(a, n, advice); assert r == 0, ctypes.get_errno()
def get():
    for j, h in enumerate(hashes):
        assert disk.read_into(h, ns, dst[j], b"f" * 32) is ReadStatus.OK
def rawread():
    with open(raw, "rb", buffering=0) as f:
        v = memoryview(dst.numpy()).cast("B"); off = 0
        while off < len(v):
            n = f.readinto(v[off: off + (64 << 20)]); off += n
cases = {"plain": 0, "hugepage": 14}
t = {k: [] for k in [*cases, "raw", "plain_warm", "hugepage_warm"]}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
for r in range(rounds):
    order = list(cases) + ["raw"]
    if r % 2: order.reverse()
    for k in order:
        if k == "raw":
            drop(); s = time.perf_counter(); rawread(); t[k].append(time.perf_counter() - s)
        else:
            reopen(cases[k]); s = time.perf_counter(); get(); t[k].append(time.perf_counter() - s)
            assert torch.equal(dst, src)
            w = []
            for _ in range(3):
                s = time.perf_counter(); get(); w.append(time.perf_counter() - s)
            t[k + "_warm"].append(min(w))
    print(r, {k: round(src.numel() * 4 / v[-1] / 1e9, 2) for k, v in t.items()}, flush=True)
med = {k: statistics.median(v) for k, v in t.items()}
print("median GB/s", {k: round(src.numel() * 4 / v / 1e9, 2) for k, v in med.items()}, "ratio to raw", {k: round(med["raw"] / v, 2) for k, v in med.items()})
disk.close(); shutil.rmtree(root)
