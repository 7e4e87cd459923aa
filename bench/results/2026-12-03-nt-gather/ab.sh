#!/bin/bash
# Same tree, host copy kernels on vs off (KVTIER_HOST_KERNELS=off: numpy copies), alternating.
# Usage: flock -x /tmp/kvtier-cpu.lock bash bench/results/2026-12-03-nt-gather/ab.sh ROUNDS OUTDIR
cd /work/main
R=${1:-3}; OUT=${2:-bench/results/2026-12-03-nt-gather}; mkdir -p "$OUT"
for r in $(seq 1 $R); do
  for side in on off; do
    env=""; [ $side = off ] && env="KVTIER_HOST_KERNELS=off"
    echo "== round $r kernels $side $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    env $env .venv/bin/python bench/hit_path.py --threads 1 --repeats 7 --tiers CPU,DISK --json "$OUT/hit_path-$r-$side.json" 2>&1 | grep "│"
    env $env .venv/bin/python bench/tiers.py --total-bytes 256MiB --repeats 3 --threads 1 --dir /tmp --json "$OUT/tiers-$r-$side.json" 2>&1 | grep "DISK get\|DISK -> CPU\|CPU get"
  done
done
