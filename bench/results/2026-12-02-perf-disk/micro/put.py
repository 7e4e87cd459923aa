import sys, time, ctypes, hashlib, os, shutil, pathlib, threading
sys.path.insert(0, "/work/wt/disk")
import numpy as np, torch, xxhash, lmdb
from kvtier.tiers.disk import DiskTier, record_footprint
from kvtier.records import encode_record, _pack_header, HEADER_NBYTES, _HEADER, _CHECKSUM, decode_into, ReadStatus
from bench.common import raw_write
N = 128; NB = 2 << 20; B = 32
src = torch.randint(0, 255, (N, NB), dtype=torch.uint8)
d = "/tmp/diskexp/p"; shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
cap = N * record_footprint(NB) + (1<<20)
env = lmdb.open(d, map_size=cap + cap//4 + (64<<20), writemap=True, sync=False, metasync=False, max_dbs=0)
ns = b"n" * 32
tag = [0]
def keys():
    tag[0] += 1
    return [hashlib.sha256(f"{tag[0]}:{i}".encode()).digest() for i in range(N)]
state = {"hs": []}
def clear():
    with env.begin(write=True) as txn:
        for h in state["hs"]: txn.delete(h)
    state["hs"] = keys()
def cur():
    hs = state["hs"]
    for i in range(0, N, B):
        with env.begin(write=True) as txn:
            for j in range(i, i+B):
                txn.put(hs[j], encode_record(ns, src[j], j, hs[j]))
buf = np.empty(HEADER_NBYTES + NB, dtype=np.uint8)
def reuse():
    hs = state["hs"]
    for i in range(0, N, B):
        with env.begin(write=True) as txn:
            for j in range(i, i+B):
                header = _pack_header(ns, src[j], j, hs[j])
                buf[:_HEADER.size] = np.frombuffer(header, np.uint8)
                dig = xxhash.xxh3_64(header)
                s = src[j].numpy(); dst = buf[HEADER_NBYTES:]
                for k in range(0, NB, 1<<20):
                    c = dst[k:k+(1<<20)]; np.copyto(c, s[k:k+(1<<20)]); dig.update(c)
                buf[_HEADER.size:HEADER_NBYTES] = np.frombuffer(_CHECKSUM.pack(dig.intdigest()), np.uint8)
                txn.put(hs[j], buf)
zero = np.zeros(HEADER_NBYTES + NB, dtype=np.uint8)
def reserve():
    hs = state["hs"]
    for i in range(0, N, B):
        with env.begin(write=True, buffers=True) as txn:
            for j in range(i, i+B):
                txn.put(hs[j], zero)
                v = txn.get(hs[j])
                addr = np.frombuffer(v, np.uint8).ctypes.data
                out = np.ctypeslib.as_array((ctypes.c_uint8 * len(v)).from_address(addr))
                header = _pack_header(ns, src[j], j, hs[j])
                out[:_HEADER.size] = np.frombuffer(header, np.uint8)
                dig = xxhash.xxh3_64(header)
                s = src[j].numpy(); dst = out[HEADER_NBYTES:]
                for k in range(0, NB, 1<<20):
                    c = dst[k:k+(1<<20)]; np.copyto(c, s[k:k+(1<<20)]); dig.update(c)
                out[_HEADER.size:HEADER_NBYTES] = np.frombuffer(_CHECKSUM.pack(dig.intdigest()), np.uint8)
def payload_only():
    hs = state["hs"]
    for i in range(0, N, B):
        with env.begin(write=True) as txn:
            for j in range(i, i+B):
                xxhash.xxh3_64_intdigest(src[j].numpy())
                txn.put(hs[j], src[j].numpy())
def nohash_put():
    hs = state["hs"]
    for i in range(0, N, B):
        with env.begin(write=True) as txn:
            for j in range(i, i+B):
                txn.put(hs[j], src[j].numpy())
flat = torch.randint(0, 255, (N * NB + 4096,), dtype=torch.uint8)
src2 = flat[4096:].view(N, NB)
def shifted():
    hs = state["hs"]
    for i in range(0, N, B):
        with env.begin(write=True, buffers=True) as txn:
            for j in range(i, i+B):
                blk = src2[j]
                val = (ctypes.c_uint8 * (NB + HEADER_NBYTES)).from_address(blk.data_ptr() - HEADER_NBYTES)
                txn.put(hs[j], val)
                v = txn.get(hs[j])
                addr = np.frombuffer(v, np.uint8).ctypes.data
                out = np.ctypeslib.as_array((ctypes.c_uint8 * len(v)).from_address(addr))
                header = _pack_header(ns, blk, j, hs[j])
                out[:_HEADER.size] = np.frombuffer(header, np.uint8)
                dig = xxhash.xxh3_64(out[:_HEADER.size]); dig.update(out[HEADER_NBYTES:])
                out[_HEADER.size:HEADER_NBYTES] = np.frombuffer(_CHECKSUM.pack(dig.intdigest()), np.uint8)
                if j == 5:
                    assert bytes(v) == encode_record(ns, blk, j, hs[j]).tobytes()
def shifted2():
    hs = state["hs"]
    for i in range(0, N, B):
        with env.begin(write=True, buffers=True) as txn:
            for j in range(i, i+B):
                blk = src2[j]
                header = _pack_header(ns, blk, j, hs[j])
                dig = xxhash.xxh3_64(header); dig.update(blk.numpy())
                val = (ctypes.c_uint8 * (NB + HEADER_NBYTES)).from_address(blk.data_ptr() - HEADER_NBYTES)
                txn.put(hs[j], val)
                v = txn.get(hs[j])
                out = (ctypes.c_uint8 * HEADER_NBYTES).from_address(np.frombuffer(v, np.uint8).ctypes.data)
                ctypes.memmove(out, header + _CHECKSUM.pack(dig.intdigest()), HEADER_NBYTES)
                if j == 5:
                    assert bytes(v) == encode_record(ns, blk, j, hs[j]).tobytes()
from concurrent.futures import ThreadPoolExecutor
ex = ThreadPoolExecutor(1)
def _hdr(j, blk, h):
    header = _pack_header(ns, blk, j, h)
    dig = xxhash.xxh3_64(header); dig.update(blk.numpy())
    return header + _CHECKSUM.pack(dig.intdigest())
def shifted_par():
    hs = state["hs"]
    for i in range(0, N, B):
        with env.begin(write=True, buffers=True) as txn:
            fut = ex.submit(_hdr, i, src2[i], hs[i])
            for j in range(i, i+B):
                blk = src2[j]
                hdr = fut.result()
                if j + 1 < i + B: fut = ex.submit(_hdr, j + 1, src2[j + 1], hs[j + 1])
                val = (ctypes.c_uint8 * (NB + HEADER_NBYTES)).from_address(blk.data_ptr() - HEADER_NBYTES)
                txn.put(hs[j], val)
                v = txn.get(hs[j])
                out = (ctypes.c_uint8 * HEADER_NBYTES).from_address(np.frombuffer(v, np.uint8).ctypes.data)
                ctypes.memmove(out, hdr, HEADER_NBYTES)
                if j == 5:
                    assert bytes(v) == encode_record(ns, blk, j, hs[j]).tobytes()
def raw():
    raw_write(pathlib.Path("/tmp/diskexp/raw.bin"), src, B)
def noop(): pass
def t(f, pre, n=4):
    best = 1e9
    for _ in range(n):
        pre(); t0 = time.perf_counter(); f(); best = min(best, time.perf_counter() - t0)
    return N * NB / best / 1e9
for name in sys.argv[1:]:
    print(name, round(t(globals()[name], noop if name == "raw" else clear), 2), flush=True)
