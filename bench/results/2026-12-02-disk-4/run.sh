#!/usr/bin/env bash
# disk-4 before/after: before = main 0098106 (git archive in /tmp/disk4/main), after = perf-disk-4; same venv.
# One sitting = before, after, before, after (alternating), all under one `flock -x /tmp/kvtier-cpu.lock`.
set -u
OUT=/work/wt/disk/bench/results/2026-12-02-disk-4; P=/work/wt/disk/.venv/bin/python; S=${1:-1}
export OMP_NUM_THREADS=1
run() { local name=$1 tree=$2; shift 2; echo "== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/runs.log
  (cd $tree && PYTHONPATH=$tree "$P" "$@" --json $OUT/$name.json > $OUT/$name.txt 2>&1); echo "rc $name $? end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/runs.log; }
for k in 1 2; do for side in before after; do
  tree=/work/wt/disk; [ $side = before ] && tree=/tmp/disk4/main
  run s$S-$k-transfers-$side $tree bench/transfers.py --total-bytes 256MiB --repeats 3 --threads 1 --skip-overlap --dir /tmp
  run s$S-$k-tiers-$side $tree bench/tiers.py --total-bytes 256MiB --repeats 3 --threads 1 --dir /tmp --drop-caches system
done; done
