# cold DISK reads, same process, alternating: plain per-block read vs fadvise(WILLNEED) of the next K records' file ranges
# (offsets learned in a warm pass = as if persisted in the index) vs a raw readinto of a file of the same bytes
import sys, os, time, statistics, numpy as np, torch, lmdb
sys.path.insert(0, sys.argv[1])
from kvtier.tiers.disk import DiskTier
from kvtier.records import decode_into, HEADER_NBYTES
from kvtier.hashing import block_hashes_for
import bench.transfers as T
SPEC=T.SPEC; NS=T.NAMESPACE; n=128
root="/tmp/disk4/cold"; os.makedirs(root, exist_ok=True)
hashes=block_hashes_for(list(range(n*16)), NS, 16)
blocks=torch.randn((n,*SPEC.block_shape)).to(SPEC.dtype)
disk=DiskTier(root+"/kv", 2*n*(SPEC.block_nbytes+8192))
disk.remove(hashes)
for i in range(0,n,32): assert all(disk.write_batch([(h, NS, blocks[j]) for j,h in enumerate(hashes[i:i+32], i)]))
disk.close()
raw=root+"/raw.bin"
with open(raw,"wb") as f: f.write(blocks.view(torch.uint8).numpy().tobytes())
out=torch.empty_like(blocks)
def drop(): os.sync(); open("/proc/sys/vm/drop_caches","w").write("3\n")
def mapbase(path):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(path):
            lo=int(line.split("-")[0],16); off=int(line.split()[2],16); return lo-off
def offsets():
    d=DiskTier(root+"/kv", 2*n*(SPEC.block_nbytes+8192)); offs=[]
    base=mapbase(os.path.realpath(root+"/kv/data.mdb"))
    with d.env.begin(buffers=True) as txn:
        for h in hashes:
            v=txn.get(h); offs.append((np.frombuffer(v,np.uint8).ctypes.data-base, len(v)))
    d.close(); return offs
OFFS=offsets()
def plain(K):
    d=DiskTier(root+"/kv", 2*n*(SPEC.block_nbytes+8192))
    t0=time.perf_counter()
    with d.env.begin(buffers=True) as txn:
        for j,h in enumerate(hashes):
            v=txn.get(h); assert decode_into(v, NS, out[j]).value=="ok"
    dt=time.perf_counter()-t0; d.close(); return dt
def fadv(K):
    d=DiskTier(root+"/kv", 2*n*(SPEC.block_nbytes+8192))
    fd=os.open(root+"/kv/data.mdb", os.O_RDONLY)
    t0=time.perf_counter()
    for j in range(min(K,n)): os.posix_fadvise(fd, OFFS[j][0], OFFS[j][1], os.POSIX_FADV_WILLNEED)
    with d.env.begin(buffers=True) as txn:
        for j,h in enumerate(hashes):
            if j+K<n: os.posix_fadvise(fd, OFFS[j+K][0], OFFS[j+K][1], os.POSIX_FADV_WILLNEED)
            v=txn.get(h); assert decode_into(v, NS, out[j]).value=="ok"
    dt=time.perf_counter()-t0; d.close(); os.close(fd); return dt
def rawread(K):
    t0=time.perf_counter()
    with open(raw,"rb",buffering=0) as f:
        b=out.view(torch.uint8).numpy().reshape(-1); step=32*SPEC.block_nbytes
        for i in range(0,len(b),step): f.readinto(memoryview(b[i:i+step]))
    return time.perf_counter()-t0
modes=[("plain",plain,0),("fadv4",fadv,4),("fadv16",fadv,16),("raw",rawread,0)]
res={m[0]:[] for m in modes}
nb=n*SPEC.block_nbytes
for r in range(int(sys.argv[2]) if len(sys.argv)>2 else 4):
    for name,f,K in modes:
        drop(); res[name].append(nb/f(K)/1e9)
    print(r, " ".join(f"{k} {v[-1]:.2f}" for k,v in res.items()), "load", os.getloadavg()[0], flush=True)
print("medians", " ".join(f"{k} {statistics.median(v):.2f}" for k,v in res.items()))
