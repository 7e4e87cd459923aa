"""With BENCH_NO_KEEPALIVE=1, the daemon closes a received put's connection after its reply,
as before keep-alive (kvtier.server.streams.fresh_parser answers None): on PYTHONPATH of the
`kvtier serve` a bench starts."""
import os

if os.environ.get("BENCH_NO_KEEPALIVE") == "1":
    import sys

    import kvtier.server.streams as streams

    streams.fresh_parser = lambda protocol: None
    print("kvtier bench: a received put's connection closes after its reply", file=sys.stderr)
