#!/bin/bash
# DISK hit: promotions held until the hit's cache is built and each promotion job read in one
# kernel call (this tree) vs promotions from the last delivery, one read_into a block (the base:
# git worktree add /tmp/ab-base4 79f4265), alternating. Usage: ab.sh LAST_ROUND [FIRST_ROUND]
for r in $(seq ${2:-1} ${1:-2}); do
  for side in new base; do
    tree=/work/main; [ $side = base ] && tree=/tmp/ab-base4
    echo "== round $r $side $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $tree && OMP_NUM_THREADS=1 PYTHONPATH=$tree /work/main/.venv/bin/python bench/hit_path.py --threads 1 --repeats 7 --tiers DISK 2>&1 | grep "before_prefill")
  done
done
