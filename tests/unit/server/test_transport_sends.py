"""What RemoteTier's transport puts on the wire per call (kvtier.tiers.transport): a small
body in the same send as the headers; the deadline watchdog still cuts a call whose deadline
comes before the one it sleeps towards."""

from __future__ import annotations

import socket
import time

from kvtier.tiers.transport import _TCP, WATCHDOG


class _Sock:
    """A connected socket that records what is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendall(self, data) -> None:
        self.sent.append(bytes(data))

    def settimeout(self, timeout) -> None:
        pass

    def getpeername(self):
        return ("127.0.0.1", 8765)


def _conn() -> tuple[_TCP, _Sock]:
    conn, sock = _TCP("127.0.0.1", 8765), _Sock()
    conn.sock = sock
    return conn, sock


def test_a_small_body_goes_out_in_the_same_send_as_the_headers():
    conn, sock = _conn()
    conn.request("POST", "/v1/namespaces/ab/lookup", body=b"\x81\xa1k\xa1v", headers={"Content-Type": "a/b"})
    assert len(sock.sent) == 1
    head, _, body = sock.sent[0].partition(b"\r\n\r\n")
    assert body == b"\x81\xa1k\xa1v"
    assert b"Content-Length: 5" in head.split(b"\r\n") and b"Content-Type: a/b" in head.split(b"\r\n")


def test_a_block_body_still_streams_after_the_headers():
    conn, sock = _conn()
    pieces = [b"x" * 100, memoryview(b"y" * (1 << 17))]
    conn.request("POST", "/v1/namespaces/ab/put", body=pieces, headers={"Content-Length": str(100 + (1 << 17))})
    assert [len(s) for s in sock.sent[1:]] == [100, 1 << 17]
    assert sock.sent[0].endswith(b"\r\n\r\n")
    big, big_sock = _conn()
    big.request("POST", "/x", body=b"z" * (1 << 20))  # over the one-send size: headers, then the body
    assert len(big_sock.sent) == 2 and big_sock.sent[1] == b"z" * (1 << 20)


def test_an_earlier_deadline_wakes_the_watchdog_sleeping_towards_a_later_one():
    late_a, late_b = socket.socketpair()
    early_a, early_b = socket.socketpair()
    tokens = [WATCHDOG.arm(late_a, time.monotonic() + 60.0)]
    time.sleep(0.05)  # the watchdog now sleeps towards the late deadline
    try:
        tokens.append(WATCHDOG.arm(early_a, time.monotonic() + 0.2))
        early_a.settimeout(10.0)
        start = time.monotonic()
        assert early_a.recv(1) == b""  # shut down under the blocked recv
        assert 0.1 < time.monotonic() - start < 3.0
        late_a.setblocking(False)
        try:
            late_a.recv(1)
            raise AssertionError("the late socket was shut down too")
        except BlockingIOError:
            pass  # still open: its deadline has not come
    finally:
        for token in tokens:
            WATCHDOG.disarm(token)
        for s in (late_a, late_b, early_a, early_b):
            s.close()
