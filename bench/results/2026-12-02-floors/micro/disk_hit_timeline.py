"""The DISK hit's timeline at 1k tokens (``LEN``): when each I/O thread's reads run, relative
to ``before_prefill``'s start; the best 3 of 10 by ratio to one copy."""
import os, threading, time
from _common import disk_hit_setup
import kvtier.tiers.disk as D
s = disk_hit_setup(int(os.environ.get("LEN", "1024")))
kv, p, src, dst = s.kv, s.prompt, s.src, s.dst
EV = []
orig = D.DiskTier.read_into_views
def riv(self, hashes, *a, **k):
    t = time.perf_counter(); r = orig(self, hashes, *a, **k); EV.append(("views", threading.current_thread().name[-3:], t, time.perf_counter(), len(hashes))); return r
D.DiskTier.read_into_views = riv
orig2 = D.DiskTier.read_into
def ri(self, *a, **k):
    t = time.perf_counter(); r = orig2(self, *a, **k); EV.append(("into", threading.current_thread().name[-3:], t, time.perf_counter(), 1)); return r
D.DiskTier.read_into = ri
res = []
for i in range(10):
    kv.finish_loads(); kv.store.top.clear(); EV.clear()
    t0 = time.perf_counter(); plan = kv.before_prefill(p.ids); t1 = time.perf_counter()
    kv.finish_loads(); t2 = time.perf_counter(); dst.copy_(src); c = time.perf_counter() - t2
    res.append(((t1 - t0) / c, t1 - t0, c, [(k, th, (a - t0) * 1e3, (b - t0) * 1e3, n) for k, th, a, b, n in EV if a < t1]))
    del plan
res.sort(key=lambda r: r[0])
for ratio, tot, c, ev in res[:3]:
    print(f"ratio {ratio:.2f} total {tot*1e3:.2f} copy {c*1e3:.2f}")
    for e in sorted(ev, key=lambda e: e[2]): print("   %s %s %.2f-%.2f ms (%d blocks)" % e)
s.close()
