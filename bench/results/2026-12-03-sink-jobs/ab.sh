#!/bin/bash
# DISK hit: one read job per I/O thread for reads into the hit buffer (this tree) vs 8 MiB jobs
# (the base: git worktree add /tmp/ab-base2 93e90d2), alternating. Usage: ab.sh LAST_ROUND [FIRST_ROUND]
for r in $(seq ${2:-1} ${1:-2}); do
  for side in new base; do
    tree=/work/main; [ $side = base ] && tree=/tmp/ab-base2
    echo "== round $r $side $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python bench/hit_path.py --threads 1 --repeats 7 --tiers DISK 2>&1 | grep "before_prefill")
  done
done
