from _common import best
import torch, time, xxhash, numpy as np
torch.set_num_threads(1)
B=2<<20; n=128
src=torch.empty(n*B//4).normal_().view(n,-1); dst=torch.empty_like(src); dst.zero_()
def h(t): return xxhash.xxh3_64_intdigest(memoryview(t.numpy()).cast('B'))
def hash_then_copy():
    for i in range(n): h(src[i]); dst[i].copy_(src[i])
def copy_then_hash_src():
    for i in range(n): dst[i].copy_(src[i]); h(src[i])
def copy_then_hash_dst():
    for i in range(n): dst[i].copy_(src[i]); h(dst[i])
def copy_only():
    for i in range(n): dst[i].copy_(src[i])
for _ in range(2):
    print(" ".join(f"{f.__name__} {best(f)*1e3:.1f}" for f in (copy_only, hash_then_copy, copy_then_hash_src, copy_then_hash_dst)))
