"""What one 2 MiB block costs the put's event loop per step (issue 17: copy on the loop or on a
thread?): the copy of 256 KiB received pieces into a slot of a 528 MiB pool (slots taken round
robin, as eviction reuses them: cold in cache), xxh3 of the same pieces, and one round trip to a
thread pool (run_in_executor of a no-op, the hand-off a copy on a thread would add per block).
Median of 200 blocks each, microseconds."""
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

BLOCK, PIECE, POOL = 2 << 20, 256 << 10, 264
pool = np.zeros((POOL, BLOCK), dtype=np.uint8)
pieces = [np.random.default_rng(i).integers(0, 255, PIECE, dtype=np.uint8).tobytes() for i in range(BLOCK // PIECE)]


def copy(slot):
    dst, off = pool[slot], 0
    for p in pieces:
        dst[off : off + len(p)] = np.frombuffer(p, dtype=np.uint8)
        off += len(p)


def hash_():
    d = xxhash.xxh3_64()
    for p in pieces:
        d.update(p)
    return d.intdigest()


def timed(fn, n=200):
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


for s in range(POOL):
    copy(s)  # first touch
print(f"copy 2 MiB (8 x 256 KiB pieces) into a cold slot: {timed(lambda i: copy((i * 37) % POOL)):.0f} us")
print(f"copy 2 MiB into the same slot (warm):            {timed(lambda i: copy(0)):.0f} us")
print(f"xxh3 of 2 MiB (8 pieces):                         {timed(lambda i: hash_()):.0f} us")


async def handoff():
    loop, ex = asyncio.get_running_loop(), ThreadPoolExecutor(2)
    out = []
    for _ in range(200):
        t0 = time.perf_counter()
        await loop.run_in_executor(ex, int)
        out.append(time.perf_counter() - t0)
    ex.shutdown()
    return statistics.median(out) * 1e6

print(f"thread round trip (run_in_executor):              {asyncio.run(handoff()):.0f} us")
