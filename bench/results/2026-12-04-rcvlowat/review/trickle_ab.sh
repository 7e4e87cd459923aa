#!/bin/bash
# The security test that fails with the change: 10 runs with SO_RCVLOWAT (as committed), 10 without.
cd /work/main
T='tests/security/test_deadlines.py::test_a_put_that_trickles_its_body_is_cut_and_its_staging_freed'
echo "== committed (SO_RCVLOWAT on)"
for i in $(seq 10); do flock -s /tmp/kvtier-cpu.lock .venv/bin/python -m pytest -q -p no:randomly "$T" 2>&1 | tail -1; done
echo "== SO_RCVLOWAT patched out"
for i in $(seq 10); do PYTHONPATH=/tmp/review51 flock -s /tmp/kvtier-cpu.lock .venv/bin/python -m pytest -q -p nolowat_plugin "$T" 2>&1 | tail -1; done
