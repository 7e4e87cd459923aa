"""The baseline itself on huge pages: one Tensor.copy_ of 45/90/180 MiB between torch.empty
tensors vs between host_empty (THP) tensors, interleaved, medians and bests of 15."""
import sys, time, statistics
sys.path.insert(0, "/work/main")
import torch
torch.set_num_threads(1)
from kvtier.tiers.host_memory import host_empty
for mib in (45, 90, 180):
    n = (mib << 20) // 4
    a, b = torch.empty(n).normal_(), torch.empty(n)
    c, d = host_empty(n, torch.float32).normal_(), host_empty(n, torch.float32)
    b.fill_(0); d.fill_(0)
    plain, huge = [], []
    for _ in range(15):
        t = time.perf_counter(); b.copy_(a); plain.append(time.perf_counter() - t)
        t = time.perf_counter(); d.copy_(c); huge.append(time.perf_counter() - t)
    print(f"{mib} MiB: THP copy / plain copy median {statistics.median(huge) / statistics.median(plain):.2f}x, "
          f"best {min(huge) / min(plain):.2f}x (plain best {min(plain) * 1e3:.2f} ms)", flush=True)
