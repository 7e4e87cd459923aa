import time, torch, tempfile, os, sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]))
torch.set_num_threads(1)
from kvtier.tiers.disk import DiskTier
from kvtier.connectors.hf_cache import block_views
from kvtier.types import KVSpec
L,H,B,D=30,3,16,64
n=int(sys.argv[1]) if len(sys.argv)>1 else 64
d=tempfile.mkdtemp()
disk=DiskTier(d, 2<<30)
ns=b'n'*32
blocks=torch.randn(n, L,2,H,B,D)
hashes=[os.urandom(32) for _ in range(n)]
disk.write_batch([(h, ns, blocks[i]) for i,h in enumerate(hashes)])
pool=torch.empty(n, L,2,H,B,D)
class S: block_size=B; head_major=True
out=torch.empty(L,2,H,n*B,D)
views=block_views(S, out)
src=torch.randn(n*L*2*H*B*D); dst=torch.empty_like(src)
def best(f, r=7):
    b=1e9
    for _ in range(r):
        t=time.perf_counter(); f(); b=min(b,time.perf_counter()-t)
    return b*1e3
def r1():
    for i,h in enumerate(hashes): assert disk.read_into(h, ns, pool[i]).value=='ok'
def r2():
    for i,h in enumerate(hashes): assert disk.read_into_also(h, ns, pool[i], views[i]).value=='ok'
def g():
    out.view(L,2,H,n,B,D).copy_(pool.permute(1,2,3,0,4,5))
base=best(lambda: dst.copy_(src))
a=best(r1); b=best(r2); c=best(g)
assert torch.equal(out.view(L,2,H,n,B,D), blocks.permute(1,2,3,0,4,5))
print(f"n={n} base {base:.2f} ms read_into {a/base:.2f}x read_into_also {b/base:.2f}x gather {c/base:.2f}x  read+gather {(a+c)/base:.2f}x")
import shutil; shutil.rmtree(d)
import numpy as np, xxhash
from kvtier.records import parse_header, HEADER_NBYTES, check_record
def direct(value, v, rows=21):
    rec=parse_header(value, len(value))
    dg=rec.digest(value)
    src=torch.frombuffer(value, dtype=torch.float32, offset=HEADER_NBYTES).view(v.shape)
    srcb=np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)
    rb=rec.payload_nbytes//v.shape[0]
    for f in range(0, v.shape[0], rows):
        dg.update(srcb[f*rb:(f+rows)*rb])
        v[f:f+rows].copy_(src[f:f+rows])
    return check_record(rec, dg.intdigest(), None)
def r3(rows):
    with disk.env.begin(buffers=True) as txn:
        for i,h in enumerate(hashes):
            assert direct(txn.get(h), views[i], rows).value=='ok'
for rows in (5, 10, 21, 30):
    out.zero_()
    t=best(lambda: r3(rows))
    assert torch.equal(out.view(L,2,H,n,B,D), blocks.permute(1,2,3,0,4,5))
    print(f"direct rows={rows}: {t/base:.2f}x")
def hash_only():
    with disk.env.begin(buffers=True) as txn:
        for i,h in enumerate(hashes):
            xxhash.xxh3_64(txn.get(h))
print(f"hash only {best(hash_only)/base:.2f}x")
onp=out.numpy().reshape(L,2,H,n,B,D)
vnp=[onp[:,:,:,i] for i in range(n)]
def directnp(value, v, rows):
    rec=parse_header(value, len(value))
    dg=rec.digest(value)
    src=np.frombuffer(value, dtype=np.float32, offset=HEADER_NBYTES).reshape(v.shape)
    srcb=np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)
    rb=rec.payload_nbytes//v.shape[0]
    for f in range(0, v.shape[0], rows):
        dg.update(srcb[f*rb:(f+rows)*rb])
        np.copyto(v[f:f+rows], src[f:f+rows])
    return check_record(rec, dg.intdigest(), None)
def r4(rows):
    with disk.env.begin(buffers=True) as txn:
        for i,h in enumerate(hashes):
            assert directnp(txn.get(h), vnp[i], rows).value=='ok'
for rows in (10, 21, 30):
    out.zero_()
    t=best(lambda: r4(rows))
    assert torch.equal(out.view(L,2,H,n,B,D), blocks.permute(1,2,3,0,4,5))
    print(f"direct numpy rows={rows}: {t/base:.2f}x")
def r5():
    with disk.env.begin(buffers=True) as txn:
        for i,h in enumerate(hashes):
            v=txn.get(h)
            np.copyto(vnp[i], np.frombuffer(v, dtype=np.float32, offset=HEADER_NBYTES).reshape(vnp[i].shape))
print(f"copy only numpy, no hash: {best(r5)/base:.2f}x")
t=best(lambda: r3(30)); print(f"direct torch rows=30 again: {t/base:.2f}x; read_into again {best(r1)/base:.2f}x")
