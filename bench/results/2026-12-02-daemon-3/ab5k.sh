#!/bin/bash
# before then after, back to back under one lock; $1 = suffix
set -e
R=/work/wt/daemon/bench/results/2026-12-02-daemon-3
flock -x /tmp/kvtier-cpu.lock bash -c "
echo \"\$(date -u +%T) start \$(uptime)\" >> $R/runs.log
cd /tmp/dmn3/before && PYTHONPATH=/tmp/dmn3/before OMP_NUM_THREADS=1 /work/wt/daemon/.venv/bin/python bench/server.py --threads 1 --no-raw --total-bytes 256MiB --repeats 3 --lookup-calls 5000 --json $R/server-before$1.json > $R/server-before$1.txt 2>&1
echo \"\$(date -u +%T) after before$1 \$(uptime)\" >> $R/runs.log
cd /work/wt/daemon && OMP_NUM_THREADS=1 .venv/bin/python bench/server.py --threads 1 --no-raw --total-bytes 256MiB --repeats 3 --lookup-calls 5000 --json $R/server-after$1.json > $R/server-after$1.txt 2>&1
echo \"\$(date -u +%T) after after$1 \$(uptime)\" >> $R/runs.log
"
