"""Issue 15's explain and KV-event routes on the daemon of issue 12 (kvtier.server.observe):
a tenant explains and streams its own namespaces, never another tenant's (same namespace id
or not); the stream is not cut by the call deadline; the explain body's media types pass the
guard; a reset of a streamed namespace ends the stream."""

from __future__ import annotations

import json
import socket
import time

import msgpack

from kvtier.wire import pack
from tests.conftest import random_blocks
from tests.security.conftest import (ADMIN, NS, OTHER_NS, TOKEN_A, TOKEN_B, bearer, call, register, request_bytes)
from tests.unit.server.conftest import SPEC, frames, hashes, ns_url


def _label(port: int, token: str, namespace: bytes = NS) -> str:
    status, _, reply = call(port, "GET", ns_url(namespace), b"", bearer(token))
    assert status == 200, reply
    return msgpack.unpackb(reply)["label"]


def _put(port: int, token: str, hs: list[bytes], seed: int, namespace: bytes = NS) -> None:
    reply = call(port, "POST", ns_url(namespace, "put"), frames(namespace, hs, random_blocks(SPEC, len(hs), seed=seed)),
                 bearer(token))[2]
    assert msgpack.unpackb(reply) == {"stored": [True] * len(hs)}


def _explain(port: int, token: str, hs: list[bytes], namespace: bytes = NS) -> tuple[int, dict]:
    body = pack({"block_hashes": hs, "num_tokens": len(hs) * SPEC.block_size + 1})
    status, _, reply = call(port, "POST", ns_url(namespace, "explain"), body, bearer(token))
    return status, (json.loads(reply) if reply else {})


