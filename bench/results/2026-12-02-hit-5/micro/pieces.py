import sys, timeit, tempfile, pathlib
sys.path.insert(0, "/work/wt/hit")
import torch
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config
from kvtier.connectors.hf import HFConnector, _prompt_tokens
from kvtier.connectors import hf_cache
from kvtier.app.models import load_model
model, _, _ = load_model("smollm2")
q = Prompt(model, 1024, 16, 0)
root = pathlib.Path(tempfile.mkdtemp())
A = HFConnector.from_model(model, _config(root, disk=False, top_bytes=(1024 + 64) * (q.nbytes // 1024) + (16 << 20)), model_id="x", model_revision="y")
A.after_request(q.ids[0], q.cache)
kv = A._hit_buffer.take(1024)
def T(name, f, n=300):
    print(f"{name:30s} {timeit.timeit(f, number=n) / n * 1e6:8.1f} us")
T("unsqueeze+2 unbind", lambda: (list(kv.unsqueeze(2)[:, 0].unbind(0)), list(kv.unsqueeze(2)[:, 1].unbind(0))))
T("kv.unbind x 2 level", lambda: [t.unbind(0) for t in kv.unbind(0)])
T("flat view unbind", lambda: kv.view(60, 1, *kv.shape[2:]).unbind(0))
keys, values = list(kv.unsqueeze(2)[:, 0].unbind(0)), list(kv.unsqueeze(2)[:, 1].unbind(0))
T("cache_from_layers", lambda: hf_cache.cache_from_layers(keys, values))
T("_prompt_tokens", lambda: _prompt_tokens(q.ids))
toks = _prompt_tokens(q.ids)
T("_keys", lambda: A._keys(toks, None))
h, f = A._keys(toks, None)
def pf():
    t = A._prefetch(toks, None, h, f, into_buffer=False)
    t.handle.wait().lease.release()
T("_prefetch + wait + release", pf)
T("before_prefill (incl gather)", lambda: A.before_prefill(q.ids), 50)
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(200): pf()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
