import os, sys, time, resource, tempfile, shutil, statistics, threading
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from pathlib import Path
import torch
torch.set_num_threads(1)
from bench.transfers import _store, SPEC, NAMESPACE
from kvtier.hashing import block_hashes_for
root = Path(tempfile.mkdtemp(prefix="slab-", dir="/work"))
n = 128
hashes = block_hashes_for(list(range(n * 16)), NAMESPACE, 16)
spill_hashes = block_hashes_for(list(range(10**6, 10**6 + n * 16)), NAMESPACE, 16)
blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
import kvtier.tiers.disk as _d
if os.environ.get("NOOVERLAP"): _d.OVERLAP_MIN_NBYTES = 1 << 40
store = _store(root / "kv", n, int(os.environ.get("THREADS", 2)))
store.store(hashes, blocks); store.flush()
def fill():
    store.top.clear(); store.disk.remove(hashes + spill_hashes); store.store(hashes, blocks)
def tasks():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            s = open(f"/proc/self/task/{t}/stat").read()
            name = open(f"/proc/self/task/{t}/comm").read().strip()
        except OSError: continue
        f = s.rsplit(")", 1)[1].split()
        out[(t, name)] = (int(f[11]) + int(f[12]))
    return out
for i in range(int(os.environ.get("R", 6))):
    fill()
    a = tasks(); c0 = time.process_time(); t = time.perf_counter(); f0 = resource.getrusage(resource.RUSAGE_SELF)
    assert store.store(spill_hashes, blocks) == n
    w = time.perf_counter() - t; c = time.process_time() - c0; b = tasks(); f1 = resource.getrusage(resource.RUSAGE_SELF)
    busy = {k: (b[k] - a.get(k, 0)) * 10 for k in b if b[k] - a.get(k, 0) > 0}
    print(f"{n*SPEC.block_nbytes/w/1e9:.2f} GB/s wall {w*1e3:.0f} ms cpu {c*1e3:.0f} ms  threads(ms): {sorted(busy.values(), reverse=True)} minflt {f1.ru_minflt-f0.ru_minflt} majflt {f1.ru_majflt-f0.ru_majflt} utime {1e3*(f1.ru_utime-f0.ru_utime):.0f} stime {1e3*(f1.ru_stime-f0.ru_stime):.0f}")
def smaps():
    out, cur = {}, None
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            cur = line.split()[-1] if len(line.split()) > 5 else "anon"
        elif cur and cur.endswith("data.mdb") and line.split(":")[0] in ("Rss", "AnonHugePages", "FilePmdMapped", "ShmemPmdMapped", "Private_Dirty", "Shared_Dirty"):
            out[line.split(":")[0]] = line.split(":")[1].strip()
    return out
print(smaps())
store.close(); shutil.rmtree(root, ignore_errors=True)
