import os, sys, time, resource, shutil
from pathlib import Path as _P; sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(1)
from pathlib import Path
from bench.tiers import Bench, put_requests, make_blocks
from bench.common import raw_write, prime_raw_file, Stat
work = Path("/tmp/kvtier-spill-gc"); shutil.rmtree(work, ignore_errors=True); work.mkdir()
n = 128
src = make_blocks(n)
b = Bench(n, 32, 32, 3, list(Stat)[0] if hasattr(Stat, "__iter__") else Stat("best"), torch.device("cpu"), work, src, torch.empty_like(src), torch.empty_like(src), False)
store = b.store(cpu_blocks=n, disk_blocks=2*n)
disk = store.disk
raw_path = prime_raw_file(work / "raw.bin", src, 32)
state = {"h": b.fresh_chain()}
put_requests(store, state["h"], src, 32, b.fingerprints)
import gc
MODE=os.environ.get('GCM','')
if MODE=='freeze': gc.collect(); gc.freeze()
if MODE=='off': gc.disable()
print('objects tracked', len(gc.get_objects()))
def flt(): r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_minflt + r.ru_majflt
for rnd in range(int(os.environ.get("R","6"))):
    disk.remove(list(disk.lru_order())); state["h"] = b.fresh_chain()
    f0 = flt(); t0 = time.perf_counter()
    put_requests(store, state["h"], src, 32, b.fingerprints)
    t1 = time.perf_counter(); f1 = flt()
    raw_write(raw_path, src, 32)
    t2 = time.perf_counter(); f2 = flt()
    nb = src.numel() * src.element_size()
    print(f"spill {nb/(t1-t0)/1e9:.2f} GB/s faults {f1-f0}  raw {nb/(t2-t1)/1e9:.2f} GB/s faults {f2-f1}  ratio {(t2-t1)/(t1-t0):.2f}")
store.close()
