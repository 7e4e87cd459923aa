"""The client's quick path for small calls (issue 17: kvtier.tiers.transport.quick_request):
a lookup on a kept-alive connection is written and read without urllib3, and must refuse
what the urllib3 path refuses (a huge or unframed reply, a trickle past the deadline, a
garbled status line) and fall back to urllib3 (reconnect) when the daemon dropped the
connection before replying."""

from __future__ import annotations

import socket
import time

import pytest

from kvtier.tiers.remote import RemoteTier
from kvtier.wire import pack
from tests.security.conftest import NS, FakeDaemon
from tests.unit.server.conftest import SPEC, hashes

REGISTERED = pack({"namespace": NS.hex(), "block_shape": list(SPEC.block_shape), "dtype": "bfloat16",
                   "max_batch_blocks": 16, "created": True})


def _reply(sock: socket.socket, body: bytes, status: int = 200, extra: bytes = b"") -> None:
    sock.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/msgpack\r\nContent-Length: %d\r\n%s\r\n%s"
                 % (status, len(body), extra, body))


class Scripted(FakeDaemon):
    """Answers a register properly, then each lookup with ``lookups[i]`` (``sock -> None``)
    in turn; counts connections."""

    def __init__(self, *lookups) -> None:
        self.lookups, self.connections = list(lookups), 0
        super().__init__(self._handle)

    def on_connection(self, conn: socket.socket) -> None:
        self.connections += 1
        super().on_connection(conn)

    def _handle(self, sock: socket.socket, head: bytes) -> None:
        if head.startswith(b"PUT "):
            _reply(sock, REGISTERED, 201)
        else:
            self.lookups.pop(0)(sock)


TIMEOUT_S = 0.4  # each hostile reply outlasts it (a trickle of 40 bytes takes 4 s, silence 0.8 s)


def _lookup_after_register(fake: Scripted, n: int = 4, timeout_s: float = TIMEOUT_S) -> tuple[RemoteTier, int, float]:
    remote = RemoteTier(fake.url, timeout_s=timeout_s, retries=1)
    remote.register(NS, SPEC)  # the connection stays open in the pool: the lookup takes the quick path
    assert fake.connections == 1 and not remote.errors
    start = time.monotonic()
    got = remote.lookup(NS, hashes(n))
    return remote, got, time.monotonic() - start


def _trickle(sock: socket.socket, data: bytes) -> None:
    for i in range(len(data)):
        sock.sendall(data[i : i + 1])
        time.sleep(0.1)


