"""Soak: a ``kvtier serve`` daemon under N concurrent clients plus engine-like processes for
M minutes, optionally with hostile clients beside them; reports requests served, errors, the
daemon's RSS over time, blocks lost and the honest clients' lookup latency.

    python bench/soak.py [--minutes 3] [--clients 8] [--client-procs 2] [--engines 2]
                         [--hostile 8 [--baseline]] [--json PATH]

    # issue 12: 10 minutes, 32 clients of which 8 hostile, against a same-invocation run without them
    flock -x /tmp/kvtier-cpu.lock env OMP_NUM_THREADS=1 python bench/soak.py --minutes 10 \
        --clients 24 --client-procs 4 --engines 0 --hostile 8 --baseline --json soak.json

Not a CI test (it runs for minutes). What runs:

- the daemon: a real ``python -m kvtier serve`` process on a free loopback port, CPU pool
  ``--daemon-cpu`` and DISK ``--daemon-disk`` (large enough for every block the run can
  write, so the daemon never has to evict: any acknowledged block that is missing later is
  *lost*, not evicted);
- ``--clients`` client threads over ``--client-procs`` processes, each process sharing one
  :class:`~kvtier.tiers.remote.RemoteTier` between its threads (as an engine's I/O threads
  share one backend), each thread in a closed loop of ``put`` (a batch of blocks of a random
  request), ``lookup`` and ``get_into`` (every block checked against the bytes of its hash);
- ``--engines`` engine processes, each a :class:`~kvtier.store.TieredStore` with small local
  tiers (GPU pool emulated on CPU, CPU, DISK in its own directory) and the daemon as REMOTE, serving
  requests in a loop: ``lookup``, ``load`` (checked byte for byte), ``store`` (new blocks are
  put to the daemon in the background).

- ``--hostile`` hostile clients (threads of one more process, authenticated with the daemon's
  token like the others, kvtier.server.connections must cut them), in turn: a **slow put**
  (headers, then its body one byte every 50 ms), a **never-reading get** (asks for blocks
  that are there, never reads the reply), a **slowloris** (request headers one line every
  500 ms, never the blank line) and an **idle hoarder** (holds 16 idle connections, reopens
  each one the daemon closes); each starts over as soon as the daemon cuts it.

Every process draws its requests from one universe of prompts with shared prefixes; a block's
content is a function of its hash, so any block served is checked, wherever it came from.
At the end, every block a daemon acknowledged (a ``put`` that returned ``True``) is read back
through a fresh client: lost = acknowledged but missing or not bit-exact. The daemon runs with
a token, so honest clients sign every call (kvtier.auth).

Rows: minutes, requests served and per second, errors (honest clients and engines) and error
rate, blocks acknowledged / lost / corrupt served, engine hit rate, the honest clients' lookup
latency p50 / p99, daemon RSS at start / end / max, its growth after the warm-up (the first
quarter of the run: pools and DISK pages fill) in MiB and in %, hostile connections cut by
the daemon. With ``--baseline`` a run without the hostile clients (fresh daemon, same
settings) goes first and is every row's baseline.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, print_table, write_json  # noqa: E402
from kvtier.hashing import KeyContext, block_hashes_for  # noqa: E402
from kvtier.types import KVSpec  # noqa: E402

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)  # 32 KiB blocks
NS = KeyContext(model_id="soak", block_size=SPEC.block_size).namespace()
MIB = 1 << 20
TOKEN = "soak-token-0123456789abcdef"


def universe(num_prompts: int, seed: int = 0) -> list[list[bytes]]:
    """Prompts of 1-16 blocks; half extend an earlier prompt (shared prefixes)."""
    rnd, b, prompts = random.Random(seed), SPEC.block_size, []
    for _ in range(num_prompts):
        head = []
        if prompts and rnd.random() < 0.5:
            base = rnd.choice(prompts)
            head = base[: rnd.randint(1, len(base) // b) * b]
        prompts.append(head + [rnd.randrange(32_000) for _ in range(rnd.randint(1, 8) * b)])
    return [block_hashes_for(tokens, NS, b) for tokens in prompts]


_CONTENT: dict[bytes, torch.Tensor] = {}


def content(block_hash: bytes) -> torch.Tensor:
    """The block stored under ``block_hash``: ``[*SPEC.block_shape]``, a function of the hash."""
    block = _CONTENT.get(block_hash)
    if block is None:
        g = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little") >> 1)
        block = torch.randn(SPEC.block_shape, generator=g).to(SPEC.dtype)
        if len(_CONTENT) < 20_000:
            _CONTENT[block_hash] = block
    return block


# -- the daemon ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(work_dir: Path, cpu_bytes: int, disk_bytes: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    log = open(work_dir / "daemon.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier", "serve", "--port", str(port), "--data-dir", str(work_dir / "daemon"),
         "--cpu-bytes", str(cpu_bytes), "--disk-bytes", str(disk_bytes), "--gpu-bytes", "0", "--token", TOKEN],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited: {(work_dir / 'daemon.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("daemon did not start")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


# -- workers ---------------------------------------------------------------------------------------
def client_proc(url: str, threads: int, deadline: float, seed: int, prompts: int, results) -> None:
    """Client threads sharing one RemoteTier; sends its counters, acknowledged hashes and
    lookup latencies (seconds)."""
    from kvtier.records import ReadStatus
    from kvtier.tiers.remote import RemoteTier

    torch.set_num_threads(1)
    remote = RemoteTier(url, token=TOKEN, timeout_s=10.0)
    remote.register(NS, SPEC)
    requests = universe(prompts)
    counts: Counter = Counter()
    acked: set[bytes] = set()
    latencies: list[float] = []
    lock = threading.Lock()

    def loop(k: int) -> None:
        rnd = random.Random(seed * 1000 + k)
        local: Counter = Counter()
        mine: set[bytes] = set()
        waits: list[float] = []
        while time.time() < deadline:
            request = rnd.choice(requests)
            op = rnd.random()
            if op < 0.35:
                blocks = [content(h) for h in request]
                ok = remote.put(NS, request, blocks)
                local["put"] += 1
                local["put_refused"] += ok.count(False)
                mine.update(h for h, good in zip(request, ok) if good)
            elif op < 0.65:
                local["lookup"] += 1
                start = time.perf_counter()
                remote.lookup(NS, request)
                waits.append(time.perf_counter() - start)
            else:
                outs = [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in request]
                statuses = remote.get_into(NS, request, outs)
                local["get"] += 1
                for h, out, status in zip(request, outs, statuses):
                    if status is ReadStatus.OK:
                        local["blocks_read"] += 1
                        if not torch.equal(out.view(torch.int16), content(h).view(torch.int16)):
                            local["corrupt_served"] += 1
                    elif status is not ReadStatus.MISSING:
                        local[f"get_{status.value}"] += 1
                    elif h in mine:
                        local["acked_missing"] += 1
                    if status is not ReadStatus.OK:
                        break
        with lock:
            counts.update(local)
            acked.update(mine)
            latencies.extend(waits)

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    counts.update({f"client_error_{k}": v for k, v in remote.errors.items()})
    remote.close()
    results.put(("client", dict(counts), sorted(acked), latencies))


def engine_proc(url: str, deadline: float, seed: int, prompts: int, work_dir: str, results) -> None:
    """An engine-like process: TieredStore with small local tiers and the daemon as REMOTE."""
    from kvtier.config import StoreConfig
    from kvtier.store import TieredStore
    from kvtier.tiers.disk import record_footprint

    torch.set_num_threads(1)
    config = StoreConfig(gpu_bytes=16 * SPEC.block_nbytes, cpu_bytes=32 * SPEC.block_nbytes,
                         disk_bytes=128 * record_footprint(SPEC.block_nbytes), block_size=SPEC.block_size,
                         data_dir=work_dir, remote_url=url, remote_token=TOKEN, remote_timeout_s=10.0)
    store = TieredStore(SPEC, config, NS, device="cpu", emulate_gpu=True)
    rnd, requests, counts = random.Random(seed), universe(prompts), Counter()
    while time.time() < deadline:
        request = rnd.choice(requests)
        counts["requests"] += 1
        counts["lookup_blocks"] += len(request)
        result = store.load(request)
        with result.lease:
            n = len(result.block_ids)
            counts["hit_blocks"] += n
            if n:
                got = store.top.tensor[torch.tensor(result.block_ids, dtype=torch.long)]
                want = torch.stack([content(h) for h in request[:n]])
                counts["corrupt_served"] += int(not torch.equal(got.view(torch.int16), want.view(torch.int16)))
        blocks = torch.stack([content(h) for h in request])
        counts["stored_blocks"] += store.store(request, blocks)
    store.wait_for_writes()
    counts.update({f"load_failure_{k}": v for k, v in store.stats.load_failures.items()})
    counts.update({f"store_failure_{k}": v for k, v in store.stats.store_failures.items()})
    counts.update({f"remote_error_{k}": v for k, v in store.remote.errors.items()})
    counts.update({f"hits_{m}": v for m, v in store.stats.loaded_blocks.items()})
    store.close()
    results.put(("engine", dict(counts), [], []))


def verify(url: str, acked: set[bytes]) -> tuple[int, int]:
    """(blocks lost, blocks corrupt) among ``acked``, read through a fresh client."""
    from kvtier.records import ReadStatus
    from kvtier.tiers.remote import RemoteTier

    remote = RemoteTier(url, token=TOKEN, timeout_s=30.0)
    remote.register(NS, SPEC)
    lost = corrupt = 0
    out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
    for h in sorted(acked):  # one block per call: a miss must not hide the blocks after it
        (status,) = remote.get_into(NS, [h], [out])
        if status is not ReadStatus.OK:
            lost += 1
        elif not torch.equal(out.view(torch.int16), content(h).view(torch.int16)):
            corrupt += 1
    remote.close()
    return lost, corrupt


# -- main ------------------------------------------------------------------------------------------
def run_phase(args, hostile: int) -> dict:
    """One soak with a fresh daemon: its figures (see :func:`rows`)."""
    import psutil

    from bench.hostile import hostile_proc

    work = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    daemon, url = start_daemon(work, int(args.daemon_cpu), int(args.daemon_disk))
    rss: list[tuple[float, float]] = []
    try:
        proc = psutil.Process(daemon.pid)
        t0 = time.time()
        deadline = t0 + 60 * args.minutes
        rss.append((0.0, proc.memory_info().rss / MIB))
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        workers = []
        per_proc = max(1, args.clients // args.client_procs)
        for i in range(args.client_procs):
            workers.append(ctx.Process(target=client_proc, args=(url, per_proc, deadline, i, args.prompts, results)))
        for i in range(args.engines):
            workers.append(ctx.Process(target=engine_proc,
                                       args=(url, deadline, 100 + i, args.prompts, str(work / f"engine{i}"), results)))
        if hostile:
            port = int(url.rsplit(":", 1)[1])
            frames_of = partial(_frames, NS)
            workers.append(ctx.Process(target=hostile_proc, args=(port, TOKEN, hostile, deadline, "/v1/namespaces/"
                                                                  + NS.hex(), universe(args.prompts), frames_of,
                                                                  results)))
        for w in workers:
            w.start()
        unhealthy = 0
        while time.time() < deadline:
            time.sleep(min(args.sample_s, max(0.0, deadline - time.time())))
            rss.append((time.time() - t0, proc.memory_info().rss / MIB))
            unhealthy += not healthy(url)
            print(f"t={rss[-1][0]:6.0f}s  daemon RSS {rss[-1][1]:8.1f} MiB", flush=True)
        reports = [results.get(timeout=600) for _ in workers]
        for w in workers:
            w.join(60)
        minutes = (time.time() - t0) / 60
        counts = {"client": Counter(), "engine": Counter(), "hostile": Counter()}
        acked: set[bytes] = set()
        latencies: list[float] = []
        for kind, found, hashes, waits in reports:
            counts[kind].update(found)
            acked.update(hashes)
            latencies.extend(waits)
        lost, corrupt = verify(url, acked)
        rss.append((time.time() - t0, proc.memory_info().rss / MIB))
        alive = daemon.poll() is None and healthy(url)
    finally:
        daemon.terminate()
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
    return {"minutes": minutes, "counts": counts, "acked": len(acked), "lost": lost + corrupt, "rss": rss,
            "latencies": sorted(latencies), "unhealthy": unhealthy, "alive": alive, "load": os.getloadavg()}


def _frames(namespace: bytes, request: list[bytes]) -> bytes:
    from kvtier.records import encode_header
    from kvtier.wire import END, block_bytes, frame_prefix

    return b"".join(frame_prefix(h) + encode_header(namespace, content(h)) + bytes(block_bytes(content(h)))
                    for h in request) + END


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def rows(phase: dict, base: dict | None) -> list[Row]:
    """The table's rows of ``phase``, with ``base``'s values as baselines."""
    def figures(ph: dict) -> dict:
        clients, engines, hostile = ph["counts"]["client"], ph["counts"]["engine"], ph["counts"]["hostile"]
        served = clients["put"] + clients["lookup"] + clients["get"] + engines["requests"]
        errors = sum(v for k, v in clients.items() if k.startswith(("client_error_", "get_")))
        errors += sum(v for k, v in engines.items() if k.startswith(("load_failure_", "store_failure_", "remote_error_")))
        rss = ph["rss"]
        warm = next((r for t, r in rss if t >= 15 * ph["minutes"]), rss[-1][1])  # a quarter of the run, in s
        return {
            "minutes": ph["minutes"], "requests": served, "rate": served / (60 * ph["minutes"]), "errors": errors,
            "error rate": errors / max(1, served), "acked": ph["acked"], "lost": ph["lost"],
            "corrupt": clients["corrupt_served"] + engines["corrupt_served"],
            "hit rate": engines["hit_blocks"] / max(1, engines["lookup_blocks"]) if engines["requests"] else 0.0,
            "p50": 1e3 * _quantile(ph["latencies"], 0.50), "p99": 1e3 * _quantile(ph["latencies"], 0.99),
            "rss start": rss[0][1], "rss end": rss[-1][1], "rss max": max(r for _, r in rss),
            "rss growth": rss[-1][1] - warm, "rss growth %": 100 * (rss[-1][1] - warm) / warm,
            "hostile attempts": sum(v for k, v in hostile.items() if k.endswith("attempts")),
            "hostile cut": sum(v for k, v in hostile.items() if k.endswith(" cut")),
            "unhealthy": ph["unhealthy"], "alive": float(ph["alive"]), "load": ph["load"][0],
        }

    now, then = figures(phase), figures(base) if base else None
    spec = [("minutes", "minutes", "min"), ("requests served (honest clients + engines)", "requests", "requests"),
            ("requests per second", "rate", "req/s"), ("errors of honest clients and engines", "errors", "count"),
            ("error rate", "error rate", "errors/request"), ("blocks acknowledged by the daemon", "acked", "blocks"),
            ("blocks lost (acknowledged, then missing or changed)", "lost", "blocks"),
            ("corrupt blocks served", "corrupt", "blocks"), ("engine hit rate", "hit rate", "fraction"),
            ("honest lookup latency p50", "p50", "ms"), ("honest lookup latency p99", "p99", "ms"),
            ("daemon RSS at start", "rss start", "MiB"), ("daemon RSS at end", "rss end", "MiB"),
            ("daemon RSS max", "rss max", "MiB"), ("daemon RSS growth after warm-up", "rss growth", "MiB"),
            ("daemon RSS growth after warm-up, relative", "rss growth %", "%"),
            ("hostile attempts", "hostile attempts", "count"), ("hostile connections the daemon cut", "hostile cut", "count"),
            ("health checks failed", "unhealthy", "count"), ("daemon alive and healthy at the end", "alive", "bool"),
            ("load average (1 min) at the end", "load", "load")]
    return [Row(metric, now[key], unit, then[key] if then else None, "no hostile clients" if then else "")
            for metric, key, unit in spec]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=8, help="honest client threads in all")
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--hostile", type=int, default=0, help="hostile client threads (bench/hostile.py)")
    parser.add_argument("--baseline", action="store_true", help="first a run without the hostile clients")
    parser.add_argument("--prompts", type=int, default=400, help="prompts in the universe (1-16 blocks of 32 KiB)")
    parser.add_argument("--daemon-cpu", default=str(64 * MIB))
    parser.add_argument("--daemon-disk", default=str(2048 * MIB))
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    base = run_phase(args, hostile=0) if args.baseline and args.hostile else None
    phase = run_phase(args, hostile=args.hostile)
    table = rows(phase, base)
    footnote = "\n".join(
        f"{name}: {dict(sorted(ph['counts'][kind].items()))}" for name, ph in (("run", phase), ("baseline", base))
        if ph for kind in ("client", "engine", "hostile") if ph["counts"][kind]
    ) + f"\nRSS samples (s, MiB): {[(round(t), round(r, 1)) for t, r in phase['rss']]}"
    print_table(f"soak: {args.clients} honest clients in {args.client_procs} processes + {args.engines} engines + "
                f"{args.hostile} hostile, {phase['minutes']:.1f} min", table, footnote)
    if args.json is not None:
        write_json(args.json, "soak", table)
    return table


if __name__ == "__main__":
    main()
