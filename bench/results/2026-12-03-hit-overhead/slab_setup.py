"""The setup slab_rounds.py and slab_probe.py share (bench/transfers.py's store-into-a-full-slab
case): a store of NB (default 128) x 2 MiB blocks with a CPU slab of NB blocks over a DISK tier
(two I/O threads), the slab filled and flushed once, a primed raw file for the baseline, and
fill() to refill the slab with blocks held nowhere else before each round."""
import os, sys, tempfile
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from pathlib import Path
import torch
torch.set_num_threads(1)
from bench.transfers import _store, SPEC, NAMESPACE
from bench.common import raw_write, prime_raw_file
from kvtier.hashing import block_hashes_for
root = Path(tempfile.mkdtemp(prefix="slab-", dir="/work"))
n = int(os.environ.get("NB", 128))
hashes = block_hashes_for(list(range(n * 16)), NAMESPACE, 16)
spill_hashes = block_hashes_for(list(range(10**6, 10**6 + n * 16)), NAMESPACE, 16)
blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
store = _store(root / "kv", n, 2)
store.store(hashes, blocks); store.flush()
raw = prime_raw_file(root / "raw.bin", blocks, 32)
def fill():
    store.top.clear(); store.disk.remove(hashes + spill_hashes); store.store(hashes, blocks)