HOSTILE = {
    "huge content-length": (lambda s: s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n" + b"\0" * 4096),
                            "protocol"),
    "chunked": (lambda s: s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n" + b"\0" * 16),
                "protocol"),
    "no content-length": (lambda s: s.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n\r\n\x80"),
                          "protocol"),
    "not http": (lambda s: s.sendall(b"SSH-2.0-OpenSSH\r\n\r\n"), "protocol"),
    "endless headers": (lambda s: s.sendall(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * (1 << 20)), "protocol"),
    "trickled headers": (lambda s: _trickle(s, b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n" + b"x" * 40),
                         "timeout"),
    "trickled body": (lambda s: (s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n"), _trickle(s, b"x" * 30)),
                      "timeout"),
    "silent": (lambda s: time.sleep(2 * TIMEOUT_S), "timeout"),
    "cut inside the body": (lambda s: (s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\nabc"),
                                       s.shutdown(socket.SHUT_WR)), "unavailable"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_reply_on_a_kept_alive_connection_is_a_miss_within_the_deadline(name):
    hostile, reason = HOSTILE[name]
    fake = Scripted(hostile)
    try:
        remote, got, elapsed = _lookup_after_register(fake)
        try:
            assert got == 0
            assert elapsed < TIMEOUT_S + 0.75, elapsed
            assert remote.errors[reason] == 1, dict(remote.errors)
            assert fake.connections == 1  # it went over the kept-alive connection, not a new one
        finally:
            remote.close()
    finally:
        fake.close()


def test_a_good_reply_on_a_kept_alive_connection_is_read_and_the_connection_reused():
    ok = lambda s: _reply(s, pack({"num_blocks": 3, "media": ["cpu"] * 3}))  # noqa: E731
    fake = Scripted(ok, ok)
    try:
        remote, got, _ = _lookup_after_register(fake)
        try:
            assert got == 3 and remote.lookup(NS, hashes(4)) == 3
            assert fake.connections == 1 and not remote.errors
            assert fake.received.count(b"POST /v1/namespaces/" + NS.hex().encode() + b"/lookup HTTP/1.1\r\n") == 2
            assert b"\r\nHost: 127.0.0.1:%d\r\n" % fake.port in fake.received
            assert fake.received.count(b"User-Agent: python-urllib3") == 1  # the register only: quick lookups
        finally:
            remote.close()
    finally:
        fake.close()


def test_a_num_blocks_beyond_the_call_is_a_protocol_error():
    fake = Scripted(lambda s: _reply(s, pack({"num_blocks": 5, "media": []})))
    try:
        remote, got, _ = _lookup_after_register(fake)
        try:
            assert got == 0 and remote.errors["protocol"] == 1
        finally:
            remote.close()
    finally:
        fake.close()


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_keep_alive_the_daemon_dropped_falls_back_to_a_new_connection(how):
    """The daemon closed (or reset) the pooled connection before replying: the lookup is
    sent again over a new connection (urllib3's path) and answered."""
    def drop(sock: socket.socket) -> None:
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        sock.close()
        raise OSError("dropped")  # ends this connection's loop in FakeDaemon

    fake = Scripted(drop, lambda s: _reply(s, pack({"num_blocks": 4, "media": ["cpu"] * 4})))
    try:
        remote, got, _ = _lookup_after_register(fake)
        try:
            assert got == 4, dict(remote.errors)
            assert fake.connections == 2 and not remote.errors
        finally:
            remote.close()
    finally:
        fake.close()


def test_quick_lookups_are_signed_and_proven_over_http_and_bearer_over_unix(secure_daemon, tmp_path):
    """Against a real daemon with tokens: over http:// the quick lookups carry a session
    signature the daemon accepts (a hit, no error) and each reply's proof is checked; a
    second tenant sees none of the first's blocks; over the Unix socket, Bearer."""
    from tests.conftest import random_blocks
    from tests.security.conftest import TOKEN_A, TOKEN_B

    daemon = secure_daemon(unix_socket=tmp_path / "run" / "kvtier.sock")
    hs = hashes(3)
    a = RemoteTier(daemon.url, token=TOKEN_A, timeout_s=5.0)
    b = RemoteTier(daemon.url, token=TOKEN_B, timeout_s=5.0)
    try:
        a.register(NS, SPEC)
        b.register(NS, SPEC)
        assert a.put(NS, hs, list(random_blocks(SPEC, 3))) == [True] * 3
        for _ in range(3):  # on the kept-alive connection: the quick path, a new counter each time
            assert a.lookup(NS, hs) == 3
            assert b.lookup(NS, hs) == 0
        assert not a.errors and not b.errors, (dict(a.errors), dict(b.errors))
        assert a._channels, "lookups went over the daemon's channel (kvtier.server.channel)"
        a._session.key = b"\0" * 32  # a wrong session key: the request is refused, no proof matches
        assert a.lookup(NS, hs) == 3  # an open channel was authenticated once, at its upgrade
        a._drop_channels()  # a new channel's upgrade is signed with the wrong key: refused, unproven
        assert a.lookup(NS, hs) == 0 and a.errors["unproven"] == 1
        over_unix = RemoteTier(daemon.unix_url, token=TOKEN_A, timeout_s=5.0)
        try:
            over_unix.register(NS, SPEC)
            assert [over_unix.lookup(NS, hs) for _ in range(3)] == [3, 3, 3] and not over_unix.errors
        finally:
            over_unix.close()
    finally:
        a.close()
        b.close()
