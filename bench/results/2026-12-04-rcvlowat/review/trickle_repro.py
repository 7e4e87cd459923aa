"""Deterministic form of the flaky tests/security/test_deadlines.py::
test_a_put_that_trickles_its_body_is_cut_and_its_staging_freed[uvloop-receiver-*]: the headers
arrive first (the handler takes the body with nothing buffered), then the body's first 200
bytes. With SO_RCVLOWAT = min(remaining, rate*grace/4) the daemon never sees those 200 bytes
(nor the trickle after them): no slot / staging is taken, which the test asserts.
Usage: trickle_repro.py [uvloop|asyncio]   (NOLOWAT=1 for A/B)"""
import socket
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (instrumentation + NOLOWAT switch)
from harness import RECEIVERS
from kvtier.server import streams
from kvtier.server.app import REGISTRY, STAGING
from kvtier.tiers.remote import RemoteTier
from tests.conftest import random_blocks
from tests.unit.server.conftest import NAMESPACE, SPEC, ThreadDaemon, frames, hashes, put_head, serve_settings

streams.RECEIVE_MIN_NBYTES = 0  # as the test's put_reads=receiver
streams.RECEIVE_MIN_BLOCK_NBYTES = 0
loop = sys.argv[1] if len(sys.argv) > 1 else "uvloop"
for path in ["direct", "staging"]:
    d = ThreadDaemon(serve_settings(Path(tempfile.mkdtemp()) / "data", event_loop=loop, idle_timeout_s=1.0,
                                    grace_s=0.5, min_rate_bytes_per_s=64 << 10,
                                    **({"disk_blocks": 0} if path == "direct" else {}))).start()
    RemoteTier(d.url, timeout_s=10).register(NAMESPACE, SPEC)
    body = frames(NAMESPACE, hashes(4, salt=9), random_blocks(SPEC, 4, seed=9))
    s = socket.create_connection(("127.0.0.1", d.port))
    s.sendall(put_head(len(body)))
    time.sleep(0.2)  # the handler runs and takes the body before any of it came
    s.sendall(body[:200])
    time.sleep(0.3)

    def held():
        store = d.app[REGISTRY].get("default", NAMESPACE).store
        return d.app[STAGING].used, len(store.residency.pending())

    h = d.call(held)
    r = RECEIVERS[-1]
    print(f"{loop} {path}: body {len(body)} B, 200 sent; daemon read {len(body) - d.call(lambda: r.remaining)} of them"
          f", lowat {r._lowat}; held (staging bytes, slots) = {h} "
          f"-> the test expects {'(0, 1)' if path == 'direct' else 'staging > 0'}")
    s.close()
    d.stop()