class Stream:
    """``GET /v1/events`` over a raw socket: the status, then one SSE message at a time."""

    def __init__(self, port: int, token: str, query: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(request_bytes("GET", f"/v1/events?{query}", b"", bearer(token)))
        self.file = self.sock.makefile("rb")
        self.status = int(self.file.readline().split()[1])
        while self.file.readline() not in (b"\r\n", b""):
            pass

    def next_batch(self) -> dict | None:
        """The next ``data:`` message, ``None`` when the daemon closed the stream (a reset
        cuts it as it cuts any call: a TCP reset)."""
        while True:
            try:
                line = self.file.readline()
            except ConnectionResetError:
                return None
            if not line:
                return None
            if line.startswith(b"data: "):
                return json.loads(line[6:])

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def _stored(batch: dict) -> set[str]:
    return {h for e in batch["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]}


def test_explain_acts_on_the_callers_own_namespace_only(secure_daemon):
    daemon = secure_daemon()
    hs = hashes(4)
    for token in (TOKEN_A, TOKEN_B):
        assert register(daemon.port, token) == 201  # the same namespace id, two tenants
    _put(daemon.port, TOKEN_A, hs[:3], seed=1)
    status, doc = _explain(daemon.port, TOKEN_A, hs)
    assert status == 200 and [b["reason"] for b in doc["blocks"]] == [None] * 3 + ["never_stored"]
    # b sends a's namespace id and a's hashes: its own store answers, which holds none of them
    status, doc = _explain(daemon.port, TOKEN_B, hs)
    assert status == 200 and [b["reason"] for b in doc["blocks"]] == ["never_stored"] * 4
    assert doc["hit_tokens"] == 0
    # a namespace b never registered is unknown to b, whoever registered it
    assert register(daemon.port, TOKEN_A, OTHER_NS) == 201
    assert _explain(daemon.port, TOKEN_B, hs, OTHER_NS)[0] == 404
    assert _explain(daemon.port, "not-a-token-0123456789abcdef", hs)[0] == 401


def test_explain_of_a_namespace_the_token_file_withholds_is_403(secure_daemon, tmp_path):
    from tests.security.conftest import token_file
    path = token_file(tmp_path / "limited.json", {"tenants": {
        "ops": {"admin": True, "tokens": [ADMIN]}, "a": {"tokens": [TOKEN_A], "namespaces": [OTHER_NS.hex()]}}})
    daemon = secure_daemon(token_file=path)
    status, doc = _explain(daemon.port, TOKEN_A, hashes(2), NS)
    assert status == 403 and "may not use" in doc["error"]


def test_the_explain_body_passes_the_guard_as_msgpack_or_json_and_nothing_else(secure_daemon):
    daemon = secure_daemon()
    hs = hashes(3)
    assert register(daemon.port, TOKEN_A) == 201
    _put(daemon.port, TOKEN_A, hs[:2], seed=2)
    json_body = json.dumps({"block_hashes": [h.hex() for h in hs]}).encode()
    status, _, reply = call(daemon.port, "POST", ns_url(NS, "explain"), json_body,
                            {**bearer(TOKEN_A), "Content-Type": "application/json"})
    assert status == 200, reply
    assert [b["reason"] for b in json.loads(reply)["blocks"]] == [None, None, "never_stored"]
    assert _explain(daemon.port, TOKEN_A, hs)[0] == 200  # msgpack
    for media in ("text/plain", "application/x-www-form-urlencoded"):  # what a page sends unasked
        status, _, reply = call(daemon.port, "POST", ns_url(NS, "explain"), json_body,
                                {**bearer(TOKEN_A), "Content-Type": media})
        assert status == 415 and b"application/json" in reply, (media, status)


def test_a_tenant_streams_events_of_its_own_namespaces_only(secure_daemon):
    daemon = secure_daemon()
    hs_a, hs_b = hashes(3, salt=1), hashes(2, salt=2)
    for token in (TOKEN_A, TOKEN_B):
        assert register(daemon.port, token) == 201
    _put(daemon.port, TOKEN_A, hs_a, seed=3)
    _put(daemon.port, TOKEN_B, hs_b, seed=4)
    label_a, label_b = _label(daemon.port, TOKEN_A), _label(daemon.port, TOKEN_B)
    assert label_a.startswith("a/") and label_b.startswith("b/") and NS.hex()[:12] not in label_a + label_b

    # b asks for a's label, and for the namespace id: neither is one of b's stores
    for query in (f"namespace={label_a}", f"namespace={NS.hex()}"):
        stream = Stream(daemon.port, TOKEN_B, query)
        assert stream.status == 404, query
        stream.close()
    for token, label, hs in ((TOKEN_A, label_a, hs_a), (TOKEN_B, label_b, hs_b)):
        stream = Stream(daemon.port, token, "")  # one namespace: its own, without naming it
        assert stream.status == 200
        snapshot = stream.next_batch()
        assert snapshot["namespace"] == label
        assert snapshot["events"][0]["type"] == "AllBlocksCleared" and _stored(snapshot) == {h.hex() for h in hs}
        stream.close()
    # an admin sees every tenant's namespace, by label
    stream = Stream(daemon.port, ADMIN, f"namespace={label_a}")
    assert stream.status == 200 and _stored(stream.next_batch()) == {h.hex() for h in hs_a}
    stream.close()


def test_the_event_stream_outlives_the_call_deadline_and_ends_with_a_reset(secure_daemon):
    daemon = secure_daemon(request_timeout_s=0.3, idle_timeout_s=0.3)
    assert register(daemon.port, TOKEN_A) == 201
    stream = Stream(daemon.port, TOKEN_A, "")
    try:
        assert stream.status == 200 and _stored(stream.next_batch()) == set()
        time.sleep(0.9)  # 3x request_timeout_s (and the idle timeout: the connection is busy)
        hs = hashes(2, salt=5)
        _put(daemon.port, TOKEN_A, hs, seed=5)
        stored: set[str] = set()
        while stored != {h.hex() for h in hs}:  # the live batches of that put, on the same stream
            batch = stream.next_batch()
            assert batch is not None, "the daemon cut the stream"
            stored |= _stored(batch)
        # a reset replaces the namespace's store: the stream ends (the client then reconnects
        # to a snapshot of the new store) rather than going silent on the old one
        status, _, reply = call(daemon.port, "POST", f"/v1/admin/tenants/a/namespaces/{NS.hex()}/reset", b"",
                                bearer(ADMIN))
        assert status == 200, reply
        while (batch := stream.next_batch()) is not None:
            assert _stored(batch) <= stored  # nothing new before the end
    finally:
        stream.close()
    stream = Stream(daemon.port, TOKEN_A, "")
    assert stream.status == 200 and _stored(stream.next_batch()) == set()
    stream.close()


def test_event_streams_hold_at_most_a_quarter_of_the_connections(secure_daemon):
    daemon = secure_daemon(max_connections=8)  # 2 streams
    for token in (TOKEN_A, TOKEN_B):
        assert register(daemon.port, token) == 201
    first, second = Stream(daemon.port, TOKEN_A, ""), Stream(daemon.port, TOKEN_B, "")
    try:
        assert first.status == 200 and second.status == 200
        third = Stream(daemon.port, TOKEN_A, "")  # no deadline on a stream: the cap stops a hoarder
        assert third.status == 503
        third.close()
        # every other call is still served, and the open streams still carry live batches
        hs = hashes(2, salt=6)
        _put(daemon.port, TOKEN_A, hs, seed=6)
        assert _stored(first.next_batch()) == set()  # its snapshot
        stored: set[str] = set()
        while stored != {h.hex() for h in hs}:
            batch = first.next_batch()
            assert batch is not None, "the daemon cut the stream"
            stored |= _stored(batch)
    finally:
        first.close()
        second.close()
