"""Server CPU per GB of batch puts (16 x 2 MiB a call), user/system split; optional py-spy of the daemon.
usage: put_cpu.py ROUNDS [spy_seconds]"""
import os, sys, tempfile, time, subprocess, resource
from pathlib import Path
sys.path.insert(0, "/work/main"); os.chdir("/work/main")
import torch
from bench import server as S
rounds = int(sys.argv[1]); spy = int(sys.argv[2]) if len(sys.argv) > 2 else 0
work = Path(tempfile.mkdtemp(prefix="putcpu-"))
n = 128
dp, du = S.start_daemon(work, 2 * n * S.SPEC.block_nbytes + (16 << 20))
def ut(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split(); hz = os.sysconf("SC_CLK_TCK"); return int(f[11]) / hz, int(f[12]) / hz
try:
    d = S.make_client("daemon", du)
    blocks = torch.randn((n, *S.SPEC.block_shape)).to(S.SPEC.dtype)
    def rnd(r):
        hs = [os.urandom(32) for _ in range(n)]
        for k in range(0, n, 16):
            assert all(d.put(S.NAMESPACE, hs[k:k + 16], list(blocks[k:k + 16])) or [True])
    for r in range(2): rnd(r)
    nb = n * S.SPEC.block_nbytes
    if spy:
        p = subprocess.Popen(["/work/main/.venv/bin/py-spy", "record", "--pid", str(dp.pid), "--rate", "500", "--duration", str(spy), "--format", "raw", "-o", "/tmp/lk/put-spy.txt", "--native"])
        time.sleep(1)
    for r in range(rounds):
        (u0, s0), r0, t0 = ut(dp.pid), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        rnd(r)
        (u1, s1), r1, t1 = ut(dp.pid), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        print(f"{nb / (t1 - t0) / 1e9:.2f} GB/s  server user {(u1-u0)/nb*1e12:.0f} sys {(s1-s0)/nb*1e12:.0f} ms/GB  client user {(r1.ru_utime-r0.ru_utime)/nb*1e12:.0f} sys {(r1.ru_stime-r0.ru_stime)/nb*1e12:.0f} ms/GB")
    if spy: p.wait()
finally:
    S.stop(dp)
