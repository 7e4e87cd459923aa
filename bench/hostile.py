"""Hostile clients of a ``kvtier serve`` daemon for bench/soak.py (issue 12): each holds what
it can for as long as the daemon lets it, then starts over.

Kinds (thread ``k`` plays ``KINDS[k % 4]``), all with the daemon's token, so that they reach
the handlers and not only the authentication:

- ``slow_put``: a put's headers, then its body one byte every 50 ms (holds staging memory);
- ``never_reading_get``: 32 gets of blocks honest clients stored, pipelined (more than the
  kernel's socket buffers take), on a socket with a 4 KiB receive buffer, and never a byte
  read (holds pins while a reply is stuck);
- ``slowloris``: request headers one line every 500 ms, never the blank line;
- ``idle_hoarder``: 16 idle connections, each reopened as soon as the daemon closes it.

Counted per kind: ``attempts`` and ``cut`` (the daemon closed the connection before the client
gave up, which it does after 30 s).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvtier.wire import pack

KINDS = ("slow_put", "never_reading_get", "slowloris", "idle_hoarder")
GIVE_UP_S = 30.0


def _request(method: str, path: str, token: str, content_type: str, length: int) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n").encode()


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed or reset ``sock``, without reading what it sent: the TCP state
    (Linux ``TCP_INFO``: CLOSE after a reset, CLOSE_WAIT after a FIN)."""
    try:
        return sock.getsockopt(socket.SOL_TCP, socket.TCP_INFO, 1)[0] in (_TCP_CLOSE, _TCP_CLOSE_WAIT)
    except OSError:
        return True


_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8


def slow_put(port: int, token: str, path: str, body: bytes, stop: float) -> bool:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_request("POST", path + "/put", token, "application/x-kvtier-frames", len(body)))
        for i in range(len(body)):
            if time.time() > stop:
                return False
            try:
                sock.send(body[i : i + 1])
            except OSError:
                return True
            time.sleep(0.05)
    return False


def never_reading_get(port: int, token: str, path: str, hashes: list[bytes], stop: float) -> bool:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with sock:
        sock.connect(("127.0.0.1", port))
        body = pack({"block_hashes": hashes})
        sock.sendall((_request("POST", path + "/get", token, "application/msgpack", len(body)) + body) * 32)
        return _hold(sock, stop, lambda: _closed(sock))  # the daemon aborts it: a reset, even with data unread


def slowloris(port: int, token: str, path: str, stop: float) -> bool:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
        start = time.time()
        while time.time() < min(stop, start + GIVE_UP_S):
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                return True
            time.sleep(0.5)
    return False


def _hold(sock: socket.socket, stop: float, cut: Callable[[], bool]) -> bool:
    start = time.time()
    while time.time() < min(stop, start + GIVE_UP_S):
        if cut():
            return True
        time.sleep(0.5)
    return False


def idle_hoarder(port: int, stop: float, counts: Counter) -> None:
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    try:
        while time.time() < stop:
            time.sleep(1.0)
            for i, sock in enumerate(conns):
                if _closed(sock):
                    counts["idle_hoarder cut"] += 1
                    counts["idle_hoarder attempts"] += 1
                    sock.close()
                    conns[i] = socket.create_connection(("127.0.0.1", port))
    finally:
        for sock in conns:
            sock.close()


def hostile_proc(port: int, token: str, threads: int, stop: float, path: str, requests: list[list[bytes]],
                 frames_of: Callable[[list[bytes]], bytes], results) -> None:
    """``threads`` hostile threads until ``stop`` (wall time); sends its counters."""
    counts: Counter = Counter()
    lock = threading.Lock()

    def loop(k: int) -> None:
        kind, rnd, local = KINDS[k % len(KINDS)], random.Random(k), Counter()
        if kind == "idle_hoarder":
            idle_hoarder(port, stop, local)
        while kind != "idle_hoarder" and time.time() < stop:
            request = rnd.choice(requests)
            try:
                if kind == "slow_put":
                    cut = slow_put(port, token, path, frames_of(request), stop)
                elif kind == "never_reading_get":
                    cut = never_reading_get(port, token, path, request, stop)
                else:
                    cut = slowloris(port, token, path, stop)
            except OSError:
                cut = True
            local[f"{kind} attempts"] += 1
            local[f"{kind} cut"] += int(cut)
        with lock:
            counts.update(local)

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    results.put(("hostile", dict(counts), [], []))
