"""The daemon's lookup channel (issue 17: kvtier.server.channel, a WebSocket of msgpack lookup
frames) and the client's side of it (kvtier.tiers.transport.Channel, RemoteTier): the upgrade
is authenticated and guarded like any request, every frame is checked like the HTTP route's
body (typed error frames, the connection keeps serving), a frame over the cap or one that
trickles closes the connection, and the client falls back to HTTP when the upgrade is
refused, reconnects when a channel was dropped, and refuses an unproven upgrade."""

from __future__ import annotations

import base64
import hashlib
import socket
import time

import pytest

from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.transport import Channel, ChannelClosed, _client_frame
from kvtier.wire import pack, unpack_map
from tests.conftest import random_blocks
from tests.security.conftest import (ADMIN, NS, OTHER_NS, TOKEN_A, TOKEN_B, FakeDaemon, bearer, read_response,
                                     token_file)
from tests.unit.server.conftest import SPEC, hashes

PATH = "/v1/channel"


def _open(daemon, headers: dict | None = None, host: str = "127.0.0.1") -> tuple[socket.socket, int, dict]:
    sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    status, reply, _ = Channel.handshake(sock, host, PATH, headers if headers is not None else bearer(TOKEN_A))
    return sock, status, reply


def _lookup(channel: Channel, namespace: bytes = NS, n: int = 4, **extra) -> dict:
    frame = {"op": "lookup", "namespace": namespace.hex(), "block_hashes": hashes(n), **extra}
    return unpack_map(channel.exchange(pack(frame), 1 << 20), "reply")


def _limited(tmp_path) -> dict:
    """Tenant ``a`` may use NS only (OTHER_NS: 403), ``b`` any namespace, ``ops`` is admin."""
    return {"token_file": token_file(tmp_path / "limited.json", {"tenants": {
        "ops": {"admin": True, "tokens": [ADMIN]}, "a": {"tokens": [TOKEN_A], "namespaces": [NS.hex()]},
        "b": {"tokens": [TOKEN_B]}}})}


@pytest.fixture
def daemon_with_blocks(secure_daemon, tmp_path):
    """A daemon (--max-batch-blocks 16; :func:`_limited` tenants) with tenant a's namespace NS
    holding the first 3 of hashes(4)."""
    daemon = secure_daemon(max_batch_blocks=16, **_limited(tmp_path))
    remote = RemoteTier(daemon.url, token=TOKEN_A, timeout_s=5.0)
    try:
        remote.register(NS, SPEC)
        assert remote.put(NS, hashes(3), list(random_blocks(SPEC, 3))) == [True] * 3
    finally:
        remote.close()
    return daemon


def test_lookups_on_the_channel_answer_what_the_http_route_answers(daemon_with_blocks):
    sock, status, _ = _open(daemon_with_blocks)
    channel = Channel(sock)
    try:
        assert status == 101
        for _ in range(3):  # one connection, many frames
            reply = _lookup(channel)
            assert reply["num_blocks"] == 3 and len(reply["media"]) == 3 and "error" not in reply
    finally:
        channel.close()


def test_bad_frames_get_typed_errors_and_the_channel_keeps_serving(daemon_with_blocks):
    sock, status, _ = _open(daemon_with_blocks)
    channel = Channel(sock)
    try:
        assert status == 101
        cases = [
            (b"\xc1", 400),                                                   # not msgpack
            (pack([1, 2]), 400),                                              # not a map
            (pack({"op": "put", "namespace": NS.hex(), "block_hashes": []}), 400),   # not an op here
            (pack({"op": "lookup", "namespace": "AB" * 32, "block_hashes": []}), 400),  # a bad spelling
            (pack({"op": "lookup", "namespace": NS.hex(), "block_hashes": [b"x" * 7]}), 400),  # a bad hash
            (pack({"op": "lookup", "namespace": NS.hex(), "block_hashes": hashes(17)}), 413),  # > max batch
            (pack({"op": "lookup", "namespace": OTHER_NS.hex(), "block_hashes": hashes(2)}), 403),  # not a's
        ]
        for frame, expected in cases:
            reply = unpack_map(channel.exchange(frame, 1 << 20), "reply")
            assert reply["status"] == expected and isinstance(reply["error"], str) and reply["error"], (frame, reply)
            assert _lookup(channel)["num_blocks"] == 3  # still serving
        sock.sendall(_client_frame(0x1, b"lookup please"))  # a text frame
        opcode, data = channel._read_frame(1 << 20, True)
        assert unpack_map(data, "reply")["status"] == 400
        assert _lookup(channel)["num_blocks"] == 3
    finally:
        channel.close()


