# store into a full slab, memory traffic: victims put to LMDB then all copies in (today) vs per block: put victim i, copy new block into slot i
import sys, os, time, statistics, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from kvtier.tiers.disk import DiskTier, put_record
from kvtier.tiers.pool import BlockPool
from kvtier.hashing import block_hashes_for
from kvtier.types import Medium
import bench.transfers as T
SPEC=T.SPEC; NS=T.NAMESPACE; n=128; R=32
pool=BlockPool(Medium.CPU, SPEC, n*SPEC.block_nbytes, "cpu")
pool.tensor.copy_(torch.randn((n,*SPEC.block_shape)).to(SPEC.dtype))
src=torch.randn((n,*SPEC.block_shape)).to(SPEC.dtype)
disk=DiskTier("/tmp/disk4/inter", 4*n*(SPEC.block_nbytes+8192))
hs=block_hashes_for(list(range(n*16)), NS, 16)
FP=b"\0"*32
def today():
    for r in range(0,n,R):
        with disk.env.begin(write=True, buffers=True) as txn:
            for i in range(r,r+R): put_record(txn, hs[i], NS, pool.tensor[i], i+1, FP)
        pool.tensor[r:r+R].copy_(src[r:r+R])
def inter():
    for r in range(0,n,R):
        with disk.env.begin(write=True, buffers=True) as txn:
            for i in range(r,r+R):
                put_record(txn, hs[i], NS, pool.tensor[i], i+1, FP)
                pool.tensor[i].copy_(src[i])
def clear():
    with disk.env.begin(write=True) as txn:
        for h in hs: txn.delete(h)
f=open("/tmp/disk4/raw2.bin","wb+"); buf=src.view(torch.uint8).numpy().reshape(-1)
def raw():
    f.seek(0)
    for i in range(0,len(buf),32*SPEC.block_nbytes): f.write(buf[i:i+32*SPEC.block_nbytes])
raw(); res={"today":[], "inter":[], "raw":[]}
for k in range(12):
    for name,fn in (("today",today),("inter",inter),("raw",raw)):
        clear(); t0=time.perf_counter(); fn(); res[name].append(time.perf_counter()-t0)
nb=n*SPEC.block_nbytes
print(" ".join(f"{k} {nb/statistics.median(v[2:])/1e9:.2f} GB/s" for k,v in res.items()), "load", os.getloadavg()[0])
