"""Attack kind 5 (issue 12): local trust. The data directory and LMDB files were
world-readable, another local user could hold the daemon's lock file, any Host header was
accepted (a browser page could reach the loopback daemon by DNS rebinding; a cross-origin
text/plain POST stored a block), and whoever bound the port while the daemon was down received
the bearer token. Now: owner-only files (kvtier.server.layout), a Unix socket as the local
transport, Host/Origin/Content-Type checks (kvtier.server.guard), and a token that never
travels over http (kvtier.auth)."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import msgpack
import pytest
import torch

from kvtier import auth
from kvtier.records import ReadStatus
from kvtier.server.app import REGISTRY
from kvtier.server.serve import prepare_socket_path
from kvtier.tiers.remote import RemoteTier
from kvtier.wire import pack
from tests.conftest import random_blocks
from tests.security.conftest import NS, TOKEN_A, TOKEN_B, FakeDaemon, bearer, call, register
from tests.unit.server.conftest import SPEC, ThreadDaemon, frames, hashes, ns_url, serve_settings


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def test_data_directory_and_every_file_in_it_are_owner_only(secure_daemon, tmp_path):
    daemon = secure_daemon()
    assert register(daemon.port, TOKEN_A) == 201
    call(daemon.port, "POST", ns_url(NS, "put"), frames(NS, hashes(3), random_blocks(SPEC, 3)), bearer(TOKEN_A))
    modes = _modes(tmp_path / "data")
    assert any(name.endswith("data.mdb") for name in modes) and any(name.endswith(".msgpack") for name in modes)
    for name, mode in modes.items():
        is_dir = (tmp_path / "data" / name).is_dir()
        assert mode == (0o700 if is_dir else 0o600), (name, oct(mode))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_local_user_can_neither_hold_the_lock_nor_read_a_block(secure_daemon, tmp_path):
    """As uid 65534, with every directory above the data directory open to all (as /var/lib
    or a home directory may be): the daemon's own modes must keep that user out."""
    shared = Path(tempfile.mkdtemp(prefix="kvtier-shared-", dir="/tmp"))
    try:
        os.chmod(shared, 0o755)
        daemon = secure_daemon(store_data_dir=shared / "data")
        assert register(daemon.port, TOKEN_A) == 201
        data_dir = daemon.call(lambda: daemon.app[REGISTRY].data_dir)
        daemon.stop()  # the lock is free: could another user take it, and so keep the daemon from starting?
        targets = [data_dir / "serve.lock", *data_dir.rglob("data.mdb"), *data_dir.rglob("spec.msgpack")]
        assert len(targets) >= 3
        pid = os.fork()
        if pid == 0:  # the child becomes "nobody"
            code = 0
            try:
                os.setgid(65534)
                os.setuid(65534)
                for path in targets:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        code = 1
                    except PermissionError:
                        pass
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "another user opened the lock file or a block file"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_lock_file_replaced_by_a_symlink_is_refused(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "serve.lock").symlink_to(tmp_path / "elsewhere.lock")
    with pytest.raises(RuntimeError, match="symlink"):
        ThreadDaemon(serve_settings(data_dir)).start()
    assert not (tmp_path / "elsewhere.lock").exists()


@pytest.mark.parametrize("host,ok", [("127.0.0.1", True), ("localhost:8765", True), ("[::1]:1", True),
                                     ("kv.internal", True), ("evil.example", False), ("127.0.0.1.evil.example", False),
                                     ("localhost.", True), ("", False), ("evil.example:8765", False)])
def test_a_host_header_that_does_not_name_the_daemon_is_refused(secure_daemon, host, ok):
    """DNS rebinding: a page of evil.example re-points its name at 127.0.0.1; its requests
    still say ``Host: evil.example``."""
    daemon = secure_daemon(allow_hosts=("kv.internal",))
    status, _, _ = call(daemon.port, "GET", "/v1/stats", b"", bearer(TOKEN_A), host=host)
    assert (status == 200) is ok and (ok or status in (400, 421)), status


def test_a_cross_origin_post_stores_no_block(secure_daemon):
    daemon = secure_daemon(token=None, token_file=None)  # the open loopback daemon a browser could reach
    assert call(daemon.port, "PUT", ns_url(NS), pack({"block_shape": list(SPEC.block_shape), "dtype": "float32"}))[0] == 201
    hs = hashes(2)
    body = frames(NS, hs, random_blocks(SPEC, 2))
    for headers in ({"Content-Type": "text/plain", "Origin": "http://evil.example"},  # a form or fetch, no preflight
                    {"Content-Type": "text/plain"},
                    {"Content-Type": "application/x-kvtier-frames", "Origin": "null"},
                    {"Content-Type": "application/x-kvtier-frames", "Sec-Fetch-Site": "cross-site"},
                    {"Content-Type": "application/x-www-form-urlencoded"}):
        status, _, _ = call(daemon.port, "POST", ns_url(NS, "put"), body, headers)
        assert status in (403, 415), (headers, status)
    reply = call(daemon.port, "POST", ns_url(NS, "lookup"), pack({"block_hashes": hs}))[2]
    assert msgpack.unpackb(reply)["num_blocks"] == 0
    status, _, _ = call(daemon.port, "GET", "/v1/stats", b"", {"Origin": f"http://127.0.0.1:{daemon.port}"},
                        host=f"127.0.0.1:{daemon.port}")
    assert status == 200  # the daemon's own page