def test_a_tenant_sees_only_its_own_blocks_on_the_channel(daemon_with_blocks):
    sock, status, _ = _open(daemon_with_blocks, bearer(TOKEN_B))
    channel = Channel(sock)
    try:
        assert status == 101
        reply = _lookup(channel)  # tenant b: NS is not registered for it (404, a typed error frame)
        assert reply["status"] == 404 and "register it first" in reply["error"] and "num_blocks" not in reply
        assert _lookup(channel)["status"] == 404  # still serving
    finally:
        channel.close()
    sock, status, _ = _open(daemon_with_blocks, bearer(ADMIN))
    channel = Channel(sock)
    try:
        assert status == 101 and _lookup(channel)["status"] == 404  # the admin's own tenant: not a's store
    finally:
        channel.close()


@pytest.mark.parametrize("case", ["no token", "wrong token", "foreign origin", "foreign host", "no protocol",
                                  "not an upgrade"])
def test_an_upgrade_is_authenticated_and_guarded_like_any_request(daemon_with_blocks, case):
    from tests.security.conftest import request_bytes

    headers = {"no token": {}, "wrong token": bearer("nope-0123456789abcdef01"),
               "foreign origin": {**bearer(TOKEN_A), "Origin": "http://evil.example"}}.get(case, bearer(TOKEN_A))
    expected = {"no token": 401, "wrong token": 401, "foreign origin": 403, "foreign host": 421,
                "no protocol": 400, "not an upgrade": 400}[case]
    if case in ("no protocol", "not an upgrade"):
        extra = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                 "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode()} if case == "no protocol" else {}
        sock = socket.create_connection(("127.0.0.1", daemon_with_blocks.port), timeout=10)
        with sock:
            sock.sendall(request_bytes("GET", PATH, headers={**bearer(TOKEN_A), **extra}))
            status, _, body = read_response(sock)
        assert status == expected, body
        return
    sock, status, reply = _open(daemon_with_blocks, headers, host="evil.example" if case == "foreign host" else "127.0.0.1")
    with sock:
        assert status == expected, reply


def test_a_frame_over_the_cap_closes_the_channel_with_1009(daemon_with_blocks):
    sock, status, _ = _open(daemon_with_blocks)
    channel = Channel(sock)
    try:
        assert status == 101
        cap = 64 * daemon_with_blocks.settings.max_batch_blocks + (64 << 10)
        with pytest.raises(ChannelClosed) as closed:
            channel.exchange(b"\x80" + b"\0" * cap, 1 << 20)
        assert closed.value.code == 1009
    finally:
        channel.close()


