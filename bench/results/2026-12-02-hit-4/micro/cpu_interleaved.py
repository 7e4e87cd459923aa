"""CPU hit phases timed as bench/hit_path.py times them: each case interleaved with the
baseline copy (measure(), best of R), so caches are as cold as in the bench.
    python cpu_interleaved.py [length] [repeats]"""
import sys, time, tempfile, shutil
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(1)
from bench.common import Case, measure
from bench.hit_path import Prompt, _config
from kvtier.connectors.hf import HFConnector, _prompt_tokens
from kvtier.connectors.hf_cache import gather_into, cache_from_layers
from kvtier.app.models import load_model
model, _, _ = load_model("smollm2")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
R = int(sys.argv[2]) if len(sys.argv) > 2 else 7
prompts = [Prompt(model, m, 16, s) for s, m in enumerate([1024, 2048, 4096])]
p = [q for q in prompts if q.length == n][0]
per_token = p.nbytes // n
root = Path(tempfile.mkdtemp())
cfg = _config(root, disk=False, top_bytes=sum(q.length + 64 for q in prompts) * per_token + (16 << 20))
kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
for q in prompts:
    kv.after_request(q.ids[0], q.cache)
src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
plans = []
def before():
    plans.clear(); kv.finish_loads()
def hit():
    plans.append(kv.before_prefill(p.ids))
tokens = _prompt_tokens(p.ids)
hashes, fps = kv._keys(tokens, None)
t = kv._prefetch(tokens, None, hashes, fps); ids = t.handle.block_ids; t.handle.wait().lease.release()
spec, pool = kv.store.spec, kv.store.top.tensor
def gather():
    kvb = kv._hit_buffer.take(n)
    gather_into(spec, pool, kvb, ids, list(range(len(ids))))
def overhead():  # everything but the gather
    kvb = kv._hit_buffer.take(n)
    tk = _prompt_tokens(p.ids); h, f = kv._keys(tk, None)
    tt = kv._prefetch(tk, None, h, f); tt.handle.wait().lease.release()
    per = kvb.unsqueeze(2); ks, vs = list(per[:, 0].unbind(0)), list(per[:, 1].unbind(0))
    plans.append(cache_from_layers(ks, vs))
copy = lambda: dst.copy_(src)
for name, f in (("before_prefill", hit), ("gather_into", gather), ("all but gather", overhead)):
    a, b = measure([Case(f, before=before), Case(copy, before=kv.finish_loads)], R)
    print(f"{n} {name:16s} {a.best_s*1e3:7.2f} ms  copy {b.best_s*1e3:6.2f} ms  {a.best_s/b.best_s:.3f}x")
kv.close(); shutil.rmtree(root)
