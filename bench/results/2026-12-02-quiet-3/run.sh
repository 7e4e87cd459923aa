#!/usr/bin/env bash
# Issue 17 quiet-host figures, one after another under flock -x. Usage: quiet17.sh OUTDIR
set -u
cd /work/main
OUT=${1:?outdir}; mkdir -p "$OUT"
export OMP_NUM_THREADS=1
P=.venv/bin/python
run() { local name=$1; shift; echo "== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/loads.log"
  "$P" "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1; echo "rc $name ${PIPESTATUS[0]}" | tee -a "$OUT/loads.log"; }
run hit_path bench/hit_path.py --threads 1 --repeats 5
run server bench/server.py --threads 1 --no-raw
run tiers bench/tiers.py --total-bytes 256MiB --repeats 3 --threads 1 --dir /tmp --open-bytes 8GiB
run transfers bench/transfers.py --total-bytes 256MiB --repeats 3 --threads 1 --skip-overlap --dir /tmp
echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/loads.log"
