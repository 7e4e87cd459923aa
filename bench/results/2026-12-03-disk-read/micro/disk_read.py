"""decode_into's two orders over a file mapping (LMDB's map is one), one thread, page cache warm:
old: copy 512 KiB pieces into the destination, hash each from there; new: hash each piece (up to
4 MiB) where it lies in the map, then one numpy copyto of it. Against a raw readinto of the same
bytes. Usage: python disk_read.py BLOCK_KIB  (prints best / median GB/s of 9 rounds)."""
import mmap, os, sys, tempfile, time

import numpy as np
import xxhash

B = int(sys.argv[1]) << 10
n = (256 << 20) // B
fd, path = tempfile.mkstemp(dir="/tmp")
os.write(fd, os.urandom(B) * n)
m = mmap.mmap(fd, B * n, prot=mmap.PROT_READ)
src = np.frombuffer(m, np.uint8)
dst = np.zeros((n, B), np.uint8)
f = open(path, "rb", buffering=0)


def raw():
    f.seek(0)
    for i in range(n):
        f.readinto(memoryview(dst[i]))


def old():
    for i in range(n):
        d, s, o = xxhash.xxh3_64(), src[i * B:(i + 1) * B], dst[i]
        for st in range(0, B, 512 << 10):
            c = o[st:st + (512 << 10)]
            np.copyto(c, s[st:st + (512 << 10)])
            d.update(c)
        d.intdigest()


def new():
    for i in range(n):
        d, s, o = xxhash.xxh3_64(), src[i * B:(i + 1) * B], dst[i]
        for st in range(0, B, 4 << 20):
            piece = s[st:st + (4 << 20)]
            d.update(piece)
            np.copyto(o[st:st + (4 << 20)], piece)
        d.intdigest()


fs = dict(raw=raw, old=old, new=new)
res = {k: [] for k in fs}
for _ in range(9):
    for k, g in fs.items():
        t = time.perf_counter()
        g()
        res[k].append(time.perf_counter() - t)
r = sorted(res["raw"])
for k, v in res.items():
    v.sort()
    print(f"block {B >> 10} KiB {k:4s} best {B * n / v[0] / 1e9:5.2f} GB/s, median {B * n / v[4] / 1e9:5.2f}"
          f" ({r[0] / v[0]:.2f}x / {r[4] / v[4]:.2f}x raw readinto)")
os.unlink(path)
