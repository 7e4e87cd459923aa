import ctypes
from kvtier.records import _header_for, check_record
libc = ctypes.CDLL(None, use_errno=True)
libc.preadv.restype = ctypes.c_ssize_t
libc.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
_p = os.path.realpath(os.path.join(disk.env.path(), "data.mdb"))
map_addr = min(int(l.split("-")[0], 16) for l in open("/proc/self/maps") if l.rstrip().endswith(_p) and int(l.split()[2], 16) == 0)
fd = os.open(os.path.join(disk.env.path(), "data.mdb"), os.O_RDONLY)
# iovecs per block: dst pieces (l,kv,h) of 4 KiB, in record order
def iov_for(v):
    d = v.view(torch.uint8)
    base = d.data_ptr()
    st = d.stride()  # bytes
    L, KV, H = d.shape[:3]
    piece = d.shape[3] * d.shape[4]
    addr = (base + np.arange(L)[:, None, None] * st[0] + np.arange(KV)[None, :, None] * st[1] + np.arange(H)[None, None, :] * st[2]).reshape(-1)
    iov = np.empty((addr.size, 2), dtype=np.uint64); iov[:, 0] = addr; iov[:, 1] = piece
    return iov
iovs = [iov_for(v) for v in views]
def addr_of(value):
    return np.frombuffer(value, np.uint8).ctypes.data
def pread_only():
    with disk.env.begin(buffers=True) as txn:
        for h, iov in zip(hashes, iovs):
            value = txn.get(h)
            off = addr_of(value) - map_addr + HEADER_NBYTES
            r = libc.preadv(fd, iov.ctypes.data, iov.shape[0], off)
            assert r == len(value) - HEADER_NBYTES, (r, ctypes.get_errno())
def hash_then_pread():
    with disk.env.begin(buffers=True) as txn:
        for h, v, f, iov in zip(hashes, views, fps, iovs):
            value = txn.get(h)
            record = _header_for(value, ns, v)
            digest = record.digest(value)
            digest.update(value[HEADER_NBYTES:])
            off = addr_of(value) - map_addr + HEADER_NBYTES
            r = libc.preadv(fd, iov.ctypes.data, iov.shape[0], off)
            assert check_record(record, digest.intdigest(), f).value == "ok"
def chunked(rows_per):
    def run():
        with disk.env.begin(buffers=True) as txn:
            for h, v, f, iov in zip(hashes, views, fps, iovs):
                value = txn.get(h)
                record = _header_for(value, ns, v)
                digest = record.digest(value)
                src = np.frombuffer(value, np.uint8, offset=HEADER_NBYTES)
                off = addr_of(value) - map_addr + HEADER_NBYTES
                n = iov.shape[0]; piece = int(iov[0, 1])
                for i in range(0, n, rows_per):
                    digest.update(src[i * piece:(i + rows_per) * piece])
                    libc.preadv(fd, iov[i:].ctypes.data, min(rows_per, n - i), off + i * piece)
                assert check_record(record, digest.intdigest(), f).value == "ok"
    return run
EXTRA = {"pread_only": pread_only, "hash+pread": hash_then_pread, "chunk24": chunked(24), "chunk60": chunked(60), "chunk180": chunked(180)}
