import sys, os, time, tempfile, subprocess
from pathlib import Path as _P; sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
from pathlib import Path
import torch
torch.set_num_threads(1)
import bench.server as S
from bench.server import start_daemon, make_client, Bench, PutCase, tier_put, stop, SPEC
from bench.common import Stat
n = 128
work = Path(tempfile.mkdtemp(prefix="s9put-"))
proc, url = start_daemon(work, 2 * n * SPEC.block_nbytes + (16 << 20))
client = make_client("daemon", url)
src = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
b = Bench(n, 16, 3, list(Stat)[0], src, torch.zeros_like(src))
put = PutCase(b, tier_put(client, "daemon"))
for _ in range(3): put.before(); put.run()
perf = None
if os.environ.get("PERF"):
    perf = subprocess.Popen(["perf", "record", "-g", "-p", str(os.getpid() if os.environ.get("SELF") else proc.pid), "-o", "/tmp/kvtier-daemon-put.perf.data"], stderr=subprocess.DEVNULL)
    time.sleep(0.5)
def cpu():
    f = open(f"/proc/{proc.pid}/stat").read().split(")")[1].split(); return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
ts = []
c0 = cpu()
for _ in range(int(os.environ.get("R", "8"))):
    put.before(); t = time.perf_counter(); put.run(); ts.append(time.perf_counter() - t)
c1 = cpu()
nb = n * SPEC.block_nbytes
print("put GB/s best %.2f median %.2f; server CPU ms/GB %.0f" % (nb / min(ts) / 1e9, nb / sorted(ts)[len(ts)//2] / 1e9, (c1 - c0) * 1e3 / (nb * len(ts) / 1e9)))
if perf: perf.send_signal(2); perf.wait()
client.close(); stop(proc)
