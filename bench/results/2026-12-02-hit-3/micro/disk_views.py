import sys, time, tempfile, os, threading
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_cache import block_views
from kvtier.app.models import load_model
from pathlib import Path
model,_,_ = load_model("smollm2")
n = int(sys.argv[1])
p = Prompt(model, n, 16, 0)
root = Path(tempfile.mkdtemp())
cfg = _config(root, disk=True, top_bytes=(n+64)*p.nbytes//n + (16<<20))
kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
kv.after_request(p.ids[0], p.cache)
kv.close(); kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
hashes, fps = kv.block_keys(p.ids[0]); nb = n // 16; hashes, fps = hashes[:nb], fps[:nb]
buf = kv._hit_buffer.take(n); views = block_views(kv.store.spec, buf)
disk = kv.store.disk; ns = kv.store.namespace
src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
def best(f, r=7):
    b = 1e9
    for _ in range(r):
        t = time.perf_counter(); f(); b = min(b, time.perf_counter() - t)
    return b
c = best(lambda: dst.copy_(src))
one = best(lambda: disk.read_into_views(hashes, ns, views, fps))
def two():
    h = nb // 2
    t = threading.Thread(target=disk.read_into_views, args=(hashes[:h], ns, views[:h], fps[:h]))
    t.start(); disk.read_into_views(hashes[h:], ns, views[h:], fps[h:]); t.join()
tw = best(two)
pool = kv.store.top.tensor
def ri():
    for i, (h, f) in enumerate(zip(hashes, fps)): disk.read_into(h, ns, pool[i], f)
r = best(ri)
print(f"copy {c*1e3:.2f} ms; read_into_views 1 thread {one/c:.2f}x, 2 threads {tw/c:.2f}x; read_into {r/c:.2f}x")
kv.close()
import shutil; shutil.rmtree(root)
