#!/bin/bash
# The phases of a 1k-token DISK hit (phases.py), this tree vs a base worktree, alternating.
# Usage (from the tree root): git worktree add -f /tmp/ab-base5 BASE; ab.sh ROUNDS /tmp/ab-base5 [TOKENS]
here=$(cd "$(dirname "$0")" && pwd)
for r in $(seq 1 $1); do
  for side in new base; do
    tree=$PWD; [ $side = base ] && tree=$2
    echo "$r $side $(TREE=$tree OMP_NUM_THREADS=1 PYTHONPATH=$tree $PWD/.venv/bin/python $here/phases.py ${3:-1024})"
  done
done
