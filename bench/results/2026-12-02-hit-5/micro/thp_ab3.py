"""A/B: the real connector's CPU hit with its pool + hit buffer on THP (madvise) or not."""
import sys, time, tempfile, shutil, mmap, statistics
sys.path.insert(0, "/work/wt/hit")
import torch
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config, check_hit
from kvtier.connectors.hf import HFConnector
from kvtier.app.models import load_model
HUGE = 2 << 20
keep = []
def thp_empty(nbytes):
    m = mmap.mmap(-1, nbytes + HUGE)
    keep.append(m)
    t = torch.frombuffer(m, dtype=torch.uint8)
    off = (-t.data_ptr()) % HUGE
    m.madvise(mmap.MADV_HUGEPAGE, off, (nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    return t[off:off + nbytes]
model, _, _ = load_model("smollm2")
lengths = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1024, 2048, 4096]
R = int(sys.argv[2]) if len(sys.argv) > 2 else 9
prompts = [Prompt(model, m, 16, s) for s, m in enumerate(lengths)]
root = Path = None
import pathlib
root = pathlib.Path(tempfile.mkdtemp())
per = prompts[0].nbytes // prompts[0].length
cfg = lambda d: _config(root / d, disk=False, top_bytes=sum(q.length + 64 for q in prompts) * per + (16 << 20))
A = HFConnector.from_model(model, cfg("a"), model_id="x", model_revision="y")
C = HFConnector.from_model(model, cfg("c"), model_id="x", model_revision="y")
B = HFConnector.from_model(model, cfg("b"), model_id="x", model_revision="y")
for kv in (A, B, C):
    for q in prompts:
        kv.after_request(q.ids[0], q.cache)
old = B.store.top.tensor
new = thp_empty(old.numel() * old.element_size()).view(old.dtype).view(old.shape)
new.copy_(old); C.store.top.tensor = new
spec = B.store.spec
maxtok = max(lengths)
buf = thp_empty(spec.num_layers * 2 * spec.num_kv_heads * maxtok * spec.head_dim * 4).view(torch.float32)
buf.fill_(0)
B._hit_buffer._buffer = buf
import subprocess
for q in prompts:
    src = torch.empty(q.nbytes // 4).normal_(); dst = torch.empty_like(src)
    res = {"A": [], "B": [], "C": []}
    for r in range(R + 1):
        for name, kv in [(("A", A), ("B", B), ("C", C))[(i + r) % 3] for i in range(3)]:
            t = time.perf_counter(); dst.copy_(src); c = time.perf_counter() - t
            t = time.perf_counter(); plan = kv.before_prefill(q.ids); h = time.perf_counter() - t
            if r: res[name].append(h / c)
            if r == R: check_hit(model, plan, q)
            del plan
    print(q.length, " ".join(f"{k}: median {statistics.median(v):.2f}x best {min(v):.2f}x" for k, v in res.items()), flush=True)
print(open("/proc/meminfo").read().split("AnonHugePages:")[1].split("\n")[0])
shutil.rmtree(root)