def _impostor(sock: socket.socket, head: bytes) -> None:
    """Answers every call like a daemon would, without the token."""
    body = pack({"session": "00" * 16, "nonce": "11" * 16, "ttl_s": 60, "num_blocks": 2, "media": ["CPU", "CPU"],
                 "stored": [True, True], "max_batch_blocks": 16})
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nKVTier-Proof: %s\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (b"ab" * 32, len(body), body))


def test_whoever_listens_on_the_port_never_receives_the_token_and_is_not_believed():
    fake = FakeDaemon(_impostor)
    remote = RemoteTier(fake.url, token=TOKEN_A, timeout_s=2.0)
    try:
        hs = hashes(2)
        remote.register(NS, SPEC)
        assert remote.lookup(NS, hs) == 0  # its "2 blocks" are not believed
        remote.backoff.succeeded()
        assert remote.put(NS, hs, list(random_blocks(SPEC, 2))) == [False, False]
        assert remote.errors["unproven"] >= 1
        assert TOKEN_A.encode() not in bytes(fake.received)
        assert b"KVTier-Hello" in bytes(fake.received)
    finally:
        remote.close()
        fake.close()


def test_a_request_an_impostor_captured_cannot_be_replayed_to_the_daemon(secure_daemon):
    daemon = secure_daemon()
    real = RemoteTier(daemon.url, token=TOKEN_A)
    real.register(NS, SPEC)
    assert real.lookup(NS, hashes(2)) == 0 and not real.errors  # a session with the daemon
    fake = FakeDaemon(_impostor)
    mislead = RemoteTier(fake.url, token=TOKEN_A)
    mislead._session = real._session  # the same client, now connected to whoever took the port
    try:
        mislead.put(NS, hashes(2, salt=3), list(random_blocks(SPEC, 2, seed=3)))
        captured = bytes(fake.received)
        assert b"KVTier-Session" in captured and TOKEN_A.encode() not in captured
        head, _, body = captured.partition(b"\r\n\r\n")
        status, _, reply = _replay(daemon.port, head, body)
        assert status == 401, reply  # signed for another address: refused
        reply = call(daemon.port, "POST", ns_url(NS, "lookup"), pack({"block_hashes": hashes(2, salt=3)}),
                     bearer(TOKEN_A))[2]
        assert msgpack.unpackb(reply)["num_blocks"] == 0
    finally:
        real.close()
        mislead.close()
        fake.close()


def _replay(port: int, head: bytes, body: bytes):
    from tests.security.conftest import read_response

    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        return read_response(sock)


def test_a_signed_request_is_accepted_once(secure_daemon):
    daemon = secure_daemon()
    remote = RemoteTier(daemon.url, token=TOKEN_A)
    try:
        remote.register(NS, SPEC)
        session = remote._session
        value, _ = session.sign("GET", ns_url(NS), auth.endpoint(("127.0.0.1", daemon.port)))
        first = call(daemon.port, "GET", ns_url(NS), b"", {"Authorization": value})
        second = call(daemon.port, "GET", ns_url(NS), b"", {"Authorization": value})
        assert first[0] == 200 and auth.PROOF_HEADER.lower() in first[1]
        assert second[0] == 401
    finally:
        remote.close()


# -- the Unix socket ---------------------------------------------------------------------------------
def test_remote_tier_over_the_unix_socket_0600_in_a_0700_directory(tmp_path):
    sock_path = tmp_path / "run" / "kvtier.sock"
    daemon = ThreadDaemon(serve_settings(tmp_path / "data", port=None, unix_socket=sock_path, token=TOKEN_A)).start()
    try:
        assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600 and stat.S_ISSOCK(sock_path.stat().st_mode)
        assert stat.S_IMODE(sock_path.parent.stat().st_mode) == 0o700
        remote = RemoteTier(f"unix://{sock_path}", token=TOKEN_A)
        remote.register(NS, SPEC)
        hs, blocks = hashes(3), list(random_blocks(SPEC, 3, seed=4))
        assert remote.put(NS, hs, blocks) == [True] * 3
        outs = [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in hs]
        assert remote.get_into(NS, hs, outs) == [ReadStatus.OK] * 3
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks)) and not remote.errors
        remote.close()
    finally:
        daemon.stop()
    assert not sock_path.exists()


def test_a_socket_in_a_directory_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(RuntimeError, match="writable by no one else"):
        prepare_socket_path(shared / "kvtier.sock")
    (tmp_path / "mine").mkdir(mode=0o700)
    (tmp_path / "mine" / "kvtier.sock").write_text("a file")
    with pytest.raises(RuntimeError, match="not a socket"):
        prepare_socket_path(tmp_path / "mine" / "kvtier.sock")


def test_one_tokens_hellos_never_push_out_another_tokens_session(secure_daemon):
    from kvtier.server.auth import MAX_SESSIONS_PER_KEY

    daemon = secure_daemon()
    a, b = RemoteTier(daemon.url, token=TOKEN_A), RemoteTier(daemon.url, token=TOKEN_B)
    try:
        a.register(NS, SPEC)
        for _ in range(MAX_SESSIONS_PER_KEY + 5):  # b opens sessions in a loop
            b._session.sid = None
            b.lookup(NS, hashes(1))
        sid = a._session.sid
        assert a.lookup(NS, hashes(1)) == 0 and a._session.sid == sid and not a.errors  # a's session still good
    finally:
        a.close()
        b.close()
