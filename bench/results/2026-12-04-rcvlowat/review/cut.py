"""Body clock vs SO_RCVLOWAT. grace 1.0 s, min rate 1 MiB/s (lowat cap = 256 KiB).
(a) a client that sends X body bytes at once and stops: seconds until the daemon resets it
    (the allowance is grace + bytes/rate: bytes held under the lowat count as not come);
(b) a client that paces its 4-block body at k x the minimum rate (smooth, 8 KiB sends; and
    bursty: one burst per 0.9 grace): must not be cut at k >= 1.
Usage: cut.py [uvloop|asyncio]  (NOLOWAT=1 for A/B)"""
import socket
import sys
import time

from harness import body_of, put_head, read_reply, start_daemon, stored

loop = sys.argv[1] if len(sys.argv) > 1 else "uvloop"
GRACE, RATE = 1.0, 1 << 20
d = start_daemon(loop, grace_s=GRACE, min_rate_bytes_per_s=RATE)
P = 161
print(f"== {loop} (a) stop after X bytes: reset after (s); allowance if all X counted = grace + X/rate")
for x in [P + 10, P + 300_000, P + 600_000, P + (1 << 20) + P + 100_000, P + (1 << 20) + P + 500_000]:
    hs, blocks, body = body_of(4, 800 + x % 97)
    with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
        s.sendall(put_head(len(body)) + body[:x])
        t0 = time.monotonic()
        try:
            while s.recv(1 << 16):
                pass
            how = "closed"
        except ConnectionResetError:
            how = "reset"
        took = time.monotonic() - t0
    print(f"   X={x:>8}: {how} after {took:5.2f} s (allowance {GRACE + x / RATE:5.2f} s)", flush=True)

print(f"== {loop} (b) paced senders")
for mode, k in [("smooth", 1.0), ("smooth", 1.03), ("bursty", 1.0), ("bursty", 1.03), ("smooth", 0.9)]:
    hs, blocks, body = body_of(4, 900 + int(k * 100) + (mode == "bursty"))
    with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
        s.sendall(put_head(len(body)))
        t0 = time.monotonic()
        sent, step = 0, (8192 if mode == "smooth" else int(0.9 * GRACE * RATE * k))
        try:
            while sent < len(body):
                due = t0 + sent / (RATE * k) if mode == "smooth" else t0 + (sent // step) * 0.9 * GRACE
                now = time.monotonic()
                if due > now:
                    time.sleep(due - now)
                n = s.send(body[sent : sent + step])
                sent += n
            buf = bytearray()
            head, b = read_reply(s, buf)
            res = f"{head[:12].decode()} stored={stored(b) if head.startswith(b'HTTP/1.1 200') else b[:80]}"
        except (ConnectionError, OSError) as exc:
            res = f"CUT ({type(exc).__name__}) after {sent} of {len(body)} bytes"
        print(f"   {mode:6} {k:4.2f}x min rate: {res} in {time.monotonic()-t0:.2f}s", flush=True)
d.stop()
