"""What RedisTier's per-call limits cost on the normal path: one redis-server, the same
pipelines over RedisTier's guarded connections and over plain redis-py connections.

    python bench/redis_limits.py [--total-bytes 128MiB] [--batch-blocks 16] [--json PATH]

RedisTier runs every call under a budget (kvtier/tiers/redis_conn.py: a deadline applied to
every socket read and write, a cap on each bulk string and on the bytes read in all; RESP2
through redis-py's Python parser) and reads with ``GETRANGE key 0 <record size>`` so that
Redis never sends a value longer than a record. Rows (value = guarded, baseline = plain,
ratio = guarded / plain), bare values, no kvtier records, so only the transport differs:

- get, GB/s: ``GETRANGE`` pipelines inside a call budget, guarded connections, vs ``GET``
  pipelines on the plain connections bench/server.py's raw rows use (redis-py's default
  protocol: RESP3 from redis-py 8); every reply copied into a preallocated buffer. Blocks of
  2 MiB (Llama-3-8B, bf16, 16 tokens) and of 16 KiB (many small replies).
- put, GB/s: ``SET`` pipelines, guarded vs plain.
- lookup, lookups/s: one ``EXISTS`` pipeline of ``--lookup-blocks`` keys, guarded vs plain.

Timing: cases interleaved after a warm-up (bench.common.measure), best of ``--repeats``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import Case, Row, arg_parser, measure, print_table, write_outputs  # noqa: E402
from bench.server import start_redis  # noqa: E402
from kvtier.config import parse_bytes  # noqa: E402

NAME = "redis_limits"
TIMEOUT_S = 10.0


def _clients(url: str):
    import redis

    from kvtier.tiers.redis_conn import client_options

    guarded = redis.Redis.from_url(url, **client_options(TIMEOUT_S, guarded=True))
    plain = redis.Redis.from_url(url, **client_options(TIMEOUT_S))
    return guarded, plain


def _get_cases(guarded, plain, keys: list[bytes], size: int, batch: int, dst: np.ndarray) -> list[Case]:
    from kvtier.tiers.redis_conn import call_budget

    def fetch(client, command) -> None:
        for start in range(0, len(keys), batch):
            part = keys[start : start + batch]
            pipe = client.pipeline(transaction=False)
            for key in part:
                command(pipe, key)
            for i, value in enumerate(pipe.execute(), start):
                assert len(value) == size, "short reply"
                np.copyto(dst[i], np.frombuffer(value, dtype=np.uint8))

    def fetch_guarded() -> None:
        with call_budget(TIMEOUT_S, len(keys) * size, max_bulk=size + 1, reply_nbytes=len(keys) * (size + 64)):
            fetch(guarded, lambda pipe, key: pipe.execute_command("GETRANGE", key, 0, size))

    return [Case(fetch_guarded), Case(lambda: fetch(plain, lambda pipe, key: pipe.execute_command("GET", key)))]


def _put_cases(guarded, plain, keys: list[bytes], values: np.ndarray, batch: int) -> list[Case]:
    from kvtier.tiers.redis_conn import call_budget

    def store(client) -> None:
        for start in range(0, len(keys), batch):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + batch, len(keys))):
                pipe.set(keys[i], memoryview(values[i]))
            pipe.execute()

    def store_guarded() -> None:
        with call_budget(TIMEOUT_S, values.nbytes, reply_nbytes=64 * len(keys)):
            store(guarded)

    return [Case(store_guarded), Case(lambda: store(plain))]


def _lookup_cases(guarded, plain, keys: list[bytes], calls: int) -> list[Case]:
    from kvtier.tiers.redis_conn import call_budget

    def lookups(client, budget: bool) -> None:
        for _ in range(calls):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.execute_command("EXISTS", key)
            if budget:
                with call_budget(TIMEOUT_S, reply_nbytes=16 * len(keys)):
                    replies = pipe.execute()
            else:
                replies = pipe.execute()
            assert replies == [1] * len(keys)

    return [Case(lambda: lookups(guarded, True)), Case(lambda: lookups(plain, False))]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--total-bytes", type=parse_bytes, default=128 << 20, help="bytes per get/put (default 128MiB)")
    parser.add_argument("--batch-blocks", type=int, default=16, help="2 MiB blocks per pipeline (default 16)")
    parser.add_argument("--lookup-blocks", type=int, default=32, help="keys per lookup (default 32)")
    parser.add_argument("--lookup-calls", type=int, default=500, help="lookups per timed run (default 500)")
    args = parser.parse_args(argv)
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-limits-"))
    proc = None
    rows: list[Row] = []
    try:
        proc, url = start_redis(work_dir, 4 * args.total_bytes + (256 << 20))
        guarded, plain = _clients(url)
        rng = np.random.default_rng(0)
        for size, batch in ((2 << 20, args.batch_blocks), (16 << 10, args.batch_blocks * 128)):
            n = max(1, args.total_bytes // size)
            values = rng.integers(0, 256, (n, size), dtype=np.uint8)
            keys = [b"bench:%d:%d" % (size, i) for i in range(n)]
            put_g, put_p = measure(_put_cases(guarded, plain, keys, values, batch), args.repeats)
            dst = np.zeros_like(values)
            get_g, get_p = measure(_get_cases(guarded, plain, keys, size, batch, dst), args.repeats)
            assert np.array_equal(dst, values), "a reply differs from what was stored"
            label = f"{size >> 10} KiB values, {batch} per pipeline"
            rows += [
                Row(f"get, {label}", get_g.throughput(values.nbytes, args.stat), "GB/s",
                    get_p.throughput(values.nbytes, args.stat), "GET, plain connection"),
                Row(f"put, {label}", put_g.throughput(values.nbytes, args.stat), "GB/s",
                    put_p.throughput(values.nbytes, args.stat), "SET, plain connection"),
            ]
            plain.delete(*keys)
        keys = [b"bench:lookup:%d" % i for i in range(args.lookup_blocks)]
        plain.mset({k: b"x" for k in keys})
        look_g, look_p = measure(_lookup_cases(guarded, plain, keys, args.lookup_calls), args.repeats)
        rows.append(Row(f"lookup, EXISTS x {args.lookup_blocks}", args.lookup_calls / look_g.seconds(args.stat),
                        "lookups/s", args.lookup_calls / look_p.seconds(args.stat), "plain connection"))
        guarded.close()
        plain.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(work_dir, ignore_errors=True)
    print_table(f"RedisTier's call budgets vs plain redis-py ({args.stat} of {args.repeats})", rows,
                "ratio = guarded / plain: above 1 the guards cost nothing measurable")
    write_outputs(args, NAME, rows)
    return rows


if __name__ == "__main__":
    main()
