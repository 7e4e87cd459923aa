"""The open-loop lookup tail alone (issue 17: "lookup p99 at 32 clients x 10/s <= 2 ms"): a
daemon with 32 blocks, bench/server.py's latency workers (4 processes x 8 threads, 10
lookups/s each, 1 s warm-up, 4 s measured), ROUNDS rounds alternating the lookup channel
(``channel``) and HTTP lookups (``http``: the client told of no channel), which goes first
alternating too. Prints p50, p99 and
the max per round (ms). argv: [ROUNDS]."""
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from bench.server import NAMESPACE, SPEC, _latency_worker, _warm_worker, make_client, start_daemon, stop  # noqa: E402


def worker(mode, url, hashes, start_at, first):
    if mode == "http":
        from kvtier.tiers.remote import RemoteTier
        RemoteTier._offer_channel = lambda self, path: None
    return _latency_worker("daemon", url, hashes, 8, start_at, 1.0, 4.0, 10.0, first, 32)[0]


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    proc, url = start_daemon(Path(tempfile.mkdtemp()), 256 << 20)
    try:
        client = make_client("daemon", url)
        hashes = [os.urandom(32) for _ in range(32)]
        assert all(client.put(NAMESPACE, hashes, list(torch.zeros((32, *SPEC.block_shape), dtype=SPEC.dtype))))
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(4, initializer=_warm_worker) as pool:
            pool.starmap(time.sleep, [(0.5,)] * 8)  # the spawned workers are up (imports done)
            for r in range(rounds):
                for mode in (("channel", "http") if r % 2 else ("http", "channel")):
                    start_at = time.time() + 1.5
                    lat = sorted(x for part in pool.starmap(worker, [(mode, url, hashes, start_at, 8 * i)
                                                                     for i in range(4)]) for x in part)
                    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3  # noqa: E731
                    print(f"{mode:8s} n={len(lat)} p50 {p(0.5):.2f} p99 {p(0.99):.2f} max {lat[-1] * 1e3:.2f} ms "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        stop(proc)