@pytest.mark.slow  # waits out the daemon's idle timeout: full suite only
def test_a_frame_that_trickles_is_cut_after_the_idle_timeout(daemon_with_blocks):
    """Half a frame, then nothing: the connection counts as idle between frames and is closed
    after idle_timeout_s (1 s here), whatever was sent of the frame."""
    sock, status, _ = _open(daemon_with_blocks)
    with sock:
        assert status == 101
        frame = _client_frame(0x2, pack({"op": "lookup", "namespace": NS.hex(), "block_hashes": hashes(4)}))
        start = time.monotonic()
        sock.sendall(frame[: len(frame) // 2])
        sock.settimeout(10)
        try:
            data = sock.recv(1024)
        except ConnectionResetError:
            data = b""
        assert data == b"" and 0.9 < time.monotonic() - start < 5.0


@pytest.mark.slow  # waits out the daemon's idle timeout: full suite only
def test_an_idle_channel_is_closed_and_the_client_reconnects(daemon_with_blocks):
    remote = RemoteTier(daemon_with_blocks.url, token=TOKEN_A, timeout_s=5.0)
    try:
        remote.register(NS, SPEC)
        assert remote.lookup(NS, hashes(4)) == 3 and len(remote._channels) == 1
        time.sleep(1.8)  # the daemon closes it (idle_timeout_s = 1 s)
        assert remote.lookup(NS, hashes(4)) == 3 and not remote.errors, dict(remote.errors)
        assert daemon_with_blocks.app[__import__("kvtier.server.connections", fromlist=["SUPERVISOR"]).SUPERVISOR
                                      ].closed["idle"] >= 1
    finally:
        remote.close()


def test_the_client_uses_the_channel_with_signed_sessions_and_bearer_over_unix(secure_daemon, tmp_path):
    daemon = secure_daemon(unix_socket=tmp_path / "run" / "kvtier.sock", **_limited(tmp_path))
    hs = hashes(4)
    for url in (daemon.url, daemon.unix_url):
        remote = RemoteTier(url, token=TOKEN_A, timeout_s=5.0)
        try:
            remote.register(NS, SPEC)
            assert remote._channel_path == PATH
            assert remote.put(NS, hs[:2], list(random_blocks(SPEC, 2))) == [True, True]
            assert [remote.lookup(NS, hs) for _ in range(3)] == [2, 2, 2]
            assert len(remote._channels) == 1 and not remote.errors, dict(remote.errors)
            assert remote.lookup(OTHER_NS, hs) == 0 and remote.errors["unauthorized"] == 1  # not a's: 403
        finally:
            remote.close()


def test_the_client_registers_again_after_a_404_on_the_channel(secure_daemon):
    daemon = secure_daemon()
    remote = RemoteTier(daemon.url, token=ADMIN, timeout_s=5.0)
    try:
        remote.register(NS, SPEC)
        assert remote.put(NS, hashes(2), list(random_blocks(SPEC, 2))) == [True, True]
        remote.delete(NS)  # forgotten on the daemon: the client registers it again on its next call
        remote._registered.add(NS)  # ... as a client that did not see the delete would
        assert remote.lookup(NS, hashes(2)) == 0 and not remote.errors, dict(remote.errors)
        assert NS in remote._registered
    finally:
        remote.close()


# -- the client against daemons that do not play along ------------------------------------------
REGISTERED = pack({"namespace": NS.hex(), "block_shape": list(SPEC.block_shape), "dtype": "bfloat16",
                   "max_batch_blocks": 16, "created": True, "channel": PATH})


def _http(sock: socket.socket, body: bytes, status: int = 200) -> None:
    sock.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/msgpack\r\nContent-Length: %d\r\n\r\n%s"
                 % (status, len(body), body))


def _accept(head: bytes) -> bytes:
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    return base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())


def _switch(sock: socket.socket, head: bytes) -> None:
    sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: %s\r\nSec-WebSocket-Protocol: kvtier.v1\r\n\r\n" % _accept(head))


class Upgrades(FakeDaemon):
    """Registers properly; answers ``GET /v1/channel`` with ``upgrade(sock, head)``, an HTTP
    lookup with 2 blocks."""

    def __init__(self, upgrade) -> None:
        self.upgrade, self.upgrades = upgrade, 0
        super().__init__(self._handle)

    def _handle(self, sock: socket.socket, head: bytes) -> None:
        if head.startswith(b"PUT "):
            _http(sock, REGISTERED, 201)
        elif head.startswith(b"GET " + PATH.encode()):
            self.upgrades += 1
            self.upgrade(sock, head)
        else:
            _http(sock, pack({"num_blocks": 2, "media": ["cpu", "cpu"]}))


def _remote(fake: FakeDaemon, timeout_s: float = 0.5) -> RemoteTier:
    remote = RemoteTier(fake.url, timeout_s=timeout_s, retries=1)
    remote.register(NS, SPEC)
    assert remote._channel_path == PATH
    return remote


def test_a_refused_upgrade_falls_back_to_http_and_is_not_asked_again_at_once():
    fake = Upgrades(lambda sock, head: _http(sock, b'{"error": "no"}', 404))
    try:
        remote = _remote(fake)
        try:
            assert [remote.lookup(NS, hashes(4)) for _ in range(3)] == [2, 2, 2]
            assert fake.upgrades == 1 and not remote.errors, dict(remote.errors)
        finally:
            remote.close()
    finally:
        fake.close()


def _silent(sock: socket.socket, head: bytes) -> None:
    _switch(sock, head)
    time.sleep(1.5)


