import sys, os, time, tempfile, shutil, threading
sys.path.insert(0, "/work/main")
import torch
torch.set_num_threads(1)
from pathlib import Path
from bench.hit_path import Prompt, _config
from kvtier.app.models import load_model
from kvtier.connectors.hf import HIT_BUFFER_BYTES, HFConnector
import kvtier.tiers.disk as D
model, _, _ = load_model("smollm2")
L = int(os.environ.get("LEN", "1024"))
p = Prompt(model, L, 16, 0)
root = Path(tempfile.mkdtemp(dir="/tmp"))
per_token = p.nbytes // p.length
cfg = _config(root, disk=True, top_bytes=(L + 64) * per_token + (16 << 20))
mk = lambda: HFConnector.from_model(model, cfg, model_id="bench-smollm2", model_revision="bench", hit_buffer_bytes=HIT_BUFFER_BYTES)
kv = mk(); kv.after_request(p.ids[0], p.cache); kv.close(); kv = mk()
src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
EV = []
orig = D.DiskTier.read_into_views
def riv(self, hashes, *a, **k):
    t = time.perf_counter(); r = orig(self, hashes, *a, **k); EV.append(("views", threading.current_thread().name[-3:], t, time.perf_counter(), len(hashes))); return r
D.DiskTier.read_into_views = riv
orig2 = D.DiskTier.read_into
def ri(self, *a, **k):
    t = time.perf_counter(); r = orig2(self, *a, **k); EV.append(("into", threading.current_thread().name[-3:], t, time.perf_counter(), 1)); return r
D.DiskTier.read_into = ri
res = []
for i in range(10):
    kv.finish_loads(); kv.store.top.clear(); EV.clear()
    t0 = time.perf_counter(); plan = kv.before_prefill(p.ids); t1 = time.perf_counter()
    kv.finish_loads(); t2 = time.perf_counter(); dst.copy_(src); c = time.perf_counter() - t2
    res.append(((t1 - t0) / c, t1 - t0, c, [(k, th, (a - t0) * 1e3, (b - t0) * 1e3, n) for k, th, a, b, n in EV if a < t1]))
    del plan
res.sort(key=lambda r: r[0])
for ratio, tot, c, ev in res[:3]:
    print(f"ratio {ratio:.2f} total {tot*1e3:.2f} copy {c*1e3:.2f}")
    for e in sorted(ev, key=lambda e: e[2]): print("   %s %s %.2f-%.2f ms (%d blocks)" % e)
kv.close(); shutil.rmtree(root)
