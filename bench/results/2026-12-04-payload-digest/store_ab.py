"""A/B of store() into a full CPU slab (bench/transfers.py's row: 128 x 2 MiB bf16 blocks, a
slab of 128, DISK 4x) in steady state (the slab holds the blocks the round before stored into it;
DISK emptied before each round so that every victim spills) between source trees: one worker process per tree (run from that tree,
the editable install's finder removed), rounds alternating between the workers.

    python store_ab.py ROUNDS DATA_DIR TREE_A TREE_B ...

Prints each round's GB/s per tree, then medians and how often each tree was the fastest."""
import os
import statistics
import subprocess
import sys

WORKER = r'''
import sys, time
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from pathlib import Path
from kvtier.config import StoreConfig
from kvtier.hashing import KeyContext, block_hashes_for
from kvtier.store import TieredStore
from kvtier.types import KVSpec
import kvtier
assert kvtier.__file__.startswith(sys.argv[1]), kvtier.__file__
SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
NS = KeyContext(model_id="kvtier-bench", dtype="bfloat16", block_size=16).namespace()
n = 128
root = Path(sys.argv[2])
config = StoreConfig(gpu_bytes=0, cpu_bytes=n * SPEC.block_nbytes, disk_bytes=4 * n * SPEC.block_nbytes, block_size=16,
                     data_dir=root, num_io_threads=2, flush_on_close=False)
store = TieredStore(SPEC, config, NS, device="cpu")
hashes = block_hashes_for(list(range(n * 16)), NS, 16)
spill_hashes = block_hashes_for(list(range(10**6, 10**6 + n * 16)), NS, 16)
blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
chains = [hashes, spill_hashes]
store.store(hashes, blocks)
turn = 0
def one():  # the slab holds one chain (stored into a full slab the round before): store the other
    global turn
    turn += 1
    store.disk.remove(hashes + spill_hashes)  # every victim spills, every new block is new
    t = time.perf_counter()
    assert store.store(chains[turn % 2], blocks) == n
    return time.perf_counter() - t
for _ in range(4):
    one()
print("ready", flush=True)
for line in sys.stdin:
    dt = one()
    print(n * SPEC.block_nbytes / dt / 1e9, flush=True)
# every spilled block reads back verified
out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
from kvtier.records import ReadStatus
for h in chains[(turn + 1) % 2][:8]:  # the victims of the last round
    status = store.disk.read_into(h, NS, out)
    if status is not ReadStatus.OK:
        print(f"read back: {status}", file=sys.stderr)
store.close()
'''


def main():
    rounds, data, trees = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    workers = []
    for k, tree in enumerate(trees):
        d = os.path.join(data, f"w{k}")
        os.makedirs(d, exist_ok=True)
        p = subprocess.Popen([sys.executable, "-c", WORKER, os.path.abspath(tree), d], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd="/")
        assert p.stdout.readline().strip() == "ready"
        workers.append(p)
    results = [[] for _ in trees]
    for r in range(rounds):
        order = range(len(trees)) if r % 2 == 0 else reversed(range(len(trees)))
        for k in order:
            workers[k].stdin.write("go\n"); workers[k].stdin.flush()
            results[k].append(float(workers[k].stdout.readline()))
        print(f"round {r:2d}: " + "  ".join(f"{res[-1]:.2f}" for res in results), flush=True)
    for p in workers:
        p.stdin.close(); assert p.wait() == 0
    wins = [sum(1 for r in range(rounds) if max(range(len(trees)), key=lambda k: results[k][r]) == k) for k in range(len(trees))]
    for tree, res, w in zip(trees, results, wins):
        print(f"{tree}: median {statistics.median(res):.2f} GB/s, best {max(res):.2f}, fastest in {w} of {rounds}")


if __name__ == "__main__":
    main()