def _huge(sock: socket.socket, head: bytes) -> None:
    _switch(sock, head)
    sock.recv(65536)
    sock.sendall(b"\x82\x7f" + (1 << 40).to_bytes(8, "big") + b"\0" * 64)


def _masked(sock: socket.socket, head: bytes) -> None:
    _switch(sock, head)
    sock.recv(65536)
    sock.sendall(b"\x82\x81abcd\x00")


def _bad_accept(sock: socket.socket, head: bytes) -> None:
    sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: AAAA\r\nSec-WebSocket-Protocol: kvtier.v1\r\n\r\n")


def _closes(sock: socket.socket, head: bytes) -> None:
    _switch(sock, head)
    sock.recv(65536)
    sock.sendall(b"\x88\x02\x03\xf1")  # close 1009
    sock.close()
    raise OSError("closed")


@pytest.mark.parametrize("name,upgrade,reason", [
    ("silent", _silent, "timeout"), ("huge frame", _huge, "protocol"), ("masked frame", _masked, "protocol"),
    ("bad accept", _bad_accept, "protocol"), ("closed 1009", _closes, "rejected"),
])
def test_a_hostile_channel_is_a_miss_within_the_deadline(name, upgrade, reason):
    fake = Upgrades(upgrade)
    try:
        remote = _remote(fake, timeout_s=0.4)
        try:
            start = time.monotonic()
            assert remote.lookup(NS, hashes(4)) == 0
            assert time.monotonic() - start < 1.2
            assert remote.errors[reason] == 1, dict(remote.errors)
        finally:
            remote.close()
    finally:
        fake.close()


def test_an_unproven_upgrade_is_refused_over_signed_sessions(secure_daemon):
    """An upgrade whose reply does not carry the proof this client expects (here: the client's
    session key is not the daemon's, so its signature is refused with an unproven 401) opens
    no channel, and the lookup is a miss counted as ``unproven``, as on HTTP."""
    daemon = secure_daemon()
    remote = RemoteTier(daemon.url, token=TOKEN_A, timeout_s=2.0)
    try:
        remote.register(NS, SPEC)
        assert remote.lookup(NS, hashes(2)) == 0 and not remote.errors
        remote._drop_channels()
        good = remote._session.key
        remote._session.key = b"\1" * 32  # the 101 is proven with the real key: not what we expect
        assert remote.lookup(NS, hashes(2)) == 0 and remote.errors["unproven"] == 1
        assert not remote._channels
        remote._session.key = good
    finally:
        remote.close()


@pytest.mark.slow  # waits out a daemon's shutdown: full suite only
def test_a_daemon_with_open_channels_stops_at_once(secure_daemon):
    """Open channels waiting for their next frame do not hold the shutdown for
    shutdown_timeout_s: they are closed when the daemon stops."""
    daemon = secure_daemon(shutdown_timeout_s=10.0)
    sockets = []
    for _ in range(3):
        sock, status, _ = _open(daemon)
        assert status == 101
        sockets.append(sock)
    start = time.monotonic()
    daemon.stop()
    assert time.monotonic() - start < 3.0
    for sock in sockets:
        sock.settimeout(5)
        try:
            assert sock.recv(1024) == b""
        except ConnectionResetError:
            pass
        sock.close()


def test_a_client_that_goes_away_mid_reply_is_not_logged_as_an_error(daemon_with_blocks, caplog, monkeypatch):
    """A client that resets its channel while replies are still being written (its deadline
    passed, it crashed) ends the channel quietly, as a get whose client went away: no
    "Error handling request" traceback (aiohttp's 500 path) for every such client."""
    import logging
    import struct

    from kvtier.server import errors

    monkeypatch.setattr(errors.LOG, "allow", lambda kind: 0)  # nothing left out by the rate limit
    caplog.set_level(logging.DEBUG)
    frame = _client_frame(0x2, pack({"op": "lookup", "namespace": NS.hex(), "block_hashes": hashes(16)}))
    for _ in range(5):
        sock, status, _ = _open(daemon_with_blocks)
        assert status == 101
        sock.sendall(frame * 300)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, the replies unread
    time.sleep(0.5)
    channel = Channel(_open(daemon_with_blocks)[0])
    try:
        assert _lookup(channel)["num_blocks"] == 3  # still serving
    finally:
        channel.close()
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not loud, [r.getMessage() for r in loud]
