"""Same process: transfers.py's store()-into-full-slab case vs tiers.py's DISK-spill case vs raw write, alternating."""
import sys, os, shutil, tempfile, itertools
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from bench import transfers as X, tiers as T
from bench.common import prime_raw_file, raw_write, Case, measure
from kvtier.hashing import block_hashes_for
torch.set_num_threads(1)
n = int(sys.argv[1]); reps = int(sys.argv[2])
root = Path(tempfile.mkdtemp(prefix="t3-", dir="/tmp/grow"))
# transfers' setup
hashes = block_hashes_for(list(range(n * 16)), X.NAMESPACE, 16)
blocks = torch.randn((n, *X.SPEC.block_shape)).to(X.SPEC.dtype)
xs = X._store(root / "kv", n, 2); cpu = xs.top
xs.store(hashes, blocks); xs.flush()
spill_hashes = block_hashes_for(list(range(10**6, 10**6 + n * 16)), X.NAMESPACE, 16)
def fill_slab():
    cpu.clear(); xs.disk.remove(hashes + spill_hashes); xs.store(hashes, blocks)
def x_store():
    assert xs.store(spill_hashes, blocks) == n
# tiers' setup
src = T.make_blocks(n)
b = T.Bench(n, 32, 32, reps, "median", torch.device("cpu"), root / "t", src, torch.empty_like(src), torch.empty_like(src))
(root / "t").mkdir()
ts = b.store(cpu_blocks=n, disk_blocks=2 * n); disk = ts.disk
state = {"hashes": b.fresh_chain()}
T.put_requests(ts, state["hashes"], b.src, 32, b.fingerprints)
def before_spill():
    disk.remove(list(disk.lru_order())); state["hashes"] = b.fresh_chain()
def t_store():
    T.put_requests(ts, state["hashes"], b.src, 32, b.fingerprints)
raw = prime_raw_file(root / "raw.bin", blocks, 32)
tx, tt, w = measure([Case(x_store, fill_slab), Case(t_store, before_spill), Case(lambda: raw_write(raw, blocks, 32))], reps)
nb = n * X.SPEC.block_nbytes
for name, t in (("transfers' case", tx), ("tiers' case", tt), ("raw write", w)):
    print(f"{name:16s} best {nb/t.best_s/1e9:.2f} median {nb/t.median_s/1e9:.2f} GB/s  ratio best {w.best_s/t.best_s:.2f}x median {w.median_s/t.median_s:.2f}x  runs {' '.join(f'{nb/s/1e9:.2f}' for s in t.samples_s)}")
xs.close(); ts.close(); shutil.rmtree(root)
print("load", os.getloadavg())
