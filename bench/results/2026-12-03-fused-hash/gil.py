"""python-xxhash 4.1.0 and the GIL: one thread hashing an in-cache buffer vs two threads doing twice the work, wall and CPU time, per input size. Above 64 KiB it releases the GIL (both cores busy), at or below it holds it. Run: .venv/bin/python bench/results/2026-12-03-fused-hash/gil.py N"""
import xxhash, numpy as np, time, threading, resource, sys
n = int(sys.argv[1])
a = np.random.randint(0, 255, n, dtype=np.uint8); b = a.copy()
reps = (2 << 30) // n
def h(x):
    for _ in range(reps): xxhash.xxh3_64_intdigest(x)
def cpu(): r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
for _ in range(3):
    c0 = cpu(); t = time.perf_counter(); h(a); s = time.perf_counter() - t; sc = cpu() - c0
    c0 = cpu(); t = time.perf_counter(); ts = [threading.Thread(target=h, args=(x,)) for x in (a, b)]; [x.start() for x in ts]; [x.join() for x in ts]; p = time.perf_counter() - t; pc = cpu() - c0
    print(f"{n}: one thread x1 work {s*1e3:.0f} ms (cpu {sc*1e3:.0f}); two threads x2 work {p*1e3:.0f} ms (cpu {pc*1e3:.0f})")
