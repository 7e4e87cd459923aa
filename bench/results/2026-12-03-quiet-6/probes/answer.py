"""kvtier's own Python per channel lookup of 32 blocks (no network): answer() and its parts, on the daemon's loop."""
import asyncio, sys, tempfile, time, os
from pathlib import Path
tree = sys.argv[1]; sys.path.insert(0, tree); os.chdir(tree)
N = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
from tests.unit.server.conftest import ThreadDaemon, serve_settings, SPEC, hashes
from tests.conftest import random_blocks
from kvtier.tiers.remote import RemoteTier
from kvtier.wire import pack, unpack_map
from kvtier.server import channel, app as A
from kvtier.server.keys import SETTINGS
d = ThreadDaemon(serve_settings(Path(tempfile.mkdtemp()), cpu_blocks=64, disk_blocks=0)).start()
ns = bytes(range(32))
t = RemoteTier(d.url); t.register(ns, SPEC)
hs = hashes(32)
t.put(ns, hs, list(random_blocks(SPEC, 32)))
frame = pack({"op": "lookup", "namespace": ns.hex(), "block_hashes": hs})
from kvtier.server.tenants import Caller
app = d.app
checks = (A.allowed_namespace, A.checked_hashes, A.lookup_reply)
# a caller: the default tenant (no token file)
from kvtier.server.tenants import Tenant
async def bench():
    caller = Caller(Tenant("default", admin=True))
    out = await channel.answer(app, caller, frame, checks)
    assert unpack_map(out, "x")["num_blocks"] == 32, unpack_map(out, "x")
    res = {}
    for rnd in range(3):
        t0 = time.perf_counter()
        for _ in range(N):
            await channel.answer(app, caller, frame, checks)
        res.setdefault("answer", []).append((time.perf_counter() - t0) / N * 1e6)
        obj = unpack_map(frame, "f")
        t0 = time.perf_counter()
        for _ in range(N): unpack_map(frame, "f")
        res.setdefault("unpack", []).append((time.perf_counter() - t0) / N * 1e6)
        t0 = time.perf_counter()
        for _ in range(N): A.allowed_namespace(caller, obj["namespace"])
        res.setdefault("namespace", []).append((time.perf_counter() - t0) / N * 1e6)
        t0 = time.perf_counter()
        for _ in range(N): h = A.checked_hashes(obj, 1024)
        res.setdefault("hashes", []).append((time.perf_counter() - t0) / N * 1e6)
        t0 = time.perf_counter()
        for _ in range(N): r = await A.lookup_reply(app, caller, ns, h)
        res.setdefault("lookup_reply", []).append((time.perf_counter() - t0) / N * 1e6)
        t0 = time.perf_counter()
        for _ in range(N): pack(r)
        res.setdefault("pack", []).append((time.perf_counter() - t0) / N * 1e6)
    for k, v in res.items():
        print(f"{k:14s} " + " ".join(f"{x:6.2f}" for x in v) + " us")
asyncio.run_coroutine_threadsafe(bench(), d._loop).result(600)
d.stop()
