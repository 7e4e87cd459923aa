import sys, time, torch, tempfile, collections
sys.path.insert(0, sys.argv[1])
import bench.transfers as T
from kvtier.hashing import block_hashes_for
from kvtier.store import stores as S
SPEC=T.SPEC; NS=T.NAMESPACE; n=128
if len(sys.argv)>2: S.SPILL_AHEAD_PART_BYTES=int(sys.argv[2])<<20
store=T._store(__import__("pathlib").Path(tempfile.mkdtemp(dir="/tmp")), n, 1)
hashes=block_hashes_for(list(range(n*16)), NS, 16)
spill=block_hashes_for(list(range(10**6, 10**6+n*16)), NS, 16)
blocks=torch.randn((n,*SPEC.block_shape)).to(SPEC.dtype)
acc=collections.Counter()
def wrap(obj, name):
    f=getattr(obj,name)
    def g(*a, **k):
        t0=time.perf_counter()
        try: return f(*a, **k)
        finally: acc[name]+=time.perf_counter()-t0
    setattr(obj,name,g)
sp=store._stores
for nm in ("prepare","complete","_finish_spill_ahead","_spill_ahead","_spills"): wrap(sp,nm)
import kvtier.tiers.disk as D
dw=store.disk.write_batch
def wb(*a, **k):
    t0=time.perf_counter()
    try: return dw(*a, **k)
    finally: acc["write_batch(any thread)"]+=time.perf_counter()-t0
store.disk.write_batch=wb
for r in range(6):
    store.top.clear(); store.disk.remove(hashes+spill); store.store(hashes, blocks)
    acc.clear()
    t0=time.perf_counter(); assert store.store(spill, blocks)==n; dt=time.perf_counter()-t0
    print(f"{dt*1e3:.1f} ms {n*SPEC.block_nbytes/dt/1e9:.2f} GB/s", {k: round(v*1e3,1) for k,v in acc.items()})
store.close()
