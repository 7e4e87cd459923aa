"""The mixed workload of bench/server.py (issue 17): ``--clients`` closed-loop clients, each
call drawn at random as 70% lookups, 20% gets, 10% puts, against the daemon and Redis in
turn (same seed, so the same sequence of calls on both).

- lookup: the ``--lookup-blocks`` hashes of a hot set every client shares (put untimed before
  the round);
- get: ``--mixed-blocks`` consecutive blocks of the hot set into the client's own tensors,
  every block verified (a block that does not come back is counted as a miss, not an error:
  Redis's LRU is approximate and may drop a hot key under the puts' pressure);
- put: ``--mixed-blocks`` blocks under hashes never used before (the cache is full: each put
  evicts, as in service).

Rows: calls/s of all clients together, p50 and p99 latency of all calls, p99 of the lookups
among them; the blocks gets missed go in the table's footnote.
"""

from __future__ import annotations

import hashlib
import os
import random
import time

import torch

from bench.common import Row
from kvtier.records import ReadStatus
from kvtier.types import BlockHash

MIX = (("lookup", 0.7), ("get", 0.2), ("put", 0.1))


def hot_hashes(kind: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"server-mixed-hot:{kind}:{i}".encode()).digest() for i in range(n)]


def put_hot(client, kind: str, spec, namespace: bytes, n: int) -> None:
    """Store the hot set (untimed), once per round: a put of a present block is skipped."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randn((n, *spec.block_shape), generator=g).to(spec.dtype)
    hashes = [BlockHash(h) for h in hot_hashes(kind, n)]
    if not all(client.put(namespace, hashes, list(blocks))):
        raise RuntimeError(f"{kind}: the mixed workload's hot set could not be stored ({dict(client.errors)})")


def mixed_worker(kind: str, url: str, threads: int, start_at: float, warmup_s: float, duration_s: float,
                 first_client: int, blocks_per_call: int, hot_blocks: int,
                 seed: int) -> tuple[dict[str, list[float]], int]:
    """One client process: ``threads`` closed-loop clients sharing one client object.
    Returns the latencies (seconds) per kind of call inside the measured window, and the
    blocks gets asked for that did not come back."""
    from bench.server import NAMESPACE, SPEC, make_client, run_threads

    client = make_client(kind, url)
    hot = [BlockHash(h) for h in hot_hashes(kind, hot_blocks)]
    results: list[dict[str, list[float]]] = [{name: [] for name, _ in MIX} for _ in range(threads)]
    misses = [0] * threads
    base = time.perf_counter() + (start_at - time.time())
    measure_from, end = base + warmup_s, base + warmup_s + duration_s
    names, weights = [n for n, _ in MIX], [w for _, w in MIX]
    src = torch.randn((blocks_per_call, *SPEC.block_shape)).to(SPEC.dtype)

    def run(i: int) -> None:
        rng = random.Random(seed * 1000 + first_client + i)
        outs = list(torch.empty((blocks_per_call, *SPEC.block_shape), dtype=SPEC.dtype))
        tag = f"{kind}:{seed}:{os.getpid()}:{first_client + i}"
        count = 0
        now = time.perf_counter()
        if now < base:
            time.sleep(base - now)
        while (start := time.perf_counter()) < end:
            op = rng.choices(names, weights)[0]
            if op == "lookup":
                client.lookup(NAMESPACE, hot)
            elif op == "get":
                at = rng.randrange(hot_blocks - blocks_per_call + 1)
                statuses = client.get_into(NAMESPACE, hot[at : at + blocks_per_call], outs)
                missed = sum(s is not ReadStatus.OK for s in statuses)
                if start >= measure_from:
                    misses[i] += missed
            else:
                count += 1
                fresh = [BlockHash(hashlib.sha256(f"{tag}:{count}:{j}".encode()).digest())
                         for j in range(blocks_per_call)]
                client.put(NAMESPACE, fresh, list(src))
            if start >= measure_from:
                results[i][op].append(time.perf_counter() - start)

    run_threads(run, threads)
    client.close()
    merged = {name: [x for r in results for x in r[name]] for name in names}
    return merged, sum(misses)


def run_mixed(pool, urls: dict[str, str], hot_put, clients: int, procs: int, rounds: int, duration_s: float,
              blocks_per_call: int, hot_blocks: int) -> dict[str, tuple[dict[str, list[float]], int, float]]:
    """``clients`` mixed clients over ``procs`` processes against each server in turn,
    ``rounds`` times (alternating); per server ``(latencies by kind, misses, seconds)``."""
    from bench.server import dispatch, spread

    per_proc, firsts = spread(clients, min(procs, clients))
    out = {kind: ({name: [] for name, _ in MIX}, 0, 0.0) for kind in urls}
    for r in range(rounds):
        for kind, url in urls.items():
            hot_put[kind]()
            start_at = time.time() + 0.5
            args = [(kind, url, n, start_at, 0.3, duration_s, first, blocks_per_call, hot_blocks, r)
                    for n, first in zip(per_proc, firsts)]
            latencies, misses, seconds = out[kind]
            for lat, miss in dispatch(pool, mixed_worker, args, duration_s):
                for name in lat:
                    latencies[name] += lat[name]
                misses += miss
            out[kind] = (latencies, misses, seconds + duration_s)
    return out


def mixed_rows(result, clients: int, blocks_per_call: int) -> tuple[list[Row], str]:
    """The rows, and the footnote's line on the blocks gets missed."""
    import numpy as np

    def stats(kind: str) -> tuple[float, float, float, float, int]:
        latencies, misses, seconds = result[kind]
        every = np.asarray([x for lat in latencies.values() for x in lat])
        lookups = np.asarray(latencies["lookup"])
        return (len(every) / seconds, float(np.percentile(every, 50)) * 1e3, float(np.percentile(every, 99)) * 1e3,
                float(np.percentile(lookups, 99)) * 1e3, misses)

    d, r = stats("daemon"), stats("redis")
    who = f"mixed 70/20/10 lookup/get/put ({blocks_per_call} x 2 MiB), {clients} clients"
    base = "RedisTier on redis-server"
    return [
        Row(f"{who}: calls/s", d[0], "calls/s", r[0], base),
        Row(f"{who}: p50 latency", d[1], "ms", r[1], base),
        Row(f"{who}: p99 latency", d[2], "ms", r[2], base),
        Row(f"{who}: lookup p99 latency", d[3], "ms", r[3], base),
    ], f"Mixed workload: blocks gets missed, daemon {d[4]}, Redis {r[4]}."
