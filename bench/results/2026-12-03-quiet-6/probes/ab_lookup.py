"""A/B of the daemon's server CPU per lookup of 32 blocks: daemons of two trees (and redis-server), alternating
rounds of CALLS lookups, user+system CPU of each server from /proc. usage: ab_lookup.py TREE_A TREE_B ROUNDS CALLS"""
import os, sys, tempfile, time, subprocess, statistics
from pathlib import Path
sys.path.insert(0, "/work/main")
import torch
from bench import server as S
ta, tb, rounds, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
work = Path(tempfile.mkdtemp(prefix="ablk-"))
def start(tree, name):
    port = S.free_port(); (work / name).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = tree
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir",
                             str(work / name / "d"), "--cpu-bytes", str(256 << 20), "--disk-bytes", "0"], cwd=tree, env=env,
                            stdout=open(work / name / "log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import urllib.request
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/healthz", timeout=0.5); break
        except OSError: time.sleep(0.1)
    return proc, url
def ut(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split(); return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
pa, ua = start(ta, "a"); pb, ub = start(tb, "b"); rp, ru = S.start_redis(work, 1 << 30)
try:
    hs = [bytes([i]) * 32 for i in range(32)]
    blocks = torch.randn((32, *S.SPEC.block_shape)).to(S.SPEC.dtype)
    clients = {"A": (S.make_client("A", ua), pa.pid), "B": (S.make_client("B", ub), pb.pid), "redis": (S.make_client("redis", ru), rp.pid)}
    for c, _ in clients.values():
        c.put(S.NAMESPACE, hs, list(blocks))
        for _ in range(2000): assert c.lookup(S.NAMESPACE, hs) == 32
    res = {k: [] for k in clients}
    for r in range(rounds):
        order = ["A", "B", "redis"] if r % 2 == 0 else ["B", "A", "redis"]
        for k in order:
            c, pid = clients[k]
            s0 = ut(pid)
            for _ in range(calls): c.lookup(S.NAMESPACE, hs)
            res[k].append((ut(pid) - s0) / calls * 1e6)
    for k, v in res.items():
        print(f"{k:6s} median {statistics.median(v):6.1f} us  rounds {[round(x, 1) for x in v]}")
    print(f"B/A {statistics.median(res['B']) / statistics.median(res['A']):.3f}; A/redis {statistics.median(res['A']) / statistics.median(res['redis']):.2f}x; B/redis {statistics.median(res['B']) / statistics.median(res['redis']):.2f}x")
finally:
    for p in (pa, pb): p.terminate(); p.wait()
    S.stop(rp)
