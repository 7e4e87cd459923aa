#!/usr/bin/env bash
# disk-3 before/after: before = main 7b8c22e (git archive in /tmp/disk3-main), after = perf-disk-3; same venv
set -u
OUT=/work/wt/disk/bench/results/2026-12-02-disk-3; P=/work/wt/disk/.venv/bin/python
export OMP_NUM_THREADS=1
run() { local name=$1 tree=$2; shift 2; echo "== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/runs.log
  (cd $tree && PYTHONPATH=$tree "$P" "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1); echo "rc $name $? end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/runs.log; }
for side in before after; do
  tree=/work/wt/disk; [ $side = before ] && tree=/tmp/disk3-main
  run transfers-$side $tree bench/transfers.py --total-bytes 256MiB --repeats 3 --threads 1 --skip-overlap --dir /tmp
  run tiers-$side $tree bench/tiers.py --total-bytes 256MiB --repeats 3 --threads 1 --dir /tmp --drop-caches system
done
