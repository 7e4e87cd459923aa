"""``DiskTier.read_into_views`` of a 1k-token DISK hit's blocks into the hit buffer's views, one
thread, against one torch copy of the same bytes (``python read_into_views.py ab``): kvtier's
call; the same hash and copy written inline on LMDB's records ("alt"); the same from a second,
plain read-only mapping of data.mdb ("plain map"). ``python read_into_views.py python``: the
Python per block alone (record checks, views), timed per call with ``timeit``."""
import mmap
import os
import sys
import timeit
from pathlib import Path

import numpy as np
import torch
import xxhash

from _common import best, disk_hit_setup

import kvtier.records as R  # noqa: E402
from kvtier.records import HEADER_NBYTES, _header_for  # noqa: E402

what = sys.argv[1] if len(sys.argv) > 1 else "ab"
s = disk_hit_setup(1024)
disk, ns, hashes, fps, n = s.disk, s.ns, s.hashes, s.fps, s.n
views = s.views_of()


def kvtier_read():
    statuses = disk.read_into_views(hashes, ns, views, fps)
    assert all(st.value == "ok" for st in statuses)


def alt(dst_views):  # the hash and the copy inline, on LMDB's records
    with disk.env.begin(buffers=True) as txn:
        for h, v in zip(hashes, dst_views):
            value = txn.get(h)
            src = np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)
            d = v.view(torch.uint8).numpy()
            xxhash.xxh3_64_intdigest(src)
            np.copyto(d, src.reshape(d.shape))


if what == "ab":
    path = Path(disk.path) / "data.mdb"
    fh = open(path, "rb")
    plain = np.frombuffer(mmap.mmap(fh.fileno(), os.path.getsize(path), prot=mmap.PROT_READ), dtype=np.uint8)
    maps = [line for line in open("/proc/self/maps") if str(path) in line]
    print(maps)
    lmdb_start = min(int(line.split("-")[0], 16) for line in maps if "rw" in line.split()[1])
    offsets = []
    with disk.env.begin(buffers=True) as txn:
        for h in hashes:
            offsets.append(np.frombuffer(txn.get(h), dtype=np.uint8).ctypes.data - lmdb_start + HEADER_NBYTES)
    print("payload offsets mod 4096:", sorted({o % 4096 for o in offsets}))
    nbytes = views[0].numel() * 4

    def plain_map(dst_views):
        for o, v in zip(offsets, dst_views):
            src = plain[o : o + nbytes]
            d = v.view(torch.uint8).numpy()
            xxhash.xxh3_64_intdigest(src)
            np.copyto(d, src.reshape(d.shape))

    for _ in range(8):
        c = best(lambda: s.dst.copy_(s.src))
        print(f"copy {c*1e3:.2f}; kvtier {best(kvtier_read)/c:.2f}x; alt (lmdb map) {best(lambda: alt(views))/c:.2f}x; "
              f"plain map into sinks {best(lambda: plain_map(views))/c:.2f}x")
else:
    with disk.env.begin(buffers=True) as txn:
        value, v = txn.get(hashes[3]), views[3]
        rec = _header_for(value, ns, v)
        for name, stmt in [
            ("view.numpy", lambda: v.view(torch.uint8).numpy()),
            ("_header_for", lambda: _header_for(value, ns, v)),
            ("parse_header", lambda: R.parse_header(value, len(value))),
            ("digest", lambda: rec.digest(value)),
            ("frombuffer", lambda: np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)),
            ("txn.get", lambda: txn.get(hashes[3])),
            ("tuple(shape)+numel+esize+dtype", lambda: (tuple(v.shape), v.numel() * v.element_size(), R.DTYPE_NAMES.get(v.dtype))),
        ]:
            print(f"{name}: {timeit.timeit(stmt, number=2000) / 2000 * 1e6:.2f} us")
s.close()
