"""Soak: a ``kvtier serve`` daemon under N concurrent clients plus engine-like processes for
M minutes; reports requests served, errors, the daemon's RSS over time and blocks lost.

    python bench/soak.py [--minutes 3] [--clients 8] [--client-procs 2] [--engines 2] [--json PATH]

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

Every process draws its requests from one universe of prompts with shared prefixes; a block's
content is a function of its hash, so any block served is checked, wherever it came from.
At the end, every block a daemon acknowledged (a ``put`` that returned ``True``) is read back
through a fresh client: lost = acknowledged but missing or not bit-exact.

Rows (no same-run baseline applies: a soak measures stability, not speed): minutes, requests
served and per second, errors and error rate, blocks acknowledged / lost / corrupt served,
engine hit rate, daemon RSS at start / end / max and its growth, in MiB.
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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, print_table, write_json  # noqa: E402
from kvtier.hashing import KeyContext, block_hashes_for  # noqa: E402
from kvtier.types import KVSpec  # noqa: E402

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)  # 32 KiB blocks
NS = KeyContext(model_id="soak", block_size=SPEC.block_size).namespace()
MIB = 1 << 20


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
         "--cpu-bytes", str(cpu_bytes), "--disk-bytes", str(disk_bytes), "--gpu-bytes", "0"],
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
    """Client threads sharing one RemoteTier; sends its counters and acknowledged hashes."""
    from kvtier.records import ReadStatus
    from kvtier.tiers.remote import RemoteTier

    torch.set_num_threads(1)
    remote = RemoteTier(url, timeout_s=10.0)
    remote.register(NS, SPEC)
    requests = universe(prompts)
    counts: Counter = Counter()
    acked: set[bytes] = set()
    lock = threading.Lock()

    def loop(k: int) -> None:
        rnd = random.Random(seed * 1000 + k)
        local: Counter = Counter()
        mine: set[bytes] = set()
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
                remote.lookup(NS, request)
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

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    counts.update({f"client_error_{k}": v for k, v in remote.errors.items()})
    remote.close()
    results.put(("client", dict(counts), sorted(acked)))


def engine_proc(url: str, deadline: float, seed: int, prompts: int, work_dir: str, results) -> None:
    """An engine-like process: TieredStore with small local tiers and the daemon as REMOTE."""
    from kvtier.config import StoreConfig
    from kvtier.store import TieredStore
    from kvtier.tiers.disk import record_footprint

    torch.set_num_threads(1)
    config = StoreConfig(gpu_bytes=16 * SPEC.block_nbytes, cpu_bytes=32 * SPEC.block_nbytes,
                         disk_bytes=128 * record_footprint(SPEC.block_nbytes), block_size=SPEC.block_size,
                         data_dir=work_dir, remote_url=url, remote_timeout_s=10.0)
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
    results.put(("engine", dict(counts), []))


def verify(url: str, acked: set[bytes]) -> tuple[int, int]:
    """(blocks lost, blocks corrupt) among ``acked``, read through a fresh client."""
    from kvtier.records import ReadStatus
    from kvtier.tiers.remote import RemoteTier

    remote = RemoteTier(url, timeout_s=30.0)
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
def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=8, help="client threads in all")
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=400, help="prompts in the universe (1-16 blocks of 32 KiB)")
    parser.add_argument("--daemon-cpu", default=str(64 * MIB))
    parser.add_argument("--daemon-disk", default=str(2048 * MIB))
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import psutil

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
        clients = Counter()
        engines = Counter()
        acked: set[bytes] = set()
        for kind, counts, hashes in reports:
            (clients if kind == "client" else engines).update(counts)
            acked.update(hashes)
        lost, corrupt = verify(url, acked)
        rss.append((time.time() - t0, proc.memory_info().rss / MIB))
        alive = daemon.poll() is None and healthy(url)
    finally:
        daemon.terminate()
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()

    client_requests = clients["put"] + clients["lookup"] + clients["get"]
    engine_requests = engines["requests"]
    errors = sum(v for k, v in clients.items() if k.startswith(("client_error_", "get_")))
    errors += sum(v for k, v in engines.items() if k.startswith(("load_failure_", "store_failure_", "remote_error_")))
    served = client_requests + engine_requests
    rows = [
        Row("minutes", minutes, "min"),
        Row("client requests (put + lookup + get)", client_requests, "requests"),
        Row("engine requests (load + store)", engine_requests, "requests"),
        Row("requests per second", served / (60 * minutes), "req/s"),
        Row("errors", errors, "count"),
        Row("error rate", errors / max(1, served), "errors/request"),
        Row("blocks acknowledged by the daemon", len(acked), "blocks"),
        Row("blocks lost (acknowledged, then missing or changed)", lost + corrupt, "blocks"),
        Row("corrupt blocks served (clients + engines)", clients["corrupt_served"] + engines["corrupt_served"],
            "blocks"),
        Row("engine hit rate", engines["hit_blocks"] / max(1, engines["lookup_blocks"]), "fraction"),
        Row("daemon RSS at start", rss[0][1], "MiB"),
        Row("daemon RSS at end", rss[-1][1], "MiB"),
        Row("daemon RSS max", max(r for _, r in rss), "MiB"),
        Row("daemon RSS growth, last half of the run", rss[-1][1] - rss[len(rss) // 2][1], "MiB"),
        Row("health checks failed", unhealthy, "count"),
        Row("daemon alive and healthy at the end", float(alive), "bool"),
    ]
    footnote = (f"clients: {dict(sorted(clients.items()))}\nengines: {dict(sorted(engines.items()))}\n"
                f"RSS samples (s, MiB): {[(round(t), round(r, 1)) for t, r in rss]}")
    print_table(f"soak: {args.clients} clients in {args.client_procs} processes + {args.engines} engines, "
                f"{minutes:.1f} min", rows, footnote)
    if args.json is not None:
        write_json(args.json, "soak", rows)
    return rows


if __name__ == "__main__":
    main()
