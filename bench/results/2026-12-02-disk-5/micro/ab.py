"""Same-process A/B of decode_into_view variants on the real before_prefill (DISK hit)."""
import sys, time, tempfile, os, statistics
sys.path.insert(0, os.getcwd())
import numpy as np, torch
torch.set_num_threads(1)
from bench.hit_path import Prompt, _config, check_hit
from kvtier.connectors.hf import HFConnector
from kvtier.app.models import load_model
import kvtier.tiers.disk as diskmod
import kvtier.records as rec
from kvtier.records import HEADER_NBYTES, _header_for, check_record
from pathlib import Path
model,_,_ = load_model("smollm2")
lengths = [int(x) for x in sys.argv[1].split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9

def make(chunk):
    def decode(value, namespace, out, fingerprint=None):
        record = _header_for(value, namespace, out)
        if isinstance(record, rec.ReadStatus):
            return record
        digest = record.digest(value)
        if record.payload_nbytes:
            src = np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)
            dst = out.view(torch.uint8).numpy()
            rows = src.reshape(dst.shape)
            if chunk == 0:
                digest.update(src); np.copyto(dst, rows)
            elif chunk == -1:
                np.copyto(dst, rows); digest.update(src)
            elif chunk == -2:
                digest.update(src); out.view(torch.uint8).copy_(torch.from_numpy(rows))
            else:
                row_nbytes = record.payload_nbytes // out.shape[0]
                step = max(1, chunk // max(1, row_nbytes))
                for first in range(0, out.shape[0], step):
                    digest.update(src[first * row_nbytes : (first + step) * row_nbytes])
                    np.copyto(dst[first : first + step], rows[first : first + step])
        return check_record(record, digest.intdigest(), fingerprint)
    return decode
variants = {"cur": rec.decode_into_view, "block": make(0), "c256K": make(256 << 10), "c128K": make(128 << 10), "copy_hash": make(-1), "torch": make(-2), "twopass": None}
if os.environ.get("ONLY"):
    variants = {k: variants[k] for k in os.environ["ONLY"].split(",")}
orig_riv = diskmod.DiskTier.read_into_views
def riv_two_pass(self, block_hashes, namespace, views, fingerprints):
    statuses = []
    with self.env.begin(buffers=True) as txn:
        pending = []
        for h, view, fingerprint in zip(block_hashes, views, fingerprints):
            expected = fingerprint if fingerprint is not None else self._fingerprints.get(h)
            value = txn.get(h)
            if value is None:
                statuses.append(rec.ReadStatus.MISSING); continue
            record = _header_for(value, namespace, view)
            if isinstance(record, rec.ReadStatus):
                statuses.append(record); continue
            digest = record.digest(value)
            src = np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)
            digest.update(src)
            st = check_record(record, digest.intdigest(), expected)
            statuses.append(st)
            if st is rec.ReadStatus.OK:
                pending.append((view, src))
        for view, src in pending:
            dst = view.view(torch.uint8).numpy(); np.copyto(dst, src.reshape(dst.shape))
    return statuses
prompts = [Prompt(model, n, 16, s) for s, n in enumerate(lengths)]
per_token = prompts[0].nbytes // prompts[0].length
root = Path(tempfile.mkdtemp(dir="/tmp/disk5"))
cfg = _config(root, disk=True, top_bytes=(max(lengths) + 64) * per_token + (16 << 20))
kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
for p in prompts: kv.after_request(p.ids[0], p.cache)
kv.close(); kv = HFConnector.from_model(model, cfg, model_id="x", model_revision="y")
for p in prompts:
    src = torch.empty(p.nbytes // 4).normal_(); dst = torch.empty_like(src)
    times = {k: [] for k in ["copy", *variants]}
    plans = []
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(list(variants)))
        for k in ["copy", *order]:
            plans.clear(); kv.finish_loads(); kv.store.top.clear()
            if k == "copy":
                t = time.perf_counter(); dst.copy_(src); times[k].append(time.perf_counter() - t); continue
            diskmod.DiskTier.read_into_views = riv_two_pass if k == "twopass" else orig_riv
            diskmod.decode_into_view = variants.get(k, rec.decode_into_view)
            t = time.perf_counter(); plans.append(kv.before_prefill(p.ids)); times[k].append(time.perf_counter() - t)
            assert all(str(m) == "DISK" for m in plans[-1].sources)
            if r == 0: check_hit(model, plans[-1], p)
    c = statistics.median(times["copy"][1:])
    print(f"{p.length} tokens: copy {c*1e3:.2f} ms, load {os.getloadavg()[0]:.2f}: " + ", ".join(
        f"{k} {statistics.median(v[1:])/c:.2f}x (min {min(v[1:])/c:.2f})" for k, v in times.items() if k != "copy"), flush=True)
diskmod.decode_into_view = rec.decode_into_view
kv.close()
import shutil; shutil.rmtree(root)
