"""A raw loopback sender of 2 MiB blocks in modes (nohash, whole, hdrN, joinN, chunkK), rounds alternating;
the receiver (a child process) recv_into a ring of RBUF bytes with SO_RCVLOWAT 512 KiB, hashing each read,
then SLOW extra xxh32 passes (a slower receiver). argv: MODES..."""
import os, socket, sys, time, xxhash, numpy as np, statistics
TOTAL = 256 << 20; BLK = 2 << 20
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1); port = srv.getsockname()[1]
pid = os.fork()
if pid == 0:
    c, _ = srv.accept(); c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 512 << 10)
    buf = bytearray(int(os.environ.get("RBUF", str(BLK*2)))); mv = memoryview(buf); n = 0
    while True:
        k = c.recv_into(mv[n : n + (1 << 20)]) if n + (1<<20) <= len(buf) else c.recv_into(mv[n:]); 
        if k == 0: os._exit(0)
        xxhash.xxh3_64_intdigest(mv[n:n+k])
        for _ in range(int(os.environ.get('SLOW', '0'))): xxhash.xxh32_intdigest(mv[n:n+k])
        n = (n + k) % len(buf)
s = socket.create_connection(("127.0.0.1", port))
data = np.random.randint(0, 255, TOTAL, dtype=np.uint8); mv = memoryview(data)
HDR = bytes(4096)
def rnd(mode, ch=256 << 10):
    for off in range(0, TOTAL, BLK):
        b = mv[off:off+BLK]
        if mode == "nohash": s.sendall(b)
        elif mode == "whole":
            d = xxhash.xxh3_64(); d.update(b); d.intdigest(); s.sendall(b)
        elif mode.startswith("hdr"):
            pad = int(mode[3:])
            d = xxhash.xxh3_64(); d.update(b); d.intdigest(); s.sendall(HDR[:pad]); s.sendall(b)
        elif mode.startswith("join"):
            pad = int(mode[4:])
            d = xxhash.xxh3_64(); d.update(b); d.intdigest(); s.sendmsg([HDR[:pad], b])
        elif mode.startswith("chunk"):
            ch = int(mode[5:]) << 10
            d = xxhash.xxh3_64()
            for o in range(0, BLK, ch):
                p = b[o:o+ch]; d.update(p); s.sendall(p)
            d.intdigest()
modes = sys.argv[1:]
res = {m: [] for m in modes}
for m in modes: rnd(m)
for r in range(12):
    for m in (modes if r % 2 == 0 else modes[::-1]):
        t0 = time.perf_counter(); c0 = time.thread_time(); rnd(m); t1 = time.perf_counter(); c1 = time.thread_time()
        res[m].append((TOTAL/1e9/(t1-t0), (c1-c0)*1e3/(TOTAL/1e9)))
for m, rows in res.items():
    g, c = zip(*rows); print(f"{m:10} {statistics.median(g):5.2f} GB/s  sender {statistics.median(c):5.0f} ms CPU/GB")
s.close(); os.waitpid(pid, 0)
