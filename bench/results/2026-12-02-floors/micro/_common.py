"""What the micro-benchmarks here share: ``best`` (the fastest of ``r`` runs, seconds) and
``disk_hit_setup`` (bench/hit_path.py's DISK case: a SmolLM2-135M prefix stored, the
connector reopened so that the blocks are on DISK only, the hit buffer's per-block views)."""

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

torch.set_num_threads(1)


def best(fn, r: int = 9) -> float:
    t = float("inf")
    for _ in range(r):
        start = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - start)
    return t


def disk_hit_setup(length: int = 1024) -> SimpleNamespace:
    from bench.hit_path import Prompt, _config
    from kvtier.app.models import load_model
    from kvtier.connectors.hf import HIT_BUFFER_BYTES, HFConnector
    from kvtier.connectors.hf_cache import block_views

    model, _, _ = load_model("smollm2")
    p = Prompt(model, length, 16, 0)
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    per_token = p.nbytes // p.length
    cfg = _config(root, disk=True, top_bytes=(length + 64) * per_token + (16 << 20))

    def connector():
        return HFConnector.from_model(model, cfg, model_id="bench-smollm2", model_revision="bench",
                                      hit_buffer_bytes=HIT_BUFFER_BYTES)

    kv = connector()
    kv.after_request(p.ids[0], p.cache)
    kv.close()
    kv = connector()  # the prefix on DISK only
    n = length // 16
    hashes, fps = kv.block_keys(p.ids[0])
    src = torch.empty(p.nbytes // 4).normal_()

    def close():
        kv.close()
        shutil.rmtree(root)

    s = SimpleNamespace(model=model, prompt=p, kv=kv, root=root, n=n, hashes=hashes[:n], fps=fps[:n],
                        disk=kv.store.disk, ns=kv.store.namespace, src=src, dst=torch.empty_like(src), close=close)
    s.views_of = lambda: block_views(kv.store.spec, kv._hit_buffer.take(n * 16))
    return s


if os.environ.get("KVTIER_MICRO_SELFTEST"):
    print(best(lambda: None, 3) >= 0)
