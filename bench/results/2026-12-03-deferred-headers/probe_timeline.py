import os, sys, time, tempfile, threading, collections
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
torch.set_num_threads(1)
import kvtier.tiers.disk as D
from bench.transfers import _store, SPEC, NAMESPACE
from kvtier.hashing import block_hashes_for
EV = []
def wrap(mod, name, label):
    f = getattr(mod, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: EV.append((threading.current_thread().name[:12], label, t0, time.perf_counter()))
    setattr(mod, name, g)

import ctypes, numpy as np
def put_framed(txn, key, framed, header):
    t0 = time.perf_counter(); txn.put(key, framed); t1 = time.perf_counter()
    stored = txn.get(key); t2 = time.perf_counter()
    record = header(); t3 = time.perf_counter()
    ctypes.memmove(np.frombuffer(stored, dtype=np.uint8).ctypes.data, record, D.HEADER_NBYTES); t4 = time.perf_counter()
    th = threading.current_thread().name[:12]
    EV.extend([(th, "txn.put", t0, t1), (th, "txn.get", t1, t2), (th, "header()", t2, t3), (th, "memmove hdr", t3, t4)])
D.put_framed = put_framed

wrap(D, "encode_header", "hash")
wrap(D._WriteOverlap, "_in_caller_modes", "copy_in")
wrap(D._WriteOverlap, "finish", "finish")
wrap(D.DiskTier, "write_batch", "write_batch")
n = (512 << 20) // SPEC.block_nbytes
root = Path(tempfile.mkdtemp(dir=os.environ.get("DIR", "/work")))
store = _store(root / "kv", n, 2)
wrap(type(store), "store", "store")
blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
def hs(r): return block_hashes_for(list(range(r * 10**6, r * 10**6 + n * 16)), NAMESPACE, 16)
for r in range(6): store.store(hs(r), blocks)
EV.clear()
T0 = time.perf_counter()
for r in range(6, 12):
    h = hs(r)
    store.store(h, blocks)
T1 = time.perf_counter()
print(f"GB/s {6 * n * SPEC.block_nbytes / (T1 - T0) / 1e9:.2f}; blocks {6*n}")
agg = collections.defaultdict(lambda: [0, 0.0])
for th, lab, a, b in EV:
    agg[(th, lab)][0] += 1; agg[(th, lab)][1] += b - a
for k, (c, s) in sorted(agg.items()):
    print(f"{k[0]:12s} {k[1]:12s} n={c:5d} total {s*1e3:8.1f} ms  per {s/c*1e6:8.1f} us")
print(f"wall {(T1-T0)*1e3:.1f} ms")
# first write_batch details
wb = [e for e in EV if e[1] == "write_batch"]
print("write_batches", len(wb), "per store", len(wb) / 6)
a, b = wb[3][2], wb[3][3]
for th, lab, x, y in sorted(EV, key=lambda e: e[2]):
    if a <= x <= b and lab != "write_batch":
        pass
store.close()
import shutil; shutil.rmtree(root)
