import sys, time, torch, tempfile, cProfile, pstats
sys.path.insert(0, sys.argv[1])
import bench.transfers as T
from kvtier.hashing import block_hashes_for
SPEC=T.SPEC; NS=T.NAMESPACE; n=128
store=T._store(__import__("pathlib").Path(tempfile.mkdtemp(dir="/tmp")), n, 1)
hashes=block_hashes_for(list(range(n*16)), NS, 16)
spill=block_hashes_for(list(range(10**6, 10**6+n*16)), NS, 16)
blocks=torch.randn((n,*SPEC.block_shape)).to(SPEC.dtype)
def run():
    for s in range(0,n,32): store.store(spill[s:s+32], blocks[s:s+32])
for r in range(4):
    store.top.clear(); store.disk.remove(hashes+spill); store.store(hashes, blocks)
    if r==3: cProfile.run("run()", "/tmp/disk4/p2")
    else: run()
pstats.Stats("/tmp/disk4/p2").sort_stats("tottime").print_stats(14)
