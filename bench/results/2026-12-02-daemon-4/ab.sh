#!/bin/bash
# before then after (or after then before with $2=rev), back to back under one lock; $1 = suffix
set -e
R=/work/wt/daemon/bench/results/2026-12-02-daemon-4
B=/tmp/daemon4/main
run() {  # $1 = before|after
  if [ "$1" = before ]; then T=$B; else T=/work/wt/daemon; fi
  cd $T && PYTHONPATH=$T OMP_NUM_THREADS=1 /work/wt/daemon/.venv/bin/python bench/server.py --threads 1 --no-raw \
    --total-bytes 256MiB --repeats 3 --json $R/server-$1$SUF.json > $R/server-$1$SUF.txt 2>&1
  echo "$(date -u +%T) after $1$SUF $(uptime)" >> $R/runs.log
}
export -f run; export R B SUF=$1
ORDER="before after"; [ "$2" = rev ] && ORDER="after before"
flock -x /tmp/kvtier-cpu.lock bash -c "echo \"\$(date -u +%T) start$SUF \$(uptime)\" >> $R/runs.log; for w in $ORDER; do run \$w; done"
