"""Put A/B of the socket receiver (issue 17, kvtier.server.streams.BodyReceiver), by block
size: one `kvtier serve` per mode (bench/server.py's start_daemon: uvloop when installed, a
128 MiB CPU pool, no DISK), one RemoteTier putting bodies of N blocks of B KiB under fresh
hashes, 128 MiB a round; per shape the median GB/s and daemon CPU ms/GB of ROUNDS rounds, after
three warm-up rounds (the pool's pages touched, eviction on). Modes: "aiohttp" (threshold above
any body: aiohttp's reads, keep-alive), "receiver" (threshold 0: every put received from the
socket, its connection closed after the reply); they alternate PAIRS times. The threshold is
set in the daemon by receive_sitecustomize/. argv: [PAIRS] [ROUNDS]. Run from the tree root."""
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from bench.server import process_cpu_s, start_daemon, stop  # noqa: E402
from kvtier.hashing import KeyContext  # noqa: E402
from kvtier.tiers.remote import RemoteTier  # noqa: E402
from kvtier.types import KVSpec  # noqa: E402

HERE = Path(__file__).resolve().parent
SHAPES = [(256, 16), (256, 64), (1024, 4), (1024, 16), (2048, 1), (2048, 4), (2048, 8), (2048, 16), (4096, 8)]  # (block KiB, blocks per put)
MODES = {"aiohttp": 1 << 62, "receiver": 0}
ROUND_NBYTES = 128 << 20  # daemon CPU is read in 10 ms ticks: 78 ms/GB a tick


def spec_of(block_kib: int) -> KVSpec:  # 8 layers x K/V x 8 heads x 128 x block_size x 2 bytes
    return KVSpec(num_layers=8, num_kv_heads=8, head_dim=128, block_size=block_kib // 32, dtype=torch.float16)


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    torch.set_num_threads(1)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "receive_sitecustomize"),
                                                             os.environ.get("PYTHONPATH")]))
    results: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for pair in range(pairs):
        for mode, threshold in MODES.items():
            os.environ["BENCH_RECEIVE_MIN_NBYTES"] = str(threshold)
            proc, url = start_daemon(Path(tempfile.mkdtemp()), cpu_bytes=128 << 20)
            try:
                client = RemoteTier(url, timeout_s=10.0)
                for kib, n in SHAPES:
                    spec = spec_of(kib)
                    assert spec.block_nbytes == kib << 10
                    namespace = KeyContext(model_id=f"receive-ab-{kib}", dtype="float16",
                                           block_size=spec.block_size).namespace()
                    client.register(namespace, spec)
                    src = list(torch.randn((n, *spec.block_shape)).to(spec.dtype))
                    calls = ROUND_NBYTES // (n * spec.block_nbytes)
                    for r in range(rounds + 3):
                        hs = [[hashlib.sha256(f"{pair}:{mode}:{kib}:{n}:{r}:{c}:{i}".encode()).digest()
                               for i in range(n)] for c in range(calls)]
                        s0, t0 = process_cpu_s(proc.pid), time.perf_counter()
                        for c in range(calls):
                            assert all(client.put(namespace, hs[c], src)), dict(client.errors)
                        wall = time.perf_counter() - t0
                        if r >= 3:
                            results.setdefault((mode, kib, n), []).append(
                                (ROUND_NBYTES / wall / 1e9, (process_cpu_s(proc.pid) - s0) / ROUND_NBYTES * 1e12))
                client.close()
            finally:
                stop(proc)
    print(f"{'block':>8} {'x':>3} {'aiohttp GB/s':>13} {'receiver GB/s':>14} {'ratio':>6} "
          f"{'aiohttp ms/GB':>14} {'receiver ms/GB':>15} {'ratio':>6}")
    for kib, n in SHAPES:
        a = [statistics.median(v) for v in zip(*results[("aiohttp", kib, n)])]
        b = [statistics.median(v) for v in zip(*results[("receiver", kib, n)])]
        print(f"{kib:>4} KiB {n:>3} {a[0]:>13.2f} {b[0]:>14.2f} {b[0] / a[0]:>5.2f}x {a[1]:>14.0f} {b[1]:>15.0f} "
              f"{b[1] / a[1]:>5.2f}x")


if __name__ == "__main__":
    main()
