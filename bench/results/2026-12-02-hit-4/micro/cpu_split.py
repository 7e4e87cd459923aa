"""Where before_prefill's time goes, as bench/hit_path.py runs it (interleaved with the
baseline copy): wrappers time the connector's steps inside the real call.
    python cpu_split.py [length] [repeats]"""
import sys, time, tempfile, shutil, collections
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(1)
from bench.common import Case, measure
from bench.hit_path import Prompt, _config
import kvtier.connectors.hf as hf
from kvtier.connectors.hf import HFConnector
from kvtier.app.models import load_model
model, _, _ = load_model("smollm2")
DISK = "--disk" in sys.argv
sys.argv = [a for a in sys.argv if a != "--disk"]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
R = int(sys.argv[2]) if len(sys.argv) > 2 else 7
prompts = [Prompt(model, m, 16, s) for s, m in enumerate([1024, 2048, 4096])]
p = [q for q in prompts if q.length == n][0]
root = Path(tempfile.mkdtemp())
cfg = _config(root, disk=DISK, top_bytes=sum(q.length + 64 for q in prompts) * (p.nbytes // n) + (16 << 20))
kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
for q in prompts:
    kv.after_request(q.ids[0], q.cache)
if DISK:
    kv.close(); kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
acc = collections.defaultdict(list)
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label].append(time.perf_counter() - t); return r
    setattr(obj, name, g)
wrap(kv, "_keys", "keys"); wrap(kv, "_prompt_info", "prompt_info"); wrap(kv.store, "prefetch", "store.prefetch")
wrap(hf, "gather_into", "gather_into"); wrap(hf, "cache_from_layers", "cache_from_layers")
wrap(kv.store._prefetcher, "publish", "publish"); wrap(kv._hit_buffer, "take", "buffer.take")
wrap(kv, "_load_into_cache", "_load_into_cache"); wrap(kv, "finish_loads", "finish_loads")
from kvtier.store import prefetch as pf
from kvtier.store import results as rs
wrap(pf.PrefetchHandle, "wait", "handle.wait"); wrap(rs.Lease, "release", "lease.release")
wrap(kv.store._prefetcher, "plan", "prefetcher.plan"); wrap(kv.store._lookups, "walk", "lookup walk")
wrap(kv.store.placement, "touch_tail_first", "touch_tail_first"); wrap(kv, "_count_prefill", "_count_prefill")
wrap(hf, "_prompt_tokens", "_prompt_tokens"); wrap(kv._timer, "arm", "timer.arm")
wrap(pf.PrefetchHandle, "delivered_prefix", "delivered_prefix (waits)"); wrap(kv, "_sinks", "_sinks")
wrap(kv.store._prefetcher, "_chain", "_chain"); wrap(kv.store._prefetcher, "_submit", "_submit"); wrap(kv.store._prefetcher, "_reserve", "_reserve")
src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
plans = []
def before():
    plans.clear(); kv.finish_loads(); acc.clear()
    if DISK:
        kv.store.top.clear()
def hit():
    t = time.perf_counter(); plans.append(kv.before_prefill(p.ids)); acc["before_prefill"].append(time.perf_counter() - t)
    snap.append(dict((k, sum(v)) for k, v in acc.items()))
snap = []
a, b = measure([Case(hit, before=before), Case(lambda: dst.copy_(src), before=kv.finish_loads)], R)
best = min(snap, key=lambda s: s["before_prefill"])
print(f"{n}: best before_prefill {a.best_s*1e3:.2f} ms, copy {b.best_s*1e3:.2f} ms ({a.best_s/b.best_s:.3f}x); in the best call:")
for k, v in sorted(best.items(), key=lambda kv_: -kv_[1]):
    print(f"  {k:20s} {v*1e6:8.0f} us  {v/b.best_s:.3f}x")
kv.close(); shutil.rmtree(root)
# (with --deep: the same, with the steps inside _load_into_cache)
