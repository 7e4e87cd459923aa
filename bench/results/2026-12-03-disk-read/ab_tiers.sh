#!/bin/bash
# usage: ab_tiers.sh ROUNDS OUT
cd /work/main  # the base side: git worktree add /tmp/ab-base aff937f
for r in $(seq 1 $1); do
  for side in base new; do
    tree=/work/main; [ $side = base ] && tree=/tmp/ab-base
    echo "== round $r $side $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python bench/tiers.py --total-bytes 256MiB --repeats 3 --threads 1 --dir /tmp 2>&1 | grep "DISK get\|DISK -> CPU\|CPU get\|DISK spill: store() into full CPU slab  ")
  done
done
