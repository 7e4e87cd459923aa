"""``kvtier replay`` on a multi-user ShareGPT trace: miss-ratio curves, agreement with a real run, speed.

1. Builds the trace: ``--users`` ShareGPT users chatting at once (kvtier.app.traces; at least
   100,000 block requests by default).
2. Real run: a :class:`~kvtier.store.TieredStore` (a tiny block spec, so that it runs in
   seconds; capacities count blocks, bytes do not matter) with an emulated GPU pool, a CPU
   pool and a real LMDB DISK tier, driven through the trace as the transformers connector
   drives it, writing its own trace (``trace_path``). Its measured hit rate per tier is the
   store's ``stats``.
3. Replay of the trace the run wrote: kvtier's policy at the run's capacities (agreement),
   then the whole grid per tier (kvtier and LRU), written as ``replay.json`` and ``replay.png``.
4. Speed in block requests per second, each against the same-process baseline: one pass of a
   plain ``OrderedDict`` LRU at one capacity.

    python bench/replay.py --json out.json --out-dir bench/results/DATE
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Row, arg_parser, print_table, write_outputs  # noqa: E402


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=800, help="ShareGPT users (default 800)")
    parser.add_argument("--turns", type=int, default=8, help="turns per user at most (default 8)")
    parser.add_argument("--points", type=int, default=6, help="capacities per tier (default 6)")
    parser.add_argument("--jobs", type=int, default=1, help="processes for the grid's kvtier passes (default 1)")
    parser.add_argument("--min-block-requests", type=int, default=100_000)
    parser.add_argument("--out-dir", type=Path, default=None, help="write replay.json and replay.png here")
    args = parser.parse_args()

    import torch

    from kvtier.app.replay import replay_kvtier, replay_ordered_dict_lru, run_store, stack_distances
    from kvtier.app.replay_cli import render, sweep
    from kvtier.app.traces import read_trace, sharegpt_trace
    from kvtier.config import StoreConfig
    from kvtier.store import TieredStore
    from kvtier.tiers.disk import record_footprint
    from kvtier.types import KVSpec

    t0 = time.perf_counter()
    trace = sharegpt_trace(args.users, args.turns)
    build_s = time.perf_counter() - t0
    if trace.block_requests < args.min_block_requests:
        sys.exit(f"expected >= {args.min_block_requests} block requests, got {trace.block_requests}: raise --users")
    unique = trace.unique_blocks
    tiers = {"GPU": unique // 32, "CPU": unique // 8, "DISK": unique // 2}

    spec = KVSpec(1, 1, 1, trace.block_size, torch.float16)
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        config = StoreConfig(
            gpu_bytes=tiers["GPU"] * spec.block_nbytes, cpu_bytes=tiers["CPU"] * spec.block_nbytes,
            disk_bytes=tiers["DISK"] * record_footprint(spec.block_nbytes), block_size=spec.block_size,
            data_dir=Path(tmp), flush_on_close=False, trace_path=Path(tmp) / "trace.jsonl",
        )
        store = TieredStore(spec, config, bytes(32), device="cpu", emulate_gpu=True)
        t0 = time.perf_counter()
        real = run_store(trace, store)
        real_s = time.perf_counter() - t0
        store.close()
        recorded = read_trace(Path(tmp) / "trace.jsonl")

    t0 = time.perf_counter()
    replayed = replay_kvtier(recorded, recorded.tiers)
    replay_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    distances = stack_distances(recorded)
    lru_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    baseline = replay_ordered_dict_lru(recorded, sum(recorded.tiers.values()))
    baseline_s = time.perf_counter() - t0
    assert sum(distances.hits(recorded.tiers).values()) == baseline.hits["LRU"], "stack distances != OrderedDict LRU"

    doc = sweep(recorded, recorded.tiers, args.points, args.jobs)
    doc["trace"]["source"] = trace.source
    n = recorded.block_requests
    rate = (lambda seconds: n / seconds)
    base_name = "OrderedDict LRU, 1 capacity"
    rows = [
        Row("kvtier replay (store's placement + SLRU), 1 pass", rate(replay_s), "block req/s", rate(baseline_s), base_name),
        Row("LRU stack distances, all capacities, 1 pass", rate(lru_s), "block req/s", rate(baseline_s), base_name),
        Row("real TieredStore run (tiny blocks, LMDB DISK)", rate(real_s), "block req/s", rate(baseline_s), base_name),
        Row("real run: hit rate, all tiers", 100 * real.hit_rate(), "%"),
        Row("replay at the run's capacities: hit rate, all tiers", 100 * replayed.hit_rate(), "%"),
        Row("agreement |replay - real|, all tiers", 100 * abs(replayed.hit_rate() - real.hit_rate()), "pp"),
    ]
    for tier in ("GPU", "CPU", "DISK"):
        gap = abs(replayed.hit_rate([tier]) - real.hit_rate([tier]))
        rows.append(Row(f"agreement |replay - real|, {tier} hits ({100 * real.hit_rate([tier]):.1f}% real)",
                        100 * gap, "pp"))
    load = os.getloadavg()
    print_table(f"kvtier replay: {trace.source}; {n:,} block requests, {unique:,} distinct blocks", rows,
                f"trace built in {build_s:.1f} s; capacities (blocks) {recorded.tiers}; host load average "
                f"{load[0]:.1f} on {os.cpu_count()} cores")
    for line in render(doc):
        print(line)
    write_outputs(args, "replay", rows)
    if args.out_dir is not None:
        from kvtier.app.plots import plot_replay

        args.out_dir.mkdir(parents=True, exist_ok=True)
        doc["real_run"] = {"hit_rate": real.hit_rate(), "hits": real.hits, "lookups": real.lookups,
                           "replay_hit_rate": replayed.hit_rate(), "replay_hits": replayed.hits}
        (args.out_dir / "replay.json").write_text(json.dumps(doc, indent=1))
        plot_replay(doc, args.out_dir / "replay.png")


if __name__ == "__main__":
    main()
