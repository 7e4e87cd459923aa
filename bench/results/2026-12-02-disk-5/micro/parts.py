import sys, time, tempfile, os, threading, statistics
sys.path.insert(0, os.getcwd())
import numpy as np, torch, xxhash
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_cache import block_views
from kvtier.app.models import load_model
from kvtier.records import HEADER_NBYTES
from pathlib import Path
model,_,_ = load_model("smollm2")
n = int(sys.argv[1])
p = Prompt(model, n, 16, 0)
root = Path(tempfile.mkdtemp(dir="/tmp/disk5"))
cfg = _config(root, disk=True, top_bytes=(n+64)*p.nbytes//n + (16<<20))
kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
kv.after_request(p.ids[0], p.cache)
kv.close(); kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
hashes, fps = kv.block_keys(p.ids[0]); nb = n // 16; hashes, fps = hashes[:nb], fps[:nb]
buf = kv._hit_buffer.take(n); views = block_views(kv.store.spec, buf)
print("view", views[0].shape, views[0].stride(), views[0].dtype)
disk = kv.store.disk; ns = kv.store.namespace
src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
pool = kv.store.top.tensor
def hash_only():
    with disk.env.begin(buffers=True) as txn:
        for h in hashes:
            xxhash.xxh3_64_intdigest(txn.get(h))
def copy_views():
    with disk.env.begin(buffers=True) as txn:
        for h, v in zip(hashes, views):
            val = txn.get(h)
            s = np.frombuffer(val, np.uint8, offset=HEADER_NBYTES)
            d = v.view(torch.uint8).numpy()
            np.copyto(d, s.reshape(d.shape))
def copy_pool():
    with disk.env.begin(buffers=True) as txn:
        for i, h in enumerate(hashes):
            val = txn.get(h)
            pool[i].view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(val, np.uint8, offset=HEADER_NBYTES)
def views1(): disk.read_into_views(hashes, ns, views, fps)
def views2():
    h = nb // 2
    t = threading.Thread(target=disk.read_into_views, args=(hashes[:h], ns, views[:h], fps[:h]))
    t.start(); disk.read_into_views(hashes[h:], ns, views[h:], fps[h:]); t.join()
def ri():
    for i, (h, f) in enumerate(zip(hashes, fps)): disk.read_into(h, ns, pool[i], f)
cases = dict(copy=lambda: dst.copy_(src), hash_only=hash_only, copy_views=copy_views, copy_pool=copy_pool, views1=views1, views2=views2, read_into=ri)
extra = sys.argv[2:]
if extra:
    ns_ = {}
    exec(open(extra[0]).read(), globals())
    cases.update(EXTRA)
times = {k: [] for k in cases}
for r in range(9):
    for k, f in cases.items():
        t = time.perf_counter(); f(); times[k].append(time.perf_counter() - t)
c = statistics.median(times["copy"][2:])
print(f"n={n} copy {c*1e3:.2f} ms; load {os.getloadavg()[0]:.2f}")
for k, v in times.items():
    m = statistics.median(v[2:]); print(f"  {k:14s} {m*1e3:7.2f} ms {m/c:5.2f}x  min {min(v[2:])/c:5.2f}x")
kv.close()
import shutil; shutil.rmtree(root)
