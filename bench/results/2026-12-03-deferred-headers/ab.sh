#!/usr/bin/env bash
# Alternate bench/transfers.py's DISK rows between this tree and another checkout (the tree
# before the change), N rounds. Usage: ab.sh OLD_TREE [N]  (run from the tree root, quiet host)
set -u
OLD=${1:?old tree}; N=${2:-3}; OUT=$PWD/$(dirname "$0"); PY=$PWD/.venv/bin/python
for r in $(seq 1 "$N"); do
  for v in new old; do
    d=$PWD; [ "$v" = old ] && d=$OLD
    (cd "$d" && OMP_NUM_THREADS=1 "$PY" bench/transfers.py --total-bytes 256MiB --repeats 3 \
      --threads 1 --skip-overlap --dir /tmp > "$OUT/$v-$r.txt" 2>&1)
    echo "$v $r: $(grep -E 'spill: evict|slab \(copy' "$OUT/$v-$r.txt" | awk -F'│' '{printf "%s %s GB/s vs %s (%s); ", $2, $3, $5, $6}' | tr -s ' ')"
  done
done
