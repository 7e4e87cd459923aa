"""A/B of source trees: one `kvtier serve` per TREE (a directory holding kvtier/ and kernels/, run from
there with the editable install's import finder removed), RemoteTier puts of 128 x 2 MiB blocks in
calls of 16 under fresh hashes, rounds alternating; medians of GB/s, CPU per GB (schedstat, all
threads) of daemon and client, the daemon's reads (/proc/PID/io syscr) and voluntary context
switches per GB. argv: ROUNDS TREE_A TREE_B ... Run from the repository root."""
import os, sys, time, tempfile, statistics, subprocess, urllib.request
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
from bench import server as S
N, CALL = 128, 16
def cpu_ns(pid):
    t = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try: t += int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
        except OSError: pass
    return t
def io(pid):
    d = dict(l.split(": ") for l in open(f"/proc/{pid}/io").read().splitlines())
    cs = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        for l in open(f"/proc/{pid}/task/{tid}/status"):
            if l.startswith("voluntary_ctxt"): cs += int(l.split()[1])
    return int(d["syscr"]), cs
def start(work, val):
    port = S.free_port(); url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    tree = val
    env["PYTHONPATH"] = tree
    launcher = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
                f"sys.path.insert(0, {tree!r}); import runpy; sys.argv[0] = 'kvtier'; runpy.run_module('kvtier', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", launcher, "serve", "--host", "127.0.0.1", "--port", str(port),
        "--data-dir", str(work / "d"), "--cpu-bytes", str(N * S.SPEC.block_nbytes + (16 << 20)), "--disk-bytes", "0"],
        stdout=open(work / "log", "wb"), stderr=subprocess.STDOUT, env=env)
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/healthz", timeout=0.5); break
        except OSError: time.sleep(0.1)
    return proc, url
def main():
  rounds = int(sys.argv[1]); vals = sys.argv[2:]
  torch.set_num_threads(1)
  procs, clients = {}, {}
  for v in vals:
      procs[v], url = start(Path(tempfile.mkdtemp(prefix="lowat-")), v); clients[v] = S.make_client("daemon", url)
  blocks = torch.randn((N, *S.SPEC.block_shape)).to(S.SPEC.dtype); nbytes = N * S.SPEC.block_nbytes
  def put_round(v):
      c = clients[v]; hashes = [os.urandom(32) for _ in range(N)]
      i0 = io(procs[v].pid); j0 = io(os.getpid())
      t0 = time.perf_counter(); s0 = cpu_ns(procs[v].pid); c0 = cpu_ns(os.getpid())
      for k in range(0, N, CALL):
          st = c.put(S.NAMESPACE, hashes[k:k+CALL], list(blocks[k:k+CALL])); assert all(st), dict(c.errors)
      t1 = time.perf_counter(); s1 = cpu_ns(procs[v].pid); c1 = cpu_ns(os.getpid())
      i1 = io(procs[v].pid); j1 = io(os.getpid()); g = nbytes/1e9
      return nbytes/(t1-t0)/1e9, (s1-s0)/1e6/(nbytes/1e9), (c1-c0)/1e6/(nbytes/1e9), (i1[0]-i0[0])/g, (i1[1]-i0[1])/g, (j1[1]-j0[1])/g
  for v in vals:
      for _ in range(3): put_round(v)
  res = {v: [] for v in vals}
  for r in range(rounds):
      order = vals if r % 2 == 0 else vals[::-1]
      for v in order: res[v].append(put_round(v))
  print(f"{'tree':>28} {'GB/s med':>8} {'best':>6} {'daemon ms/GB':>12} {'client ms/GB':>12} {'d reads/GB':>10} {'d csw/GB':>9} {'c csw/GB':>9}")
  for v, rows in res.items():
      g, s, c, r_, dc, cc = zip(*rows); m = statistics.median
      print(f"{v:>28} {m(g):8.2f} {max(g):6.2f} {m(s):12.0f} {m(c):12.0f} {m(r_):10.0f} {m(dc):9.0f} {m(cc):9.0f}")
  if len(vals) == 2:
      a, b = res[vals[0]], res[vals[1]]
      print(f"{vals[1]} faster in {sum(y[0] > x[0] for x, y in zip(a, b))} of {rounds} paired rounds")
  for p in procs.values(): S.stop(p)


if __name__ == "__main__":
    main()
