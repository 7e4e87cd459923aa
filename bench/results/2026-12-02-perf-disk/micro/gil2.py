import torch, time, threading, numpy as np
torch.set_num_threads(1)
a=torch.randint(0,255,(64,2<<20),dtype=torch.uint8); d=torch.empty_like(a); c=a.clone(); e=torch.empty_like(a)
def f1():
    for i in range(64): d[i].copy_(a[i])
def f2():
    for i in range(64): e[i].copy_(c[i])
def g1(): d.copy_(a)
def g2(): e.copy_(c)
def n1():
    for i in range(64): np.copyto(d[i].numpy(), a[i].numpy())
def n2():
    for i in range(64): np.copyto(e[i].numpy(), c[i].numpy())
def tm(*fs):
    best=1e9
    for _ in range(5):
        t=time.perf_counter(); ths=[threading.Thread(target=f) for f in fs[1:]]; [x.start() for x in ths]; fs[0](); [x.join() for x in ths]; best=min(best,time.perf_counter()-t)
    return round(best*1e3,1)
print("f1", tm(f1), "f1||f2", tm(f1,f2), "g1", tm(g1), "g1||g2", tm(g1,g2), "n1", tm(n1), "n1||n2", tm(n1,n2))
