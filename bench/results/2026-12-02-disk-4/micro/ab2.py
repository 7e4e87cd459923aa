# same-process A/B: store() into a full CPU slab with the payload hashed at copy-in (HOT_HASH_BYTES = MiB given) vs not ("off")
import sys, time, torch, tempfile, statistics, os
sys.path.insert(0, sys.argv[1])
import bench.transfers as T
from kvtier.hashing import block_hashes_for
from kvtier.store import stores as S
SPEC=T.SPEC; NS=T.NAMESPACE
n=128; req=int(sys.argv[2]) if len(sys.argv)>2 else 128
modes=sys.argv[3].split(",") if len(sys.argv)>3 else ["off","4"]
orig=S.StorePath._write_hashed
def plain(self, write, indices, ids): write(indices, ids)
store=T._store(__import__("pathlib").Path(tempfile.mkdtemp(dir="/tmp")), n, 1)
hashes=block_hashes_for(list(range(n*16)), NS, 16)
spill=block_hashes_for(list(range(10**6, 10**6+n*16)), NS, 16)
blocks=torch.randn((n,*SPEC.block_shape)).to(SPEC.dtype)
res={m:[] for m in modes}
raw=[]; f=open("/tmp/disk4/raw.bin","wb+"); buf=blocks.view(torch.uint8).numpy().reshape(-1)
def rawwrite():
    f.seek(0)
    for i in range(0, len(buf), 32*SPEC.block_nbytes): f.write(buf[i:i+32*SPEC.block_nbytes])
rawwrite()
for r in range(12):
    for m in modes:
        if m=="off": S.StorePath._write_hashed=plain
        else: S.StorePath._write_hashed=orig; S.HOT_HASH_BYTES=int(float(m)*(1<<20))
        store.top.clear(); store.disk.remove(hashes+spill); store.store(hashes, blocks)
        t0=time.perf_counter()
        for s in range(0,n,req): assert store.store(spill[s:s+req], blocks[s:s+req])==req
        res[m].append(time.perf_counter()-t0)
    t0=time.perf_counter(); rawwrite(); raw.append(time.perf_counter()-t0)
nb=n*SPEC.block_nbytes
rw=nb/statistics.median(raw[2:])/1e9
print(f"req {req}: raw {rw:.2f} GB/s", " ".join(f"{m}: med {nb/statistics.median(v[2:])/1e9:.2f} best {nb/min(v[2:])/1e9:.2f} ({nb/statistics.median(v[2:])/1e9/rw:.2f}x)" for m,v in res.items()), "load", os.getloadavg()[0])
store.check() if hasattr(store,"check") else None
store.close()
