import hashlib, os, sys, tempfile, time, subprocess
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
from bench.server import NAMESPACE, SPEC, start_daemon, stop
from kvtier.tiers.remote import RemoteTier
secs = float(sys.argv[1]); out = sys.argv[2]
work = Path(tempfile.mkdtemp())
proc, url = start_daemon(work, cpu_bytes=256 << 20)
client = RemoteTier(url, timeout_s=10.0)
client.register(NAMESPACE, SPEC)
hs = [hashlib.sha256(f"{i}".encode()).digest() for i in range(32)]
client.put(NAMESPACE, hs[:16], list(torch.zeros((16, *SPEC.block_shape), dtype=SPEC.dtype)))
for _ in range(200): client.lookup(NAMESPACE, hs)
spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-p", str(proc.pid), "-d", str(int(secs)), "-f", "raw", "-o", out, "-r", "500"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
t0 = time.perf_counter(); n = 0
while time.perf_counter() - t0 < secs + 1:
    assert client.lookup(NAMESPACE, hs) == 16; n += 1
print(n / (time.perf_counter() - t0), "lookups/s")
spy.wait(); stop(proc)
