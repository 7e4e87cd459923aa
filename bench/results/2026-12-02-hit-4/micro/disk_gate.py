"""DISK hit with and without the DeliveryGate (promotions held until the prefix's last
delivery), alternating in one process, each case interleaved with one copy of the bytes.
    python disk_gate.py [repeats] [rounds]"""
import sys, tempfile, shutil
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(1)
from bench.common import Case, measure
from bench.hit_path import Prompt, _config
from kvtier.connectors.hf import HFConnector
import kvtier.store.prefetch as pf
from kvtier.app.models import load_model
model, _, _ = load_model("smollm2")
R = int(sys.argv[1]) if len(sys.argv) > 1 else 5
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
prompts = [Prompt(model, m, 16, s) for s, m in enumerate([1024, 2048, 4096])]
per_token = prompts[0].nbytes // 1024
root = Path(tempfile.mkdtemp())
cfg = _config(root, disk=True, top_bytes=(4096 + 64) * per_token + (16 << 20))
mk = lambda: HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
kv = mk()
for q in prompts:
    kv.after_request(q.ids[0], q.cache)
kv.close(); kv = mk()
Gate = pf.DeliveryGate
class NoGate:  # every arrival starts its own promotion at once (the old order)
    def __init__(self, n): pass
    def arrive(self, then=None):
        if then is not None: then()
held = []
class Deferred(Gate):  # held until the connector's next hook (finish_loads) opens it
    def __init__(self, n):
        super().__init__(n + 1); held.append(self)
real_finish = kv.finish_loads
def finish_loads():
    while held:
        held.pop().arrive()
    real_finish()
kv.finish_loads = finish_loads
variants = [("gate", Gate), ("no gate", NoGate), ("deferred", Deferred)]
only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
for rnd in range(ROUNDS):
    for label, gate in [v for v in variants if only is None or v[0] in only]:
        pf.DeliveryGate = gate
        for p in prompts:
            plans = []
            def before():
                plans.clear(); kv.finish_loads(); kv.store.top.clear()
            def hit():
                plans.append(kv.before_prefill(p.ids))
            src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
            a, b = measure([Case(hit, before=before), Case(lambda: dst.copy_(src), before=kv.finish_loads)], R)
            assert all(str(m) == "DISK" for m in plans[-1].sources)
            print(f"round {rnd} {label:8s} {p.length}: {a.best_s*1e3:6.2f} ms  copy {b.best_s*1e3:6.2f}  {a.best_s/b.best_s:.2f}x", flush=True)
pf.DeliveryGate = Gate
kv.close(); shutil.rmtree(root)
