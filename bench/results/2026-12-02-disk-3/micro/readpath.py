"""Warm and cold DISK reads: map copy (main) vs preadv (this branch) vs raw readinto.
usage: readpath.py MODE... (map, pread, auto, raw; suffix _cold: after a page-cache drop). Env REPS, DIR."""
import hashlib, os, pathlib, shutil, sys, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))
import torch
from kvtier.tiers.disk import DiskTier, record_footprint, _MappedFile
from kvtier.records import ReadStatus
from bench.common import raw_read, raw_write, drop_page_cache, io_read_bytes
N = 128; NB = 2 << 20
src = torch.randint(0, 255, (N, NB), dtype=torch.uint8); dst = torch.empty_like(src)
root = pathlib.Path(os.environ.get("DIR", "/tmp")) / "disk3-readpath"; shutil.rmtree(root, ignore_errors=True)
d = root / "c"; cap = N * record_footprint(NB) + (1 << 20)
disk = DiskTier(d, cap); ns = b"n" * 32
hs = [hashlib.sha256(str(i).encode()).digest() for i in range(N)]
for i in range(0, N, 32):
    disk.write_batch([(h, ns, src[j], h) for j, h in list(enumerate(hs))[i:i + 32]])
rawp = root / "raw.bin"; raw_write(rawp, src, 32)
orig = _MappedFile.cold_offset
def setmode(m):  # map: main's path; pread: the file whatever is cached; auto: this branch
    _MappedFile.cold_offset = {"map": lambda self, k, v: None, "pread": lambda self, k, v: self.offset_of(v), "auto": orig}[m]
def get():
    for j, h in enumerate(hs):
        assert disk.read_into(h, ns, dst[j], h) is ReadStatus.OK
def reopen():
    global disk
    disk.close(); drop_page_cache([d]); disk = DiskTier(d, cap)
def run(name):
    cold = name.endswith("_cold"); mode = name.removesuffix("_cold")
    if mode == "raw":
        if cold: drop_page_cache([rawp])
        t0 = time.perf_counter(); raw_read(rawp, dst, 32); return time.perf_counter() - t0
    setmode(mode)
    if cold: reopen()
    dst.zero_()
    t0 = time.perf_counter(); get(); t = time.perf_counter() - t0
    assert torch.equal(dst, src)
    return t
get()
for rep in range(int(os.environ.get("REPS", 3))):
    out = []
    for n in sys.argv[1:]:
        r0 = io_read_bytes(); t = run(n); out.append(f"{n}={N * NB / t / 1e9:.2f}({(io_read_bytes() - r0) / (N * NB):.0%})")
    print(" ".join(out), f"load={os.getloadavg()[0]:.2f}", flush=True)
disk.close(); shutil.rmtree(root, ignore_errors=True)
