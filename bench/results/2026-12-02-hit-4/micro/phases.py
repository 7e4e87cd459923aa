import sys, time, tempfile, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config
from kvtier.connectors.hf import HFConnector, _prompt_tokens
from kvtier.connectors.hf_cache import cache_from_layers, gather_into
from kvtier.app.models import load_model
from pathlib import Path
model,_,_ = load_model("smollm2")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
p = Prompt(model, n, 16, 0)
root = Path(tempfile.mkdtemp())
cfg = _config(root, disk=False, top_bytes=(n+64)*p.nbytes//n + (16<<20))
kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
kv.after_request(p.ids[0], p.cache)
def best(f, r=15):
    b = 1e9
    for _ in range(r):
        t = time.perf_counter(); f(); b = min(b, time.perf_counter() - t)
    return b * 1e6
plans = []
def hit():
    plans.clear(); plans.append(kv.before_prefill(p.ids))
src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
tokens = _prompt_tokens(p.ids)
res = {}
res["copy"] = best(lambda: dst.copy_(src))
res["before_prefill"] = best(hit)
plans.clear()
res["tokens"] = best(lambda: _prompt_tokens(p.ids))
res["keys"] = best(lambda: kv._keys(tokens, None))
hashes, fps = kv._keys(tokens, None)
res["prompt_info"] = best(lambda: kv._prompt_info(tokens, None))
def pf():
    t = kv._prefetch(tokens, None, hashes, fps)
    t.handle.wait().lease.release()
res["prefetch+wait"] = best(pf)
res["lookup walk"] = best(lambda: kv.store._lookups.walk(hashes[:n//16], None, count=False, load=True))
kvb = kv._hit_buffer.take(n)
t = kv._prefetch(tokens, None, hashes, fps); h = t.handle
ids = h.block_ids
res["gather"] = best(lambda: gather_into(kv.store.spec, kv.store.top.tensor, kvb, ids, list(range(len(ids)))))
L = kv.store.spec.num_layers
res["layer views"] = best(lambda: ([kvb[l, 0].unsqueeze(0) for l in range(L)], [kvb[l, 1].unsqueeze(0) for l in range(L)]))
keys = [kvb[l, 0].unsqueeze(0) for l in range(L)]; values = [kvb[l, 1].unsqueeze(0) for l in range(L)]
res["to(device)"] = best(lambda: [k.to(model.device, non_blocking=True) for k in keys + values])
res["model.device"] = best(lambda: model.device)
res["cache_from_layers"] = best(lambda: cache_from_layers(keys, values))
h.wait().lease.release()
for k, v in res.items():
    print(f"{k:20s} {v:8.1f} us  {v/res['copy']:.3f}x")
import shutil; shutil.rmtree(root)
