"""Where the daemon's put time goes (issue 17): a `kvtier serve` daemon (bench/server.py's
start_daemon, a pool of two rounds) and one RemoteTier putting 16 x 2 MiB blocks a call under
fresh hashes, two warm-up rounds, then ROUNDS rounds of 8 puts sampled by py-spy (native
frames off, idle off) into OUT (a speedscope/flame file, by its extension .svg or .txt:
--format raw, folded stacks). argv: OUT [ROUNDS]. PYTHONPATH=<tree>."""
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from bench.server import SPEC, NAMESPACE, start_daemon, stop  # noqa: E402
from kvtier.tiers.remote import RemoteTier  # noqa: E402

out, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12
torch.set_num_threads(1)
work = Path(tempfile.mkdtemp())
proc, url = start_daemon(work, cpu_bytes=2 * (256 << 20) + (16 << 20))
try:
    client = RemoteTier(url, timeout_s=10.0)
    client.register(NAMESPACE, SPEC)
    src = torch.randn((16, *SPEC.block_shape)).to(SPEC.dtype)

    def round_(r):
        for c in range(8):
            hs = [hashlib.sha256(f"{r}:{c}:{i}".encode()).digest() for i in range(16)]
            assert all(client.put(NAMESPACE, hs, list(src))), dict(client.errors)

    round_(0), round_(1)
    fmt = "raw" if out.endswith(".txt") else "flamegraph"
    spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-p", str(proc.pid), "-o", out, "-r", "500", "-f", fmt,
                            "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    for r in range(2, 2 + rounds):
        round_(r)
    spy.send_signal(2)
    spy.wait(30)
    client.close()
finally:
    stop(proc)
