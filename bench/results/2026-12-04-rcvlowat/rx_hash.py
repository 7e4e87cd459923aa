import os, socket, sys, time, xxhash, numpy as np
TOTAL = 256 << 20; BLK = 2 << 20
CH = int(sys.argv[1]) << 10
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1); port = srv.getsockname()[1]
pid = os.fork()
if pid == 0:
    s = socket.create_connection(("127.0.0.1", port))
    data = np.random.randint(0, 255, TOTAL, dtype=np.uint8); mv = memoryview(data)
    for _ in range(12):
        for off in range(0, TOTAL, BLK): s.sendall(mv[off:off+BLK])
    s.close(); os._exit(0)
c, _ = srv.accept(); c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(CH, 512 << 10))
buf = bytearray(256 << 20); mv = memoryview(buf); n = 0
th = tr = 0.0; nb = 0; reads = 0
while True:
    t0 = time.perf_counter()
    k = c.recv_into(mv[n : n + CH]) if n + CH <= len(buf) else c.recv_into(mv[n:])
    t1 = time.perf_counter()
    if k == 0: break
    xxhash.xxh3_64_intdigest(mv[n:n+k])
    t2 = time.perf_counter()
    tr += t1 - t0; th += t2 - t1; nb += k; reads += 1; n = (n + k) % len(buf)
gb = nb / 1e9
print(f"chunk {CH>>10}K: recv {tr*1e3/gb:.0f} ms/GB (wall, incl waits), hash {th*1e3/gb:.0f} ms/GB = {gb/th:.1f} GB/s, {reads/gb:.0f} reads/GB")
os.waitpid(pid, 0)
