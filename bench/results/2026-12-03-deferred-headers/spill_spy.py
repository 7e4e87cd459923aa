import os, sys, time, tempfile, subprocess
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
torch.set_num_threads(1)
from bench.transfers import _store, SPEC, NAMESPACE
from kvtier.hashing import block_hashes_for
n = (512 << 20) // SPEC.block_nbytes
root = Path(tempfile.mkdtemp(dir=os.environ.get("DIR", "/tmp")))
store = _store(root / "kv", n, 2)
blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
def hs(r): return block_hashes_for(list(range(r * 10**6, r * 10**6 + n * 16)), NAMESPACE, 16)
pre = [hs(r) for r in range(40)]
for r in range(6): store.store(pre[r], blocks)
spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-r", "2000", "-f", "raw", "-t", "-o", sys.argv[1], "-p", str(os.getpid()), "--nonblocking"])
time.sleep(1.0)
t0 = time.perf_counter(); k = 0
for r in range(6, 30):
    store.store(pre[r], blocks); k += 1
dt = time.perf_counter() - t0
spy.send_signal(2); spy.wait()
print(f"GB/s {k * n * SPEC.block_nbytes / dt / 1e9:.2f}")
store.close()
import shutil; shutil.rmtree(root)
