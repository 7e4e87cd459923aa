#!/usr/bin/env bash
# Same tree, DISK reads with the fused hash+copy kernel (kvt_hash_copy_rows, outside the GIL) vs
# without it (host_copy._hashing = False: python-xxhash, then the streaming copy: two GIL round trips a block),
# alternating, ROUNDS rounds. Run from the checkout's root under flock -x /tmp/kvtier-cpu.lock.
set -euo pipefail
ROUNDS=${1:-3}
OUT=${2:-bench/results/2026-12-03-fused-hash}
for round in $(seq 1 "$ROUNDS"); do
  for mode in fused old; do
    OMP_NUM_THREADS=1 .venv/bin/python - "$mode" "$OUT/hit_path-$round-$mode.json" <<'PY'
import runpy, sys
mode, out = sys.argv[1], sys.argv[2]
from kvtier.kernels import host_copy
assert host_copy.library() is not None and host_copy._hashing
host_copy._hashing = mode == "fused"
sys.argv = ["bench/hit_path.py", "--threads", "1", "--tiers", "DISK", "--repeats", "7", "--json", out]
runpy.run_path("bench/hit_path.py", run_name="__main__")
PY
  done
done 2>&1 | grep -E "before_prefill|read_into|floor|load average"
