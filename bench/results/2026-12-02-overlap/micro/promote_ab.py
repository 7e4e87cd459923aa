"""A/B of where a DISK hit's promotions run (kvtier.transfer.handlers.DiskHandler.start): the
reads into the top pool behind the hit buffer's deliveries, released by the DeliveryGate at the
prefix's last delivery. "one thread" (shipped): they go to the I/O pool as one task and run
one after another there (in 8ec58db: inline on the thread of the last delivery, logged in the
first part of promote_ab.log); "both threads" (before): each is submitted to the store's I/O
executor on its own, so both I/O threads take them while the caller finishes the hit. Interleaved pairs in one
process, SmolLM2-135M (bench/hit_path.py's DISK case); prints before_prefill and the time until
every block is promoted (finish_loads), each over one torch copy of the same bytes timed just
before it: best three and median.

    LEN=1024 python bench/results/2026-12-02-overlap/micro/promote_ab.py [pairs]
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "2026-12-02-floors" / "micro"))
from _common import disk_hit_setup  # noqa: E402

from kvtier.transfer.engine import DeliveryGate  # noqa: E402

s = disk_hit_setup(int(os.environ.get("LEN", "1024")))
kv, p, src, dst = s.kv, s.prompt, s.src, s.dst
executor = kv.store._executor
arrive = DeliveryGate.arrive
mode = {"both": False}


def arrive_ab(self, then=None, run=None):  # "both threads": hand each held promotion to the I/O executor
    if then is not None and mode["both"]:
        inline = then
        then = lambda: executor.submit(inline)  # noqa: E731
    return arrive(self, then, run)


DeliveryGate.arrive = arrive_ab
pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
hit: dict[bool, list[float]] = {False: [], True: []}
promoted: dict[bool, list[float]] = {False: [], True: []}
for i in range(2 * pairs):
    both = bool(i % 2)
    mode["both"] = both
    kv.finish_loads()
    kv.store.top.clear()
    t = time.perf_counter()
    dst.copy_(src)
    copy = time.perf_counter() - t
    t0 = time.perf_counter()
    plan = kv.before_prefill(p.ids)
    t1 = time.perf_counter()
    kv.finish_loads()
    t2 = time.perf_counter()
    assert plan.num_cached_tokens == p.length, plan.num_cached_tokens
    hit[both].append((t1 - t0) / copy)
    promoted[both].append((t2 - t0) / copy)
    del plan
print(f"{p.length} tokens, {pairs} pairs (ratios to one copy of the prefix's bytes)")
for both in (True, False):
    v = sorted(hit[both])
    print(f"{'both threads' if both else 'one thread  '}: before_prefill best3 {[round(x, 2) for x in v[:3]]} "
          f"median {statistics.median(v):.2f} | until promoted median {statistics.median(promoted[both]):.2f}")
s.close()
