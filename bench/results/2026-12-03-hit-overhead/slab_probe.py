"""slab_rounds.py with probes per round: minor faults (getrusage) and this process's CPU over wall
time (both threads busy: ~1.8); at the end the huge-page lines of /proc/self/smaps_rollup.
Usage: TREE=<tree> [R=rounds] python slab_probe.py"""
import os, time, shutil, statistics
from slab_setup import SPEC, fill, raw, raw_write, root, blocks, store, spill_hashes, n
import resource
S, W, F = [], [], []
def steal():
    v = open('/proc/stat').readline().split()
    return int(v[8])
ST = []
for i in range(int(os.environ.get("R", 12))):
    fill()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; s0 = steal(); p0 = time.process_time(); t = time.perf_counter(); assert store.store(spill_hashes, blocks) == n; F.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0); ST.append(round((time.process_time() - p0) / (time.perf_counter() - t), 2)); S.append(time.perf_counter() - t); print(os.path.getsize(store.disk.path / "data.mdb") >> 20, end=" ")
    t = time.perf_counter(); raw_write(raw, blocks, 32); W.append(time.perf_counter() - t)
nb = n * SPEC.block_nbytes
print(" ".join(f"{nb/s/1e9:.1f}" for s in S)); print('minflt', F, 'cpu/wall', ST); print(f"store into full: best {nb/min(S)/1e9:.2f} GB/s med {nb/statistics.median(S)/1e9:.2f}; raw best {nb/min(W)/1e9:.2f} med {nb/statistics.median(W)/1e9:.2f}; ratio best {min(W)/min(S):.2f} med {statistics.median(W)/statistics.median(S):.2f}")
print([l.split()[0]+l.split()[1] for l in open("/proc/self/smaps_rollup") if "Huge" in l or "Pmd" in l]); import threading; print(os.sched_getaffinity(0))
store.close(); shutil.rmtree(root, ignore_errors=True)
