"""Batch put A/B (issue 17): a `kvtier serve` daemon (bench/server.py's start_daemon) and one
RemoteTier putting 16 x 2 MiB blocks a call under fresh hashes: GB/s per round (wall clock
of 8 calls), daemon CPU per GB, client CPU per GB. argv: [ROUNDS]. Run it from the tree to measure
(PYTHONPATH=<tree>). Round four: the pool holds two rounds (+16 MiB) and two rounds warm up, as in
bench/server.py, so timed rounds evict and reuse memory (no first-touch page faults; the third
round's put_ab.py had a 1 GiB pool, so 3 of its 6 timed rounds first-touched it). argv[2], when
given: --disk-bytes of the daemon (a DISK tier under the pool: the direct put's store calls
then run on a registry thread, and evictions spill to DISK)."""
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from bench.server import SPEC, NAMESPACE, process_cpu_s, start_daemon, stop  # noqa: E402
from kvtier.tiers.remote import RemoteTier  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
if len(sys.argv) > 2:  # the daemon with a DISK tier: bench.server starts it with --disk-bytes 0
    import subprocess
    _popen = subprocess.Popen

    def _with_disk(args, *a, **k):
        if "--disk-bytes" in args:
            args = list(args)
            args[args.index("--disk-bytes") + 1] = sys.argv[2]
        return _popen(args, *a, **k)

    subprocess.Popen = _with_disk
torch.set_num_threads(1)
work = Path(tempfile.mkdtemp())
proc, url = start_daemon(work, cpu_bytes=2 * (256 << 20) + (16 << 20))
try:
    client = RemoteTier(url, timeout_s=10.0)
    client.register(NAMESPACE, SPEC)
    src = torch.randn((16, *SPEC.block_shape)).to(SPEC.dtype)
    nbytes = 8 * src.numel() * src.element_size()
    rates = []
    for r in range(rounds + 2):
        hs = [[hashlib.sha256(f"{r}:{c}:{i}".encode()).digest() for i in range(16)] for c in range(8)]
        s0, c0, t0 = process_cpu_s(proc.pid), time.process_time(), time.perf_counter()
        for c in range(8):
            assert all(client.put(NAMESPACE, hs[c], list(src))), dict(client.errors)
        wall = time.perf_counter() - t0
        if r >= 2:  # two rounds warm up (fill the pool)
            rates.append((nbytes / wall / 1e9, (process_cpu_s(proc.pid) - s0) / nbytes * 1e12,
                          (time.process_time() - c0) / nbytes * 1e12))
    rates.sort()
    for gbs, s, c in rates:
        print(f"  {gbs:.2f} GB/s  server {s:.0f} ms CPU/GB  client {c:.0f} ms CPU/GB")
    print(f"median {rates[len(rates) // 2][0]:.2f} GB/s best {rates[-1][0]:.2f} GB/s")
    client.close()
finally:
    stop(proc)
