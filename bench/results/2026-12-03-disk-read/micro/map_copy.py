"""One thread copying 256 MiB in pieces of 512 KiB or 2 MiB: numpy copyto (glibc memmove) vs torch
copy_ (its own vectorized loop), out of a file mapping (page cache, 4 KiB pages) into anonymous
memory, and from anonymous memory into the mapping. Prints best / median GB/s of 7 rounds."""
import ctypes, mmap, os, tempfile, time

import numpy as np
import torch

torch.set_num_threads(1)
N = 256 << 20
fd, path = tempfile.mkstemp(dir="/tmp")
os.write(fd, os.urandom(2 << 20) * (N >> 21))
m = mmap.mmap(fd, N)
msrc = np.frombuffer(m, np.uint8)
tm = torch.frombuffer((ctypes.c_ubyte * N).from_address(msrc.ctypes.data), dtype=torch.uint8)
anon, dst = np.ones(N, np.uint8), np.zeros(N, np.uint8)
ta, td = torch.from_numpy(anon), torch.from_numpy(dst)


def pieces(d, s, size, torch_copy):
    def run():
        for st in range(0, N, size):
            if torch_copy:
                d[st:st + size].copy_(s[st:st + size])
            else:
                np.copyto(d[st:st + size], s[st:st + size])
    return run


fs = {}
for size in (512 << 10, 2 << 20):
    k = f"{size >> 10:5d} KiB"
    fs[f"map -> anon, numpy {k}"] = pieces(dst, msrc, size, False)
    fs[f"map -> anon, torch {k}"] = pieces(td, tm, size, True)
    fs[f"anon -> map, numpy {k}"] = pieces(msrc, anon, size, False)
    fs[f"anon -> map, torch {k}"] = pieces(tm, ta, size, True)
res = {k: [] for k in fs}
for _ in range(7):
    for k, g in fs.items():
        t = time.perf_counter()
        g()
        res[k].append(time.perf_counter() - t)
for k, v in res.items():
    v.sort()
    print(f"{k}: best {N / v[0] / 1e9:5.2f} GB/s, median {N / v[3] / 1e9:5.2f}")
os.unlink(path)
