"""Grow vs reuse: DiskTier.write_batch into a fresh tier, variants of LMDB flags, vs raw write to a fresh file."""
import os, sys, time, shutil, hashlib, statistics, mmap, ctypes
sys.path.insert(0, os.getcwd())
import torch, lmdb
import kvtier.tiers.disk as D
sys.path.insert(0, '/tmp/grow'); import popw as P
from kvtier.tiers.disk import DiskTier, record_footprint
from kvtier.types import BlockHash
N = int(sys.argv[1]) if len(sys.argv) > 1 else 128
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["wm", "nowm"]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
BLK = 2 << 20
NS = bytes(32)
pool = torch.randint(0, 255, (N + 1, BLK), dtype=torch.uint8)  # slot 0 is the frame pad
src = [pool[i + 1] for i in range(N)]
base = "/tmp/grow/run"
orig_open = lmdb.open
def opener(**over):
    def o(path, **kw):
        if "map_size" in kw and not kw.get("readonly"):
            kw.update(over)
        return orig_open(path, **kw)
    return o
def raw_fresh(path):
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for i in range(0, N, 32):
            for j in range(i, min(i+32, N)):
                f.write(memoryview(src[j].numpy()))
    return time.perf_counter() - t
def put_all(disk, tag):
    hs = [BlockHash(hashlib.sha256(f"{tag}{i}".encode()).digest()) for i in range(N)]
    t = time.perf_counter()
    for i in range(0, N, 32):
        ok = disk.write_batch([(hs[j], NS, src[j]) for j in range(i, min(i+32, N))])
        assert all(ok)
    return time.perf_counter() - t, hs
def get_all(disk, hs, out):
    t = time.perf_counter()
    for h in hs:
        assert disk.read_into(h, NS, out) == D.ReadStatus.OK, disk.read_into(h, NS, out)
    return time.perf_counter() - t
res = {}
out = torch.empty(BLK, dtype=torch.uint8)
for r in range(rounds):
    for m in ["raw"] + modes:
        shutil.rmtree(base, ignore_errors=True); os.makedirs(base)
        if m == "raw":
            res.setdefault("raw fresh", []).append(N*BLK/raw_fresh(base + "/raw.bin")/1e9)
            pass
            continue
        over = {"wm": dict(writemap=True), "nowm": dict(writemap=False), "popw": dict(writemap=True), "nowmT": dict(writemap=False)}[m]
        if m == "nowmT" and not getattr(P, "mallopt_done", 0):
            libc = ctypes.CDLL(None); assert libc.mallopt(-1, 1 << 30) == 1 and libc.mallopt(-3, 32 << 20) == 1; P.mallopt_done = 1
        D.DiskTier._write_batch = P.patched if m == "popw" else P.orig
        lmdb.open = opener(**over)
        disk = DiskTier(base + "/d", 3 * N * record_footprint(BLK))
        lmdb.open = orig_open
        g, hs = put_all(disk, f"a{r}")
        g2, hs2 = put_all(disk, f"b{r}")  # second grow pass
        disk.remove(hs)
        u, hs3 = put_all(disk, f"c{r}")  # reuse the freed pages of hs
        rd = get_all(disk, hs3, out)
        res.setdefault(f"{m} grow1", []).append(N*BLK/g/1e9)
        res.setdefault(f"{m} grow2", []).append(N*BLK/g2/1e9)
        res.setdefault(f"{m} reuse", []).append(N*BLK/u/1e9)
        res.setdefault(f"{m} get", []).append(N*BLK/rd/1e9)
        disk.close()
for k, v in res.items():
    print(f"{k:12s} median {statistics.median(v):6.2f} GB/s  runs {' '.join(f'{x:.2f}' for x in v)}")
print("load", os.getloadavg())
