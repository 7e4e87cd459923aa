import os, sys, tempfile, time, subprocess
from pathlib import Path
tree = sys.argv[1]; sys.path.insert(0, tree); os.chdir(tree)
import torch
from bench import server as S
calls = int(sys.argv[2])
work = Path(tempfile.mkdtemp(prefix="lk-"))
dp, du = S.start_daemon(work, 256 << 20)
try:
    d = S.make_client("daemon", du)
    hs = [bytes([i]) * 32 for i in range(32)]
    blocks = torch.randn((32, *S.SPEC.block_shape)).to(S.SPEC.dtype)
    d.put(S.NAMESPACE, hs, list(blocks))
    for _ in range(1000): d.lookup(S.NAMESPACE, hs)
    c0 = S.process_cpu_s(dp.pid); time.sleep(5); c1 = S.process_cpu_s(dp.pid)
    print(f"idle daemon CPU: {(c1-c0)/5*1000:.1f} ms/s")
    p = subprocess.Popen(["strace", "-c", "-f", "-p", str(dp.pid), "-o", "/tmp/lk/strace.txt"])
    time.sleep(1)
    for _ in range(calls): d.lookup(S.NAMESPACE, hs)
    p.terminate(); p.wait()
    print(open("/tmp/lk/strace.txt").read())
finally:
    S.stop(dp)
