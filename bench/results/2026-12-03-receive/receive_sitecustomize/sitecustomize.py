"""Sets the daemon's receive thresholds (kvtier.server.streams.RECEIVE_MIN_NBYTES from
BENCH_RECEIVE_MIN_NBYTES, RECEIVE_MIN_BLOCK_NBYTES to 0): on PYTHONPATH of the `kvtier serve` a bench starts."""
import os

if "BENCH_RECEIVE_MIN_NBYTES" in os.environ:
    import kvtier.server.streams as streams

    streams.RECEIVE_MIN_NBYTES = int(os.environ["BENCH_RECEIVE_MIN_NBYTES"])
    streams.RECEIVE_MIN_BLOCK_NBYTES = 0  # the A/B: every block size
    import sys

    print(f"kvtier bench: RECEIVE_MIN_NBYTES = {streams.RECEIVE_MIN_NBYTES}", file=sys.stderr)
