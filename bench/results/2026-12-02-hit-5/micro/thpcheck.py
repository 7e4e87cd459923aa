import mmap, torch
HUGE = 2 << 20
n = 256 << 20
m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
t = torch.frombuffer(m, dtype=torch.uint8)
off = (-t.data_ptr()) % HUGE
m.madvise(mmap.MADV_HUGEPAGE, off, n)
t[off:off + n].fill_(1)
addr = t.data_ptr()
cur = None
for line in open("/proc/self/smaps"):
    if "-" in line.split()[0] and len(line.split()[0]) > 10 and not line.split()[0].endswith(":"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        cur = lo <= addr < hi
    elif cur and line.startswith(("AnonHugePages", "Rss", "THPeligible")):
        print(line.strip())
