"""Cold reads of one raw file: readinto 64 MiB (the bench's baseline) vs preadv in chunks (+ xxh3)."""
import os, pathlib, sys, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))
import numpy as np, torch, xxhash
from bench.common import raw_read, raw_write, drop_page_cache, io_read_bytes
N = 128; NB = 2 << 20
src = torch.randint(0, 255, (N, NB), dtype=torch.uint8); dst = torch.empty_like(src)
p = pathlib.Path(os.environ.get("DIR", "/tmp")) / "disk3-filecold.bin"; raw_write(p, src, 32)
def preadv(chunk, hash_=True, gap=0):
    fd = os.open(p, os.O_RDONLY); flat = dst.view(-1).numpy()
    try:
        for j in range(N):
            h = xxhash.xxh3_64()
            for s in range(0, NB, chunk):
                c = flat[j * NB + s : j * NB + s + chunk]
                assert os.preadv(fd, [c], j * NB + s) == len(c)
                if hash_: h.update(c)
    finally:
        os.close(fd)
modes = {"raw": lambda: raw_read(p, dst, 32), "p512h": lambda: preadv(512 << 10), "p2mh": lambda: preadv(2 << 20),
         "p512": lambda: preadv(512 << 10, False), "p2m": lambda: preadv(2 << 20, False), "p8mh": lambda: preadv(8 << 20)}
for rep in range(int(os.environ.get("REPS", 3))):
    out = []
    for m in sys.argv[1:]:
        drop_page_cache([p]); r0 = io_read_bytes(); t0 = time.perf_counter(); modes[m]()
        out.append(f"{m}={N * NB / (time.perf_counter() - t0) / 1e9:.2f}({(io_read_bytes() - r0) / (N * NB):.0%})")
    print(" ".join(out), f"load={os.getloadavg()[0]:.2f}", flush=True)
p.unlink()
