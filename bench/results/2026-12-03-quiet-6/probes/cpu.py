"""Server CPU per lookup of 32 blocks: kvtier serve (channel) vs redis-server, alternating rounds.
usage: cpu.py TREE ROUNDS CALLS [pyspy-seconds]"""
import os, sys, tempfile, time, subprocess
from pathlib import Path
tree = sys.argv[1]; sys.path.insert(0, tree); os.chdir(tree)
import torch
from bench import server as S
def ut(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / hz, int(f[12]) / hz
rounds, calls = int(sys.argv[2]), int(sys.argv[3])
spy = float(sys.argv[4]) if len(sys.argv) > 4 else 0
work = Path(tempfile.mkdtemp(prefix="lk-"))
rp, ru = S.start_redis(work, 1 << 30)
dp, du = S.start_daemon(work, 256 << 20)
try:
    d, r = S.make_client("daemon", du), S.make_client("redis", ru)
    from kvtier.hashing import block_keys_for
    hs = [bytes([i]) * 32 for i in range(32)]
    blocks = torch.randn((32, *S.SPEC.block_shape)).to(S.SPEC.dtype)
    for c in (d, r):
        c.put(S.NAMESPACE, hs, list(blocks))
    def run(c):
        for _ in range(calls):
            assert c.lookup(S.NAMESPACE, hs) == 32
    for c in (d, r): run(c)
    res = {"daemon": [], "redis": []}
    for _ in range(rounds):
        for kind, c, pid in (("daemon", d, dp.pid), ("redis", r, rp.pid)):
            u0, k0 = ut(pid); c0, t0 = time.process_time(), time.perf_counter()
            run(c)
            u1, k1 = ut(pid); c1, t1 = time.process_time(), time.perf_counter()
            res[kind].append(((u1 + k1 - u0 - k0) / calls * 1e6, (c1 - c0) / calls * 1e6, (t1 - t0) / calls * 1e6, (u1 - u0) / calls * 1e6, (k1 - k0) / calls * 1e6))
    for kind, v in res.items():
        print(kind, "user", sorted(round(x[3], 1) for x in v), "sys", sorted(round(x[4], 1) for x in v))
        print(kind, "server us/lookup", sorted(round(x[0], 1) for x in v), "client", sorted(round(x[1], 1) for x in v), "wall", sorted(round(x[2], 1) for x in v))
    ds = sorted(x[0] for x in res["daemon"]); rs = sorted(x[0] for x in res["redis"])
    print(f"median ratio {ds[len(ds)//2] / rs[len(rs)//2]:.2f}x  ({ds[len(ds)//2]:.1f} / {rs[len(rs)//2]:.1f} us)")
    if spy:
        out = f"/tmp/lk/spy-{int(time.time())}"
        p = subprocess.Popen([os.path.join(tree, ".venv/bin/py-spy") if os.path.exists(os.path.join(tree, ".venv/bin/py-spy")) else "/work/main/.venv/bin/py-spy",
                              "record", "--pid", str(dp.pid), "--rate", "2000", "--duration", str(int(spy)), "--format", "raw", "-o", out + ".txt", "--native"])
        time.sleep(1)
        t_end = time.time() + spy
        while time.time() < t_end: run(d)
        p.wait(); print("py-spy ->", out + ".txt")
finally:
    S.stop(dp); S.stop(rp)
