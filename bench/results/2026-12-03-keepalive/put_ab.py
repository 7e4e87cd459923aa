"""Batch put A/B of keep-alive after a received put body (issue 17): two `kvtier serve`
(bench/server.py's start_daemon: loopback TCP, uvloop, a CPU pool of one round, no DISK, so
every round evicts as in bench/server.py), one closing each received put's connection after its
reply (BENCH_NO_KEEPALIVE=1 through keepalive_sitecustomize/), one keeping it; each a
RemoteTier putting 128 x 2 MiB blocks (bench/server.py's SPEC) in calls of 16 under fresh
hashes. Rounds alternate (ABBA); per round GB/s, daemon CPU (all its threads' schedstat, ns)
and client CPU (this thread's) per GB. argv: ROUNDS. Run from the tree root."""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from bench import server as S  # noqa: E402

HERE = Path(__file__).resolve().parent
N, CALL = 128, 16


def cpu_ns(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
        except OSError:
            pass
    return total


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    torch.set_num_threads(1)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "keepalive_sitecustomize"),
                                                             os.environ.get("PYTHONPATH")]))
    modes = {"close": "1", "keep-alive": "0"}
    procs, clients = {}, {}
    try:
        for mode, flag in modes.items():
            os.environ["BENCH_NO_KEEPALIVE"] = flag
            procs[mode], url = S.start_daemon(Path(tempfile.mkdtemp(prefix=f"keepalive-{mode}-")),
                                              N * S.SPEC.block_nbytes + (16 << 20))
            clients[mode] = S.make_client("daemon", url)
        blocks = torch.randn((N, *S.SPEC.block_shape)).to(S.SPEC.dtype)
        nbytes = N * S.SPEC.block_nbytes

        def put_round(client) -> None:
            hashes = [os.urandom(32) for _ in range(N)]
            for k in range(0, N, CALL):
                stored = client.put(S.NAMESPACE, hashes[k:k + CALL], list(blocks[k:k + CALL]))
                assert all(stored), dict(client.errors)

        for mode in modes:
            for _ in range(3):
                put_round(clients[mode])
        results = {mode: [] for mode in modes}
        for r in range(rounds):
            for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                pid = procs[mode].pid
                s0, c0, t0 = cpu_ns(pid), time.thread_time(), time.perf_counter()
                put_round(clients[mode])
                s1, c1, t1 = cpu_ns(pid), time.thread_time(), time.perf_counter()
                results[mode].append((nbytes / (t1 - t0) / 1e9, (s1 - s0) / 1e6 / (nbytes / 1e9),
                                      (c1 - c0) * 1e3 / (nbytes / 1e9)))
        print(f"batch put, 16 x 2 MiB a call, {rounds} rounds of {nbytes >> 20} MiB per mode (medians)")
        print(f"{'mode':<12} {'GB/s':>6} {'daemon ms CPU/GB':>17} {'client ms CPU/GB':>17}")
        for mode, rows in results.items():
            g, d, c = (statistics.median(x) for x in zip(*rows))
            print(f"{mode:<12} {g:6.2f} {d:17.0f} {c:17.0f}")
        wins = sum(k[0] > c[0] for k, c in zip(results["keep-alive"], results["close"]))
        print(f"keep-alive faster in {wins} of {rounds} paired rounds")
    finally:
        for p in procs.values():
            S.stop(p)


if __name__ == "__main__":
    main()
