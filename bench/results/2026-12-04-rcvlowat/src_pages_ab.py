"""Put from a source tensor on 4 KiB pages vs on huge pages (host_empty), same daemon, and Redis, alternating."""
import os, sys, time, tempfile, statistics
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import server as S
from kvtier.tiers.host_memory import host_empty
from put_ab import cpu_ns  # noqa: E402
N, CALL = 128, 16
rounds = int(sys.argv[1])
torch.set_num_threads(1)
work = Path(tempfile.mkdtemp(prefix="s35src-"))
dp, url = S.start_daemon(work, N * S.SPEC.block_nbytes + (16 << 20)); d = S.make_client("daemon", url)
rp, rurl = S.start_redis(work, 4 * N * S.SPEC.block_nbytes); r = S.make_client("redis", rurl); admin = S.RawRedis(rurl)
small = torch.randn((N, *S.SPEC.block_shape)).to(S.SPEC.dtype)
huge = host_empty(small.numel(), S.SPEC.dtype).view(small.shape); huge.copy_(small)
nbytes = N * S.SPEC.block_nbytes
last = {}
def put_round(kind, src):
    c, pid = (d, dp.pid) if kind == "daemon" else (r, rp.pid)
    if kind == "redis" and "redis" in last: admin.delete_records(last["redis"])
    hashes = [os.urandom(32) for _ in range(N)]
    t0 = time.perf_counter(); s0 = cpu_ns(pid); c0 = cpu_ns(os.getpid())
    for k in range(0, N, CALL):
        assert all(c.put(S.NAMESPACE, hashes[k:k+CALL], list(src[k:k+CALL])))
    t1 = time.perf_counter(); s1 = cpu_ns(pid); c1 = cpu_ns(os.getpid())
    last[kind] = hashes
    return nbytes/(t1-t0)/1e9, (s1-s0)/1e6/(nbytes/1e9), (c1-c0)/1e6/(nbytes/1e9)
cases = [("daemon", "4K", small), ("daemon", "huge", huge), ("redis", "4K", small), ("redis", "huge", huge)]
for k, n, s in cases:
    for _ in range(3): put_round(k, s)
res = {(k, n): [] for k, n, _ in cases}
for i in range(rounds):
    for k, n, s in (cases if i % 2 == 0 else cases[::-1]):
        res[(k, n)].append(put_round(k, s))
print(f"{'who':<7} {'src':<5} {'GB/s med':>8} {'best':>6} {'server ms/GB':>12} {'client ms/GB':>12}")
for (k, n), rows in res.items():
    g, s_, c = zip(*rows); m = statistics.median
    print(f"{k:<7} {n:<5} {m(g):8.2f} {max(g):6.2f} {m(s_):12.0f} {m(c):12.0f}")
S.stop(dp); S.stop(rp)
