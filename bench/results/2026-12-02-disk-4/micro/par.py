import time, torch, xxhash, numpy as np, threading
from concurrent.futures import ThreadPoolExecutor
torch.set_num_threads(1)
B=2<<20; n=32
src=torch.randn(n, B//4); pool=torch.randn(n, B//4); victims=torch.randn(n,B//4)
mapbuf=np.empty((n,B),np.uint8); mapbuf[:]=1
ex=ThreadPoolExecutor(1)
def copyin(lo,hi):
    for i in range(lo,hi): pool[i].copy_(src[i])
def spill(lo,hi):
    for i in range(lo,hi):
        v=victims[i].numpy().view(np.uint8)
        xxhash.xxh3_64_intdigest(v); np.copyto(mapbuf[i], v)
def seq():
    spill(0,n); copyin(0,n)
def pipe(parts):
    step=n//parts
    f=ex.submit(spill,0,step)
    for p in range(parts):
        f.result()
        if p+1<parts: f=ex.submit(spill,(p+1)*step,(p+2)*step)
        copyin(p*step,(p+1)*step)
def t(f, r=7):
    best=[]; 
    for _ in range(r):
        t0=time.perf_counter(); f(); best.append(time.perf_counter()-t0)
    best.sort(); return best[0]*1e3, best[len(best)//2]*1e3
for _ in range(2):
    print("seq %.1f/%.1f  copyin %.1f/%.1f spill %.1f/%.1f" % (*t(seq), *t(lambda: copyin(0,n)), *t(lambda: spill(0,n))))
    for parts in (2,4,8):
        print(" pipe%d %.1f/%.1f" % (parts, *t(lambda: pipe(parts))))
