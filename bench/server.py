"""The shared REMOTE tier on loopback: the kvtier daemon against redis-server, in one run.

    python bench/server.py [--total-bytes 256MiB] [--batch-blocks 16] [--clients 32] [--json PATH] [--plot PNG]

Starts ``kvtier serve`` (CPU pool only, temp data dir) and ``redis-server`` (no persistence,
``maxmemory-policy allkeys-lru``) on free loopback ports, then measures through each one's
kvtier client, :class:`~kvtier.tiers.remote.RemoteTier` (daemon) and
:class:`~kvtier.tiers.redis.RedisTier` (Redis), which do the same work: block records with a
checksum header, verified on read, landing in preallocated block tensors. Blocks are 2 MiB
(Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, 16 tokens, bf16).

Rows (value = daemon, baseline = Redis, ratio = daemon / Redis):

- batch put / batch get, GB/s: ``put`` / ``get_into`` of ``--total-bytes`` in calls of
  ``--batch-blocks`` blocks. Every put round writes blocks never written before (a put of a
  present block is skipped by both) into a full cache that reuses its memory (see
  :func:`bench_throughput`); gets read the last round's blocks, every status checked.
- lookup, requests/s: one client, ``lookup`` of ``--lookup-blocks`` present hashes, back to back.
- lookup under ``--clients`` concurrent clients, spread over ``--client-procs`` processes of
  threads that share one client object each (as an engine's I/O threads share one backend):
  closed loop (each client issues its next lookup when the last returns: the most requests/s
  a server answers, and p50/p99 latency at that saturation) and open loop (each client at
  ``--lookup-rate`` lookups/s on a fixed schedule, latency counted from the scheduled time:
  p50/p99 at an engine-like load). Latency is in ms, lower is better, so a ratio < 1
  favours the daemon. Client processes are Python too: on a small machine they compete with
  the servers for cores, which shows in both servers' closed-loop numbers alike.

Mixed workload (bench/server_mixed.py): ``--clients`` closed-loop clients whose calls are 70%
lookups, 20% gets and 10% puts of ``--mixed-blocks`` blocks: calls/s, p50/p99 latency.

The daemon runs on uvloop when it is installed (``kvtier[fast]``; kvtier.server.loop) and
asyncio's loop otherwise (``KVTIER_EVENT_LOOP=asyncio`` in this process's environment forces
it: the one variable passed on); the table's footnote says which.

CPU rows (Linux): CPU time per GB moved and per lookup, of each server process (daemon vs
redis-server, all threads) and of the client (RemoteTier vs RedisTier, in this process),
summed over every round of the cases above. CPU time is not inflated by other jobs on the
cores the way wall time is, so on a busy machine these say more about cost than GB/s do.

Two more rows compare RedisTier with raw redis-py pipelines of ``SET`` / ``GET`` of the bare
block bytes (no header, no checksum; ``GET`` replies copied into the same tensors): what the
record format and verification cost on top of Redis itself.

Timing: cases run interleaved after one warm-up round (:func:`bench.common.measure`), best
of ``--repeats`` (or ``--stat median``); latency rounds alternate daemon and Redis and pool
their samples. Needs ``redis-server`` on PATH (Debian package ``redis-server``).
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

if __package__ in (None, ""):  # run as a script (python bench/server.py): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import (  # noqa: E402
    Case, Row, Stat, apply_threads, arg_parser, measure, print_table, write_outputs,
)
from bench.server_mixed import mixed_rows, put_hot, run_mixed  # noqa: E402
from kvtier.config import parse_bytes  # noqa: E402
from kvtier.hashing import KeyContext  # noqa: E402
from kvtier.records import ReadStatus  # noqa: E402
from kvtier.types import BlockHash, KVSpec  # noqa: E402

NAME = "server"
SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
assert SPEC.block_nbytes == 2 << 20, "the bench is specified on 2 MiB blocks"
NAMESPACE = KeyContext(model_id="kvtier-bench-server", dtype="bfloat16", block_size=SPEC.block_size).namespace()
_START_TIMEOUT_S = 60.0


# -- servers -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn``: the child gets ``sig`` when this process dies (Linux
    ``PR_SET_PDEATHSIG``), so no server outlives a killed run. ``prctl`` is looked up here,
    in the parent: the child only makes the call (no import or lookup after ``fork``)."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, sig)


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} did not start (exit code {proc.poll()}):\n{tail}")
        time.sleep(0.05)


def start_redis(work_dir: Path, maxmemory_bytes: int) -> tuple[subprocess.Popen, str]:
    """redis-server on a free loopback port, files under ``work_dir``; ``(process, url)``."""
    if shutil.which("redis-server") is None:
        raise SystemExit("bench/server.py needs redis-server on PATH (apt-get install redis-server)")
    port = free_port()
    log = work_dir / "redis.log"
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(work_dir), "--save", "",
         "--appendonly", "no", "--logfile", str(log), "--maxmemory", str(maxmemory_bytes),
         "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent(9),
    )

    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    _wait_until(ready, proc, "redis-server", log)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_daemon(work_dir: Path, cpu_bytes: int) -> tuple[subprocess.Popen, str]:
    """``kvtier serve`` on a free loopback port: CPU pool of ``cpu_bytes``, no DISK, data
    under ``work_dir``; ``(process, url)``."""
    port = free_port()
    log = work_dir / "daemon.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    for name in [n for n in env if n.startswith("KVTIER_") and n != "KVTIER_EVENT_LOOP"]:  # only the flags
        del env[name]  # below configure it (and the event loop, when asked)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--data-dir", str(work_dir / "daemon"), "--cpu-bytes", str(cpu_bytes), "--disk-bytes", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent(15),
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=0.5) as response:
                return response.status == 200
        except OSError:
            return False

    _wait_until(ready, proc, "kvtier serve", log)
    return proc, url


def daemon_event_loop(log: Path) -> str:
    """The event loop the daemon announced (``uvloop X.Y.Z`` or ``asyncio``; kvtier.server.loop)."""
    for line in log.read_text(errors="replace").splitlines():
        if "event loop " in line:
            return line.rsplit("event loop ", 1)[1].rstrip(")")
    return "asyncio (not announced: a daemon before kvtier.server.loop)"


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- clients -------------------------------------------------------------------------------
def make_client(kind: str, url: str, timeout_s: float = 10.0):
    """The kvtier client of ``url`` (``kvtier.tiers.backend.make_remote``: RemoteTier for
    http://, RedisTier for redis://), namespace registered; ``kind`` names it in errors."""
    from kvtier.tiers.backend import make_remote

    client = make_remote(url, timeout_s=timeout_s)
    try:
        client.register(NAMESPACE, SPEC)
    except ValueError as exc:
        raise RuntimeError(f"{kind}: {exc}") from exc
    return client


class RawRedis:
    """The baseline under RedisTier: redis-py pipelines of ``SET``/``GET`` of bare block bytes
    (keys ``raw:<hash>``) over the same redis-py connections as RedisTier
    (:func:`kvtier.tiers.redis.client_options`: no copy of a sent block, 1 MiB reads); also
    drops RedisTier's records between put rounds."""

    def __init__(self, url: str) -> None:
        import redis

        from kvtier.tiers.redis import client_options

        self.client = redis.Redis.from_url(url, **client_options(10.0))

    def put(self, hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for h, block in zip(hashes, blocks):
            pipe.set(b"raw:" + h, memoryview(block.view(torch.uint8).numpy()).cast("B"))
        if not all(pipe.execute()):
            raise RuntimeError("raw redis-py SET failed")

    def get_into(self, hashes: Sequence[bytes], outs: Sequence[torch.Tensor]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            pipe.get(b"raw:" + h)
        for value, out in zip(pipe.execute(), outs):
            if value is None or len(value) != SPEC.block_nbytes:
                raise RuntimeError("raw redis-py GET missed")
            np.copyto(out.view(torch.uint8).numpy().reshape(-1), np.frombuffer(value, dtype=np.uint8))

    def delete(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.client.delete(*(b"raw:" + h for h in hashes))

    def delete_records(self, hashes: Sequence[bytes]) -> None:
        """Drop RedisTier's records of ``hashes`` (its key layout: kvtier.tiers.redis)."""
        from kvtier.tiers.redis import RedisTier

        if hashes:
            self.client.delete(*(RedisTier._key(NAMESPACE, h) for h in hashes))


def redis_client_name() -> str:
    """``redis-py X (+ hiredis Y | pure-Python parser)``: the parser sets how fast replies are read."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    if HIREDIS_AVAILABLE:
        import hiredis

        return f"redis-py {redis.__version__} + hiredis {hiredis.__version__}"
    return f"redis-py {redis.__version__}, pure-Python parser"


# -- CPU time ------------------------------------------------------------------------------
def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) from /proc; ``None``
    where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds a case costs this process (the client) and its server process, summed
    over every run of the case, warm-up included. CPU time, unlike wall time, is not
    inflated when other jobs share the cores: on a busy machine it is the steadier measure
    of what an operation costs."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.client_s = self.server_s = 0.0
        self.ops = 0

    def wrap(self, case: Case, ops: int) -> Case:
        """``case`` with its runs metered; each run is ``ops`` operations (requests, bytes)."""

        def run() -> None:
            server0, client0 = process_cpu_s(self.server_pid), time.process_time()
            case.run()
            client1, server1 = time.process_time(), process_cpu_s(self.server_pid)
            self.client_s += client1 - client0
            self.server_s += (server1 or 0.0) - (server0 or 0.0)
            self.ops += ops

        return Case(run, before=case.before)

    def per_op(self, scale: float) -> tuple[float, float]:
        """``(client, server)`` CPU seconds per operation, times ``scale``."""
        return self.client_s / self.ops * scale, self.server_s / self.ops * scale


def cpu_rows(what: str, unit: str, scale: float, daemon: CpuMeter, redis: CpuMeter) -> list[Row]:
    (d_client, d_server), (r_client, r_server) = daemon.per_op(scale), redis.per_op(scale)
    return [
        Row(f"{what}: server CPU", d_server, unit, r_server, "redis-server"),
        Row(f"{what}: client CPU", d_client, unit, r_client, "RedisTier (redis-py)"),
    ]


# -- throughput ----------------------------------------------------------------------------
@dataclass
class Bench:
    num_blocks: int
    batch_blocks: int
    repeats: int
    stat: Stat
    src: torch.Tensor  # [num_blocks, *SPEC.block_shape] bf16: what every put writes
    dst: torch.Tensor  # same shape: where every get lands

    def __post_init__(self) -> None:
        self._chains = itertools.count()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * SPEC.block_nbytes

    def fresh_hashes(self) -> list[BlockHash]:
        tag = next(self._chains)
        return [BlockHash(hashlib.sha256(f"server-bench:{tag}:{i}".encode()).digest()) for i in range(self.num_blocks)]

    def batches(self) -> list[slice]:
        return [slice(i, i + self.batch_blocks) for i in range(0, self.num_blocks, self.batch_blocks)]

    def check(self, got: torch.Tensor, what: str) -> None:
        for i in sorted({0, self.num_blocks // 2, self.num_blocks - 1}):
            if not torch.equal(got[i].view(torch.uint8), self.src[i].view(torch.uint8)):
                raise RuntimeError(f"{what}: block {i} read back differs from the block written")


class PutCase:
    """Put every block under hashes never used before (chosen untimed, in ``before``, which
    also ``drop``s the previous round's blocks where the server lets us)."""

    def __init__(self, b: Bench, put: Callable[[list[BlockHash], list[torch.Tensor]], object],
                 drop: Callable[[list[BlockHash]], object] | None = None) -> None:
        self.b, self._put, self._drop = b, put, drop
        self.hashes: list[BlockHash] = []

    def before(self) -> None:
        if self._drop is not None and self.hashes:
            self._drop(self.hashes)
        self.hashes = self.b.fresh_hashes()

    def run(self) -> None:
        for s in self.b.batches():
            self._put(self.hashes[s], list(self.b.src[s]))

    def case(self) -> Case:
        return Case(self.run, before=self.before)


def tier_put(client, what: str):
    def put(hashes, blocks):
        stored = client.put(NAMESPACE, hashes, blocks)
        if not all(stored):
            raise RuntimeError(f"{what} put: {stored.count(False)} of {len(stored)} blocks not stored ({dict(client.errors)})")
    return put


def tier_get(b: Bench, client, hashes: list[BlockHash], what: str) -> Callable[[], None]:
    outs = list(b.dst)

    def run() -> None:
        for s in b.batches():
            statuses = client.get_into(NAMESPACE, hashes[s], outs[s])
            if any(st is not ReadStatus.OK for st in statuses):
                bad = sorted({st.value for st in statuses if st is not ReadStatus.OK})
                raise RuntimeError(f"{what} get: statuses {bad} ({dict(client.errors)})")
    return run


def bench_throughput(b: Bench, daemon, redis_tier, admin: RawRedis, raw_rows: bool,
                     pids: dict[str, int]) -> tuple[list[Row], list[Row], list, list]:
    """Put and get rows, their CPU rows, and the hashes each server holds afterwards (daemon,
    RedisTier).

    Puts run on a full cache that reuses its memory, as a cache in service does (no
    first-touch page faults in the timed rounds): the daemon's CPU pool holds two rounds and
    evicts the oldest (inside the timed put, as in service); Redis gets each previous round
    deleted untimed (``admin``), so it never evicts and the last round stays for the gets.
    Two untimed warm-up rounds fill both first.
    """
    rows: list[Row] = []
    puts = {"daemon": PutCase(b, tier_put(daemon, "daemon")),
            "redis": PutCase(b, tier_put(redis_tier, "RedisTier"), admin.delete_records)}
    put_cpu = {kind: CpuMeter(pid) for kind, pid in pids.items()}
    t_daemon, t_redis = measure([put_cpu["daemon"].wrap(puts["daemon"].case(), b.nbytes),
                                 put_cpu["redis"].wrap(puts["redis"].case(), b.nbytes)], b.repeats, warmup=2)
    rows.append(Row(f"batch put ({b.batch_blocks} x 2 MiB a call)", t_daemon.throughput(b.nbytes, b.stat), "GB/s",
                    t_redis.throughput(b.nbytes, b.stat), "RedisTier on redis-server"))
    get_daemon = tier_get(b, daemon, puts["daemon"].hashes, "daemon")
    get_redis = tier_get(b, redis_tier, puts["redis"].hashes, "RedisTier")
    get_cpu = {kind: CpuMeter(pid) for kind, pid in pids.items()}
    b.dst.zero_()
    t_redis, t_daemon = measure([get_cpu["redis"].wrap(Case(get_redis), b.nbytes),
                                 get_cpu["daemon"].wrap(Case(get_daemon), b.nbytes)], b.repeats)
    b.check(b.dst, "daemon get")
    rows.append(Row(f"batch get ({b.batch_blocks} x 2 MiB a call, verified)", t_daemon.throughput(b.nbytes, b.stat),
                    "GB/s", t_redis.throughput(b.nbytes, b.stat), "RedisTier on redis-server"))
    cpu = (cpu_rows("batch put", "ms CPU/GB", 1e12, put_cpu["daemon"], put_cpu["redis"])
           + cpu_rows("batch get", "ms CPU/GB", 1e12, get_cpu["daemon"], get_cpu["redis"]))
    if raw_rows:
        raw_put = PutCase(b, admin.put, admin.delete)
        t_tier, t_raw = measure([puts["redis"].case(), raw_put.case()], b.repeats, warmup=2)
        rows.append(Row("RedisTier put (records) vs raw redis-py SET", t_tier.throughput(b.nbytes, b.stat), "GB/s",
                        t_raw.throughput(b.nbytes, b.stat), "redis-py pipeline SET, bare bytes"))
        get_redis = tier_get(b, redis_tier, puts["redis"].hashes, "RedisTier")
        raw_hashes = raw_put.hashes

        def raw_get() -> None:
            for s in b.batches():
                admin.get_into(raw_hashes[s], list(b.dst[s]))

        t_tier, t_raw = measure([Case(get_redis), Case(raw_get)], b.repeats)
        b.check(b.dst, "raw redis-py get")
        rows.append(Row("RedisTier get (verified) vs raw redis-py GET", t_tier.throughput(b.nbytes, b.stat), "GB/s",
                        t_raw.throughput(b.nbytes, b.stat), "redis-py pipeline GET + copy"))
        admin.delete(raw_hashes)
    return rows, cpu, puts["daemon"].hashes, puts["redis"].hashes


def bench_lookup(b: Bench, daemon, redis_tier, daemon_hashes, redis_hashes, lookup_blocks: int, calls: int,
                 pids: dict[str, int]) -> tuple[Row, list[Row]]:
    """One client's lookups/s, and the CPU rows of a lookup."""
    def loop(client, hashes, what):
        def run() -> None:
            for _ in range(calls):
                if client.lookup(NAMESPACE, hashes) != len(hashes):
                    raise RuntimeError(f"{what} lookup missed present blocks ({dict(client.errors)})")
        return Case(run)

    meters = {kind: CpuMeter(pid) for kind, pid in pids.items()}
    t_daemon, t_redis = measure(
        [meters["daemon"].wrap(loop(daemon, daemon_hashes[:lookup_blocks], "daemon"), calls),
         meters["redis"].wrap(loop(redis_tier, redis_hashes[:lookup_blocks], "RedisTier"), calls)], b.repeats,
    )
    per_s = {"best": lambda t: calls / t.best_s, "median": lambda t: calls / t.median_s}[b.stat]
    row = Row(f"lookup of {lookup_blocks} blocks, 1 client", per_s(t_daemon), "requests/s", per_s(t_redis),
              "RedisTier on redis-server")
    return row, cpu_rows(f"lookup of {lookup_blocks} blocks", "us CPU/request", 1e6, meters["daemon"], meters["redis"])


# -- latency under concurrent clients ------------------------------------------------------
def _latency_worker(kind: str, url: str, hashes: list[bytes], threads: int, start_at: float, warmup_s: float,
                    duration_s: float, rate: float | None, first_client: int, clients: int) -> tuple[list[float], int]:
    """One client process: ``threads`` clients (threads sharing one client object).

    ``rate=None``: closed loop, each thread issues its next lookup when the last returns.
    ``rate``: open loop, each thread issues lookups on a fixed schedule of ``rate`` per second
    (clients staggered over one period); a lookup's latency runs from its scheduled time, so
    a client that falls behind counts its wait (no coordinated omission).

    Returns the latencies (seconds) of the lookups scheduled inside the measured window
    (``start_at + warmup_s`` to that ``+ duration_s``, wall clock: the same window for every
    process), and the number of lookups that missed present blocks.
    """
    client = make_client(kind, url)
    hashes = [BlockHash(h) for h in hashes]
    results: list[list[float]] = [[] for _ in range(threads)]
    misses = [0] * threads
    # perf_counter time of the wall-clock start, so that schedules are exact.
    base = time.perf_counter() + (start_at - time.time())
    measure_from, end = base + warmup_s, base + warmup_s + duration_s

    def run(i: int) -> None:
        period = None if rate is None else 1.0 / rate
        due = base + (0.0 if period is None else period * (first_client + i) / clients)
        while True:
            now = time.perf_counter()
            if now < due:
                time.sleep(due - now)
            scheduled = due if period is not None else time.perf_counter()
            if scheduled >= end:
                break
            n = client.lookup(NAMESPACE, hashes)
            latency = time.perf_counter() - scheduled
            if n != len(hashes):
                misses[i] += 1
            if scheduled >= measure_from:
                results[i].append(latency)
            if period is not None:
                due += period

    run_threads(run, threads)
    client.close()
    return [x for r in results for x in r], sum(misses)


def run_threads(target: Callable[[int], None], n: int) -> None:
    """``target(i)`` for ``i`` in ``range(n)``, each on its own thread; returns when all are done."""
    workers = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def spread(clients: int, procs: int) -> tuple[list[int], list[int]]:
    """``(clients per process, index of each process's first client)``; one process for ``procs == 0``."""
    per_proc = [clients // procs + (i < clients % procs) for i in range(procs)] if procs else [clients]
    return per_proc, [sum(per_proc[:i]) for i in range(len(per_proc))]


def dispatch(pool, worker: Callable, args: list[tuple], duration_s: float) -> list:
    """``worker(*a)`` for each ``a`` of ``args`` on the pool's processes (here, for the one
    ``a``, without a pool); their results."""
    if pool is None:
        return [worker(*args[0])]
    jobs = [pool.apply_async(worker, a) for a in args]
    return [job.get(timeout=120 + duration_s) for job in jobs]


@dataclass
class LatencyResult:
    latencies_s: list[float]
    seconds: float

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.latencies_s), q)) * 1e3

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies_s) / self.seconds


def _warm_worker() -> None:
    """Pool initializer: import both clients while the servers start, not while timing."""
    torch.set_num_threads(1)
    import kvtier.tiers.redis  # noqa: F401
    import kvtier.tiers.remote  # noqa: F401


def client_pool(clients: int, procs: int):
    """The latency clients' processes (spawned: no fork of a process holding torch threads);
    made first so that their start-up overlaps the servers' and the throughput rows.
    ``None`` for ``procs == 0``: the clients run as threads of this process."""
    if procs == 0:
        return None
    return multiprocessing.get_context("spawn").Pool(min(procs, clients), initializer=_warm_worker)


def _pid_after(delay_s: float) -> int:
    time.sleep(delay_s)
    return os.getpid()


def _wait_for_workers(pool, procs: int) -> None:
    """Return once every pool process has started (imports done): a late process would join
    the timed window late and the window would hold fewer clients."""
    deadline = time.monotonic() + 300
    while len(set(pool.map(_pid_after, [0.2] * procs, chunksize=1))) < procs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {procs} client processes did not all start")


def run_clients(pool, urls: dict[str, str], hashes: dict[str, list[BlockHash]], clients: int, procs: int,
                rounds: int, duration_s: float, rate: float | None) -> dict[str, LatencyResult]:
    """``clients`` lookup clients over ``procs`` processes against each server in turn,
    ``rounds`` times (alternating servers); samples pooled per server."""
    procs = min(procs, clients)
    per_proc, firsts = spread(clients, procs)
    results = {kind: LatencyResult([], 0.0) for kind in urls}
    if pool is not None:
        _wait_for_workers(pool, procs)
    for _ in range(rounds):
        for kind, url in urls.items():
            start_at = time.time() + 0.5
            args = [(kind, url, [bytes(h) for h in hashes[kind]], n, start_at, 0.3, duration_s, rate, first, clients)
                    for n, first in zip(per_proc, firsts)]
            for latencies, misses in dispatch(pool, _latency_worker, args, duration_s):
                if misses:
                    raise RuntimeError(f"{kind}: {misses} lookups under load missed present blocks")
                results[kind].latencies_s += latencies
            results[kind].seconds += duration_s
    return results


def bench_concurrency(pool, urls: dict[str, str], hashes: dict[str, list[BlockHash]], clients: int, procs: int,
                      rounds: int, duration_s: float, rate: float) -> list[Row]:
    """Closed loop (the most each server answers, and the latency at that load) and open
    loop at ``rate`` lookups/s per client (latency at an engine-like load)."""
    n = len(hashes["daemon"])
    who = f"{clients} clients ({min(procs, clients)} procs)" if procs else f"{clients} clients (threads)"
    base = "RedisTier on redis-server"
    rows: list[Row] = []
    closed = run_clients(pool, urls, hashes, clients, procs, rounds, duration_s, None)
    d, r = closed["daemon"], closed["redis"]
    rows += [
        Row(f"lookup of {n} blocks, {who}, closed loop", d.requests_per_s, "requests/s", r.requests_per_s, base),
        Row(f"lookup p50 latency, {who}, closed loop", d.percentile_ms(50), "ms", r.percentile_ms(50), base),
        Row(f"lookup p99 latency, {who}, closed loop", d.percentile_ms(99), "ms", r.percentile_ms(99), base),
    ]
    opened = run_clients(pool, urls, hashes, clients, procs, rounds, duration_s, rate)
    d, r = opened["daemon"], opened["redis"]
    load = f"{who} x {rate:g}/s"
    rows += [
        Row(f"lookup p50 latency, {load}", d.percentile_ms(50), "ms", r.percentile_ms(50), base),
        Row(f"lookup p99 latency, {load}", d.percentile_ms(99), "ms", r.percentile_ms(99), base),
    ]
    return rows


# -- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> list[Row]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--total-bytes", type=parse_bytes, default=256 << 20,
                        help="bytes per put/get measurement, a multiple of 2 MiB (default 256MiB)")
    parser.add_argument("--batch-blocks", type=int, default=16, help="blocks per put/get call (default 16 = 32 MiB)")
    parser.add_argument("--lookup-blocks", type=int, default=32, help="block hashes per lookup (default 32)")
    parser.add_argument("--lookup-calls", type=int, default=1000, help="lookups per single-client measurement")
    parser.add_argument("--clients", type=int, default=32, help="concurrent lookup clients (default 32)")
    parser.add_argument("--client-procs", type=int, default=4,
                        help="processes the clients are spread over (0: threads of this process)")
    parser.add_argument("--latency-seconds", type=float, default=2.0, help="measured seconds per latency round")
    parser.add_argument("--latency-rounds", type=int, default=2, help="rounds per server (alternating)")
    parser.add_argument("--lookup-rate", type=float, default=10.0,
                        help="lookups/s of each client in the open-loop rows (default 10: 32 engines at 10 requests/s)")
    parser.add_argument("--mixed-blocks", type=int, default=4,
                        help="blocks per get and put of the mixed workload (default 4 = 8 MiB; 0: no mixed rows)")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw redis-py rows")
    parser.add_argument("--dir", type=Path, default=None, help="where the temp dir goes (default: system temp)")
    args = parser.parse_args(argv)
    num_blocks = args.total_bytes // SPEC.block_nbytes
    if num_blocks < 1 or args.total_bytes % SPEC.block_nbytes:
        parser.error(f"expected --total-bytes a positive multiple of {SPEC.block_nbytes}, got {args.total_bytes}")
    counts = (args.batch_blocks, args.lookup_blocks, args.lookup_calls, args.clients, args.latency_rounds, args.repeats)
    if min(counts) < 1 or args.client_procs < 0 or not args.latency_seconds > 0 or not args.lookup_rate > 0:
        parser.error("expected positive sizes, counts, --latency-seconds and --lookup-rate (--client-procs >= 0)")
    if not 0 <= args.mixed_blocks <= args.lookup_blocks:
        parser.error("expected 0 <= --mixed-blocks <= --lookup-blocks (the mix's hot set)")
    if args.lookup_blocks > num_blocks:
        parser.error(f"expected --lookup-blocks <= {num_blocks} blocks of --total-bytes")
    threads = apply_threads(args.threads)
    # The daemon's pool holds two put rounds (it evicts the older as a new one comes in);
    # Redis, whose old rounds are deleted untimed, gets room for four: it never evicts.
    round_bytes = num_blocks * SPEC.block_nbytes
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-server-", dir=args.dir))
    daemon_proc = redis_proc = None
    clients = []
    pool = client_pool(args.clients, args.client_procs)
    try:
        redis_proc, redis_url = start_redis(work_dir, 4 * round_bytes + (256 << 20))  # + Redis's own overhead
        daemon_proc, daemon_url = start_daemon(work_dir, 2 * round_bytes + (16 << 20))
        daemon_loop = daemon_event_loop(work_dir / "daemon.log")
        daemon = make_client("daemon", daemon_url)
        redis_tier = make_client("redis", redis_url)
        clients = [daemon, redis_tier]
        admin = RawRedis(redis_url)
        redis_version = admin.client.info("server")["redis_version"]
        g = torch.Generator().manual_seed(0)
        src = torch.randn((num_blocks, *SPEC.block_shape), generator=g).to(SPEC.dtype)
        dst = torch.zeros_like(src)
        b = Bench(num_blocks, args.batch_blocks, args.repeats, args.stat, src, dst)
        pids = {"daemon": daemon_proc.pid, "redis": redis_proc.pid}
        rows, cpu, daemon_hashes, redis_hashes = bench_throughput(b, daemon, redis_tier, admin, not args.no_raw, pids)
        lookup_row, lookup_cpu = bench_lookup(b, daemon, redis_tier, daemon_hashes, redis_hashes, args.lookup_blocks,
                                              args.lookup_calls, pids)
        rows.insert(2, lookup_row)
        rows[3:3] = bench_concurrency(
            pool, {"daemon": daemon_url, "redis": redis_url},
            {"daemon": daemon_hashes[: args.lookup_blocks], "redis": redis_hashes[: args.lookup_blocks]},
            args.clients, args.client_procs, args.latency_rounds, args.latency_seconds, args.lookup_rate,
        )
        if args.mixed_blocks:
            n = args.lookup_blocks
            hot_put = {"daemon": lambda: put_hot(daemon, "daemon", SPEC, NAMESPACE, n),
                       "redis": lambda: put_hot(redis_tier, "redis", SPEC, NAMESPACE, n)}
            mixed = run_mixed(pool, {"daemon": daemon_url, "redis": redis_url}, hot_put, args.clients,
                              args.client_procs, args.latency_rounds, args.latency_seconds, args.mixed_blocks, n)
            extra, mixed_note = mixed_rows(mixed, args.clients, args.mixed_blocks)
        else:
            extra, mixed_note = [], ""
        if process_cpu_s(redis_proc.pid) is not None:
            extra += cpu + lookup_cpu
        at = len(rows) - (0 if args.no_raw else 2)  # before the two raw redis-py rows
        rows[at:at] = extra
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for client in clients:
            client.close()
        stop(daemon_proc)
        stop(redis_proc)
        shutil.rmtree(work_dir, ignore_errors=True)
    title = (
        f"kvtier daemon vs redis-server {redis_version} on loopback ({redis_client_name()}): {num_blocks} x 2 MiB "
        f"blocks ({b.nbytes / 1e9:.2f} GB) per put/get measurement, {args.stat} of {args.repeats} after warm-up; "
        f"{threads} torch threads; {os.cpu_count()} CPUs"
    )
    footnote = (
        f"daemon event loop: {daemon_loop}. ratio = daemon / Redis (for latency and CPU, < 1 favours the daemon). "
        "Goals (issue 17): batch put >= 1.5x, batch get >= 3x, lookup requests/s >= 1.0x with 1 and 32 clients, "
        "lookup p99 at 32 clients x 10/s <= 2 ms, server CPU per lookup <= 2x Redis's, mixed calls/s >= 1.2x. "
        "Clients: RemoteTier (lookups on the daemon's WebSocket channel, one msgpack frame each way; gets and puts "
        "over HTTP, a put's record headers computed as its blocks are sent) and RedisTier (redis-py pipelines); both "
        "verify every record's checksum. "
        + mixed_note
    )
    print_table(title, rows, footnote=footnote)
    write_outputs(args, NAME, rows)
    return rows


if __name__ == "__main__":
    main()
