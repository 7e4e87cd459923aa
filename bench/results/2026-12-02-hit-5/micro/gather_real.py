import sys, time, tempfile, statistics, pathlib
sys.path.insert(0, "/work/wt/hit")
import torch, numpy as np
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config
from kvtier.connectors.hf import HFConnector
from kvtier.connectors.hf_cache import gather_into
from kvtier.app.models import load_model
model, _, _ = load_model("smollm2")
lengths = [1024, 2048]
prompts = [Prompt(model, m, 16, s) for s, m in enumerate(lengths)]
root = pathlib.Path(tempfile.mkdtemp())
per = prompts[0].nbytes // prompts[0].length
A = HFConnector.from_model(model, _config(root, disk=False, top_bytes=sum(q.length + 64 for q in prompts) * per + (16 << 20)), model_id="x", model_revision="y")
for q in prompts: A.after_request(q.ids[0], q.cache)
spec = A.store.spec; pool = A.store.top.tensor
print("pool ptr % 4096", pool.data_ptr() % 4096)
for q in prompts:
    n = q.length // 16
    h = A.store.prefetch(A.block_keys(q.ids[0])[0][:n], fingerprints=A.block_keys(q.ids[0])[1][:n])
    ids = list(h.block_ids); h.wait().lease.release()
    print("runs", ids[0], ids[-1], len(ids))
    kv = A._hit_buffer.take(n * 16)
    print("buf ptr % 4096", kv.data_ptr() % 4096)
    src = torch.empty(q.nbytes // 4).normal_(); dst = torch.empty_like(src)
    g, hh = [], []
    for r in range(12):
        t = time.perf_counter(); dst.copy_(src); c = time.perf_counter() - t
        t = time.perf_counter(); gather_into(spec, pool, kv, ids, range(n)); g.append((time.perf_counter() - t) / c)
        t = time.perf_counter(); dst.copy_(src); c = time.perf_counter() - t
        del kv
        t = time.perf_counter(); p = A.before_prefill(q.ids); hh.append((time.perf_counter() - t) / c)
        del p
        kv = A._hit_buffer.take(n * 16)
    print(q.length, "gather alone median %.2fx best %.2fx; before_prefill median %.2fx best %.2fx" % (statistics.median(g), min(g), statistics.median(hh), min(hh)), flush=True)
