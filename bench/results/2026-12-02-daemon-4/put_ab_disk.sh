#!/bin/bash
# put_ab.py with a 2 GiB DISK tier under the pool, both trees, alternating, N pairs; $1 = pairs (default 2)
R=/work/wt/daemon/bench/results/2026-12-02-daemon-4
flock -x /tmp/kvtier-cpu.lock bash -c "
for i in \$(seq ${1:-2}); do
  for t in before after; do
    if [ \$t = before ]; then T=/tmp/daemon4/main; else T=/work/wt/daemon; fi
    echo \"== \$t pair \$i \$(date -u +%T) \$(uptime)\" >> $R/put_ab_disk.log
    cd \$T && PYTHONPATH=\$T OMP_NUM_THREADS=1 /work/wt/daemon/.venv/bin/python $R/put_ab.py 6 2147483648 >> $R/put_ab_disk.log 2>&1
  done
done"
