"""The phases of HFConnector.before_prefill on a DISK hit (SmolLM2-135M fp32, the prefix on
DISK only, page cache warm, the hit buffer kept), medians of 55 hits after 5:
start1/start2: ms from the call to the start of the first/second I/O job's read into the hit
buffer (keys, lookup, plan, sinks, submit); reads: first read start to last read end;
after: last read end to the call's return; dp_to_end wall/cpu: from delivered_prefix's return
to the call's return (wall = the main thread's CPU: no GIL wait there).
Usage: TREE=<tree> python phases.py [TOKENS] (ab.sh alternates two trees).
"""
import os, sys, time, tempfile, shutil, statistics, functools
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from pathlib import Path
import torch
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config
from kvtier.app.models import load_model
from kvtier.connectors.hf import HIT_BUFFER_BYTES, HFConnector
from kvtier.tiers.disk import DiskTier
EV = []
f = DiskTier.read_into_views
def g(self, *a, **k):
    t = time.perf_counter()
    try: return f(self, *a, **k)
    finally: EV.append((t, time.perf_counter()))
DiskTier.read_into_views = g
import kvtier.connectors.hf as hfm
from kvtier.store.prefetch import PrefetchHandle
TT = []
_dp = PrefetchHandle.delivered_prefix
def dp(self):
    r = _dp(self); TT.append((time.perf_counter(), time.thread_time())); return r
PrefetchHandle.delivered_prefix = dp
model, _, _ = load_model("smollm2")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
prompt = Prompt(model, n, 16, 0)
root = Path(tempfile.mkdtemp(prefix="ph-"))
per_token = prompt.nbytes // prompt.length
cfg = _config(root, disk=True, top_bytes=(n + 64) * per_token + 16 * (1 << 20))
mk = lambda: HFConnector.from_model(model, cfg, model_id="bench-smollm2", model_revision="bench", hit_buffer_bytes=HIT_BUFFER_BYTES)
kv = mk(); kv.after_request(prompt.ids[0], prompt.cache); kv.close(); kv = mk()
R = {"dp_to_end_wall": [], "dp_to_end_cpu": [], "start1": [], "start2": [], "reads": [], "after": [], "total": []}
for i in range(int(os.environ.get("HITS", 60))):
    kv.finish_loads(); kv.store.top.clear(); EV.clear()
    TT.clear(); t0 = time.perf_counter(); plan = kv.before_prefill(prompt.ids); t1 = time.perf_counter(); c1 = time.thread_time()
    assert plan.num_cached_tokens == n
    del plan
    kv.finish_loads()
    ev = sorted(EV)[:2]  # the deliveries (the slot reads come after)
    if i < 5 or len(ev) < 2: continue
    R["dp_to_end_wall"].append(t1 - TT[0][0]); R["dp_to_end_cpu"].append(c1 - TT[0][1])
    R["start1"].append(ev[0][0] - t0); R["start2"].append(ev[1][0] - t0)
    R["reads"].append(max(e for _, e in ev) - ev[0][0]); R["after"].append(t1 - max(e for _, e in ev)); R["total"].append(t1 - t0)
print(" ".join(f"{k} {statistics.median(v)*1e3:.3f}" for k, v in R.items()), "ms (medians)")
kv.close(); shutil.rmtree(root, ignore_errors=True)
