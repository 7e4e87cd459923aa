"""transfers.py's store()-into-full-slab row: one request of n blocks (transfers) vs requests of 32 (tiers), vs raw write."""
import sys, os, shutil, tempfile, statistics, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from bench import transfers as X
from bench.common import prime_raw_file, raw_write, Case, measure
from kvtier.hashing import block_hashes_for
torch.set_num_threads(1)
n = int(sys.argv[1]); reps = int(sys.argv[2])
root = Path(tempfile.mkdtemp(prefix="t2-", dir="/tmp/grow"))
hashes = block_hashes_for(list(range(n * 16)), X.NAMESPACE, 16)
blocks = torch.randn((n, *X.SPEC.block_shape)).to(X.SPEC.dtype)
store = X._store(root / "kv", n, 1)
cpu = store.top
store.store(hashes, blocks); store.flush()
spill_hashes = block_hashes_for(list(range(10**6, 10**6 + n * 16)), X.NAMESPACE, 16)
def fill_slab():
    cpu.clear(); store.disk.remove(hashes + spill_hashes); store.store(hashes, blocks)
def one():
    assert store.store(spill_hashes, blocks) == n
def chunked():
    for i in range(0, n, 32):
        assert store.store(spill_hashes[i:i+32], blocks[i:i+32]) == min(32, n - i)
raw = prime_raw_file(root / "raw.bin", blocks, 32)
t1, t2, w = measure([Case(one, fill_slab), Case(chunked, fill_slab), Case(lambda: raw_write(raw, blocks, 32))], reps)
nb = n * X.SPEC.block_nbytes
for name, t in (("one request", t1), ("requests of 32", t2), ("raw", w)):
    print(f"{name:16s} best {nb/t.best_s/1e9:.2f} median {nb/t.median_s/1e9:.2f} GB/s  ratio best {w.best_s/t.best_s:.2f}x median {w.median_s/t.median_s:.2f}x")
store.close(); shutil.rmtree(root)
print("load", os.getloadavg())
