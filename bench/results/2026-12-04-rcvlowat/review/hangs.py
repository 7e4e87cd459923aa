"""Hang hunt: grace 60 s, so any wait for bytes that never come shows as a >5 s stall.
Usage: hangs.py [uvloop|asyncio]"""
import socket
import sys
import time

from harness import (FD_MISMATCH, LOWAT_CALLS, NAMESPACE, RECEIVERS, body_of, daemon_lowats, healthz, put_head,
                     read_reply, start_daemon, stored, verify)

loop = sys.argv[1] if len(sys.argv) > 1 else "uvloop"
d = start_daemon(loop, grace_s=60.0)
T = 5.0
fails = []


def check(name, cond, extra=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name} {extra}", flush=True)
    if not cond:
        fails.append(name)


# 1. the body's last N bytes come alone after a pause; then keep-alive GET on the same socket
salt = 100
for tail in [1, 2, 100, 160, 161, 162, 4096, 65536, 262144, 262145, 300000, 524287, 524288, 524289, 700000,
             (1 << 20) + 161, (1 << 20) + 162, 2 * ((1 << 20) + 161)]:
    salt += 1
    hs, blocks, body = body_of(4, salt)
    with socket.create_connection(("127.0.0.1", d.port), timeout=T) as s:
        s.sendall(put_head(len(body)) + body[:-tail])
        time.sleep(0.3)
        t0 = time.monotonic()
        s.sendall(body[-tail:])
        buf = bytearray()
        try:
            head, b = read_reply(s, buf)
            took = time.monotonic() - t0
            ok = head.startswith(b"HTTP/1.1 200") and stored(b) == [True] * 4
            time.sleep(0.2)
            lw = daemon_lowats(d)
            t1 = time.monotonic()
            s.sendall(healthz())
            h2, _ = read_reply(s, buf)
            took2 = time.monotonic() - t1
            check(f"tail {tail}", ok and took < 1 and h2.startswith(b"HTTP/1.1 200") and took2 < 1,
                  f"put reply {took*1e3:.0f} ms, next GET {took2*1e3:.0f} ms, open sockets' lowat {set(lw)}")
        except (socket.timeout, ConnectionError) as exc:
            check(f"tail {tail}", False, f"{type(exc).__name__} {exc} after {time.monotonic()-t0:.1f}s")
    check(f"tail {tail} bit-exact", verify(d, hs, blocks))

# 2. several puts and GETs on one connection, each sent in one piece and in odd cuts
with socket.create_connection(("127.0.0.1", d.port), timeout=T) as s:
    buf = bytearray()
    for i, cut in enumerate([None, 1, 161, 1000, 600000]):
        hs, blocks, body = body_of(3, 300 + i)
        msg = put_head(len(body)) + body
        t0 = time.monotonic()
        if cut is None:
            s.sendall(msg)
        else:
            split = len(msg) - cut
            s.sendall(msg[:split]); time.sleep(0.1); s.sendall(msg[split:])
        try:
            head, b = read_reply(s, buf)
            ok1 = stored(b) == [True] * 3
            time.sleep(0.15)
            t1 = time.monotonic()
            s.sendall(healthz())
            h2, _ = read_reply(s, buf)
            check(f"keep-alive put #{i} (cut {cut}) + GET", ok1 and time.monotonic() - t1 < 1,
                  f"put {(t1-t0)*1e3:.0f} ms, GET {(time.monotonic()-t1)*1e3:.0f} ms")
        except (socket.timeout, ConnectionError) as exc:
            check(f"keep-alive put #{i}", False, repr(exc))
            break

# 3. pipelined: put + GET + put + GET + GET(close) in one send, and byte-dribbled end
for variant in ["one send", "dribble last 300 bytes"]:
    parts, expect = [], []
    allhs = []
    for i in range(2):
        hs, blocks, body = body_of(2, 400 + i + (10 if variant != "one send" else 0))
        allhs.append((hs, blocks))
        parts += [put_head(len(body)) + body, healthz()]
    parts[-1] = healthz(close=True)
    msg = b"".join(parts)
    with socket.create_connection(("127.0.0.1", d.port), timeout=T) as s:
        t0 = time.monotonic()
        if variant == "one send":
            s.sendall(msg)
        else:
            s.sendall(msg[:-300])
            for k in range(300, 0, -1):
                s.send(msg[-k:][:1]); time.sleep(0.001)
        out = b""
        try:
            while c := s.recv(1 << 16):
                out += c
            n200 = out.count(b"HTTP/1.1 200")
            check(f"pipelined ({variant})", n200 == 4, f"{n200} x 200 in {time.monotonic()-t0:.2f}s")
        except (socket.timeout, ConnectionError) as exc:
            check(f"pipelined ({variant})", False, f"{exc!r} got {out.count(b'HTTP/1.1 200')} replies")
    check(f"pipelined ({variant}) bit-exact", all(verify(d, h, b) for h, b in allhs))

# 4. a bad frame mid-body (frame 2 names another namespace): 400 after the drain, then GET on it
for tail in [None, 1, 5000]:
    hs, blocks, good = body_of(4, 500)
    _, _, bad = body_of(4, 501, namespace=b"\x02" * 32)
    fl = len(good) // 4
    body = good[: 2 * fl] + bad[2 * fl:]
    with socket.create_connection(("127.0.0.1", d.port), timeout=T) as s:
        buf = bytearray()
        msg = put_head(len(body)) + body
        try:
            if tail is None:
                s.sendall(msg)
            else:
                s.sendall(msg[:-tail]); time.sleep(0.3); s.sendall(msg[-tail:])
            t0 = time.monotonic()
            head, b = read_reply(s, buf)
            time.sleep(0.1)
            s.sendall(healthz())
            h2, _ = read_reply(s, buf)
            check(f"bad frame mid-body (tail {tail}) then GET", head.startswith(b"HTTP/1.1 400") and h2.startswith(b"HTTP/1.1 200"),
                  f"{head[:12]!r} in {(time.monotonic()-t0)*1e3:.0f} ms")
        except (socket.timeout, ConnectionError) as exc:
            check(f"bad frame mid-body (tail {tail})", False, repr(exc))

# 5. body ends early at the end byte (extra bytes before Content-Length): 400, then keep-alive
hs, blocks, body = body_of(2, 600)
body2 = body + b"\x00" * 700000
with socket.create_connection(("127.0.0.1", d.port), timeout=T) as s:
    buf = bytearray()
    try:
        s.sendall(put_head(len(body2)) + body2[:-3]); time.sleep(0.3); s.sendall(body2[-3:])
        head, b = read_reply(s, buf)
        s.sendall(healthz())
        h2, _ = read_reply(s, buf)
        check("end byte early + padding, then GET", head.startswith(b"HTTP/1.1 400") and h2.startswith(b"HTTP/1.1 200"),
              head.split(b"\r\n")[0].decode())
    except (socket.timeout, ConnectionError) as exc:
        check("end byte early", False, repr(exc))

time.sleep(0.3)
print("open daemon sockets' lowat now:", set(daemon_lowats(d)))
print("receivers:", len(RECEIVERS), "lowat syscalls:", len(LOWAT_CALLS),
      "values:", sorted({v for v, _ in LOWAT_CALLS})[:12], "...")
print("fd mismatches:", FD_MISMATCH)
print("FAILS:", fails)
d.stop()
