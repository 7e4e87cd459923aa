"""Prototype: MADV_POPULATE_WRITE the map's tail before each write txn (monkeypatch)."""
import ctypes, os
import kvtier.tiers.disk as D
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
def map_base(disk):
    ino = os.stat(disk.path / "data.mdb").st_ino
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[1].startswith("rw") and int(parts[4]) == ino and parts[5].endswith("data.mdb"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                found.append((lo, hi))
    assert len(found) == 1, found
    return found[0]
orig = D.DiskTier._write_batch
def patched(self, puts, deletes, evicted, after_put=None):
    if puts:
        if not hasattr(self, "_mb"):
            self._mb = map_base(self); self._hwm = 0
        lo, hi = self._mb
        need = sum(self.footprint(p[2].numel() * p[2].element_size()) for p in puts)
        end = (self.env.info()["last_pgno"] + 1) * self.page_nbytes
        start = max(end, self._hwm)
        stop = min(end + need, hi - lo)
        if stop > start:
            r = libc.madvise(lo + start, stop - start, 23)
            assert r == 0, ctypes.get_errno()
            self._hwm = stop
    return orig(self, puts, deletes, evicted, after_put)
def install():
    D.DiskTier._write_batch = patched
