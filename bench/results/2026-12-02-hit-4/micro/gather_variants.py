"""Gather variants of a head-major host hit (SmolLM2-135M blocks: [30, 2, 3, 16, 64] fp32)
into a kept [L, 2, H, T, D] buffer, each interleaved with one torch copy_ of the same bytes
(bench.common.measure, best of R).   python gather_variants.py [repeats]"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import numpy as np, torch
torch.set_num_threads(1)
from bench.common import Case, measure
L, H, B, D = 30, 3, 16, 64
R = int(sys.argv[1]) if len(sys.argv) > 1 else 7
nslots = (7168 + 3 * 64) // B
pool = torch.empty(nslots, L, 2, H, B, D).normal_()
def variants(n, out, ids):
    T = n * B
    ob = out.view(torch.uint8).numpy().reshape(L, 2, H, n, B * D * 4)
    slots = pool.view(torch.uint8).numpy().reshape(nslots, L, 2, H, B * D * 4)
    def np_block():
        for i, s in enumerate(ids):
            np.copyto(ob[:, :, :, i], slots[s])
    o2 = out.view(L * 2 * H, n, B * D)
    p2 = pool.view(nslots, L * 2 * H, B * D)
    def torch_block():
        for i, s in enumerate(ids):
            o2[:, i].copy_(p2[s])
    def np_group(g):
        def f():
            for i in range(0, n, g):
                s = ids[i]
                k = min(g, n - i)
                np.copyto(ob[:, :, :, i:i + k], slots[s:s + k].transpose(1, 2, 3, 0, 4))
        return f
    def torch_run():
        s = ids[0]
        o2.copy_(p2[s:s + n].transpose(0, 1))
    def np_rows():  # destination-major: per (l, kv, h) row, all blocks
        s = ids[0]
        src = slots[s:s + n]  # [n, L, 2, H, bytes]
        for l in range(L):
            np.copyto(ob[l], src[:, l].transpose(1, 2, 0, 3))
    ob8 = out.view(torch.float64).numpy().reshape(L, 2, H, n, B * D // 2)
    slots8 = pool.view(torch.float64).numpy().reshape(nslots, L, 2, H, B * D // 2)
    def np_block_f64():
        for i, s in enumerate(ids):
            np.copyto(ob8[:, :, :, i], slots8[s])
    ob2 = ob.reshape(L * 2 * H, n, B * D * 4)
    slots2 = slots.reshape(nslots, L * 2 * H, B * D * 4)
    def np_block_2d():
        for i, s in enumerate(ids):
            np.copyto(ob2[:, i], slots2[s])
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    table = {"numpy per block": np_block, "numpy per block f64": np_block_f64, "numpy per block 2d": np_block_2d, "torch per block": torch_block, "numpy groups of 4": np_group(4),
            "numpy groups of 16": np_group(16), "torch one permuted run": torch_run, "numpy per layer": np_rows}
    return {k: v for k, v in table.items() if only is None or k in only}
for n_tok in (1024, 2048, 4096):
    n = n_tok // B
    out = torch.empty(L, 2, H, n * B, D)
    ids = list(range(3, 3 + n))
    ref = pool[ids].permute(1, 2, 3, 0, 4, 5).reshape(L, 2, H, n * B, D)
    src = torch.empty(out.numel()).normal_(); dst = torch.empty_like(src)
    for name, f in variants(n, out, ids).items():
        out.zero_(); f(); assert torch.equal(out, ref), name
        a, b = measure([Case(f), Case(lambda: dst.copy_(src))], R)
        print(f"{n_tok} {name:24s} {a.best_s*1e3:7.2f} ms  copy {b.best_s*1e3:6.2f}  {a.best_s/b.best_s:.3f}x", flush=True)
