"""A/B of two source trees' daemons (argv: TREE_A TREE_B [CALLS]), alternating rounds of 1-client lookups of 32 present blocks (GET=1: 16-block gets): server CPU (/proc) and rate per call. Run from a checkout (uses bench.server)."""
import sys, time, tempfile, os, subprocess, urllib.request
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from bench.server import NAMESPACE, SPEC, make_client, free_port, stop
from kvtier.types import BlockHash
def cpu(pid):
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split(); t = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / t, int(f[12]) / t
def start(tree, work):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": tree}
    p = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--data-dir", str(work / "d"), "--cpu-bytes", str(512 << 20), "--disk-bytes", "0"], cwd=tree, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/healthz", timeout=0.5); return p, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("no daemon")
trees = sys.argv[1:3]; calls = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
procs, clients = [], []
hashes = [BlockHash(os.urandom(32)) for _ in range(32)]
blocks = torch.randn((32, *SPEC.block_shape)).to(SPEC.dtype)
outs = list(torch.zeros_like(blocks))
GET = os.environ.get("GET") == "1"  # GET=1: 16-block gets (two per round) instead of lookups
try:
    for t in trees:
        p, url = start(t, Path(tempfile.mkdtemp(prefix="dmn-ab-")))
        procs.append(p); c = make_client("d", url); clients.append(c)
        c.put(NAMESPACE, hashes[:16], list(blocks[:16])); c.put(NAMESPACE, hashes[16:], list(blocks[16:]))
        for _ in range(300): assert c.lookup(NAMESPACE, hashes) == 32
    res = {0: [], 1: []}
    for rnd in range(int(os.environ.get("ROUNDS", "6"))):
        for i in (0, 1) if rnd % 2 == 0 else (1, 0):
            c, p = clients[i], procs[i]
            (u0, s0), t0, c0 = cpu(p.pid), time.perf_counter(), time.process_time()
            for _ in range(calls):
                if GET:
                    c.get_into(NAMESPACE, hashes[:16], outs[:16]); c.get_into(NAMESPACE, hashes[16:], outs[16:])
                else:
                    c.lookup(NAMESPACE, hashes)
            (u1, s1), t1, c1 = cpu(p.pid), time.perf_counter(), time.process_time()
            res[i].append((calls / (t1 - t0), (u1 - u0 + s1 - s0) / calls * 1e6, (u1 - u0) / calls * 1e6, (c1 - c0) / calls * 1e6))
    for i in (0, 1):
        r = sorted(res[i], key=lambda x: x[1])
        med = r[len(r) // 2]
        print(f"{trees[i]}: server us/lookup min {r[0][1]:.0f} median {med[1]:.0f} (user median {sorted(x[2] for x in r)[len(r)//2]:.0f}); "
              f"rate median {sorted(x[0] for x in r)[len(r)//2]:.0f}/s; client us median {sorted(x[3] for x in r)[len(r)//2]:.0f}")
finally:
    for p in procs: stop(p)
