import sys, time, tempfile, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config
from kvtier.connectors.hf import HFConnector
from kvtier.transfer import handlers
from kvtier.transfer.engine import JobResult
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
src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
def run(label):
    plans = []; ts = []; cs = []
    for _ in range(8):
        plans.clear(); kv.finish_loads(); kv.store.top.clear()
        t = time.perf_counter(); plans.append(kv.before_prefill(p.ids)); ts.append(time.perf_counter() - t)
        kv.finish_loads()
        t = time.perf_counter(); dst.copy_(src); cs.append(time.perf_counter() - t)
    print(label, f"hit {min(ts)*1e3:.2f} ms copy {min(cs)*1e3:.2f} ms ratio {min(ts)/min(cs):.2f}")
run("as is")
real = handlers.DiskHandler._read_slots
handlers.DiskHandler._read_slots = lambda self, job, statuses: JobResult(job.job_id, [s == "ok" for s in statuses], {}, 0)
run("no promotion")
handlers.DiskHandler._read_slots = real
run("as is")
kv.close()
import shutil; shutil.rmtree(root)
