import cProfile, pstats, sys, tempfile, time, socket, threading
from pathlib import Path
sys.path.insert(0, ".")
from tests.unit.server.conftest import ThreadDaemon, serve_settings, SPEC, hashes
from tests.conftest import random_blocks
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.transport import Channel
from kvtier.wire import pack
d = ThreadDaemon(serve_settings(Path(tempfile.mkdtemp()), cpu_blocks=64)).start()
ns = bytes(range(32))
t = RemoteTier(d.url); t.register(ns, SPEC)
hs = hashes(32)
t.put(ns, hs, list(random_blocks(SPEC, 32)))
sock = socket.create_connection(("127.0.0.1", d.port)); sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
st, _, rest = Channel.handshake(sock, "127.0.0.1", "/v1/channel", {})
ch = Channel(sock, None, rest)
frame = pack({"op": "lookup", "namespace": ns.hex(), "block_hashes": hs})
for _ in range(500): ch.exchange(frame, 1 << 16)
prof = cProfile.Profile()
ev = threading.Event()
d._loop.call_soon_threadsafe(lambda: (prof.enable(), ev.set())); ev.wait()
for _ in range(5000): ch.exchange(frame, 1 << 16)
ev.clear(); d._loop.call_soon_threadsafe(lambda: (prof.disable(), ev.set())); ev.wait()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
