"""Attack kind 2 (issue 12): one token for everything. Every holder could read, overwrite
(delete + re-register + put) and delete every namespace, and /metrics and /v1/stats published
the full namespace ids (all one needs to compute another tenant's block hashes). Now a token
belongs to a tenant (kvtier.server.tenants), stores are keyed by tenant and namespace, only an
admin token deletes or resets, and figures name stores by label."""

from __future__ import annotations

import json
import re

import msgpack

from kvtier.tiers.remote import RemoteTier
from kvtier.records import ReadStatus
from kvtier.wire import pack
from tests.conftest import random_blocks
from tests.security.conftest import (ADMIN, NS, OTHER_NS, TOKEN_A, TOKEN_B, bearer, call, register, token_file)
from tests.unit.server.conftest import SPEC, frames, hashes, ns_url, parse_frames

import torch


def _payloads(blocks) -> list[bytes]:
    return [b.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for b in blocks]


def test_two_tenants_with_the_same_namespace_never_read_or_overwrite_each_others_blocks(secure_daemon):
    daemon = secure_daemon()
    hs = hashes(4)
    mine, theirs = random_blocks(SPEC, 4, seed=1), random_blocks(SPEC, 4, seed=2)
    for token in (TOKEN_A, TOKEN_B):
        assert register(daemon.port, token) == 201  # the same namespace id, registered by both
    assert msgpack.unpackb(call(daemon.port, "POST", ns_url(NS, "put"), frames(NS, hs, mine), bearer(TOKEN_A))[2]) \
        == {"stored": [True] * 4}
    # b knows a's namespace and hashes, and tries to read them, then to put its own bytes under them
    reply = call(daemon.port, "POST", ns_url(NS, "lookup"), pack({"block_hashes": hs}), bearer(TOKEN_B))[2]
    assert msgpack.unpackb(reply)["num_blocks"] == 0
    assert parse_frames(call(daemon.port, "POST", ns_url(NS, "get"), pack({"block_hashes": hs}), bearer(TOKEN_B))[2]) == []
    call(daemon.port, "POST", ns_url(NS, "put"), frames(NS, hs, theirs), bearer(TOKEN_B))
    # a's blocks are a's; b's are b's
    got = parse_frames(call(daemon.port, "POST", ns_url(NS, "get"), pack({"block_hashes": hs}), bearer(TOKEN_A))[2])
    assert [p for _, _, p in got] == _payloads(mine)
    got = parse_frames(call(daemon.port, "POST", ns_url(NS, "get"), pack({"block_hashes": hs}), bearer(TOKEN_B))[2])
    assert [p for _, _, p in got] == _payloads(theirs)


def test_only_an_admin_token_deletes_or_resets_a_namespace(secure_daemon):
    daemon = secure_daemon()
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=3)
    assert register(daemon.port, TOKEN_A) == 201
    call(daemon.port, "POST", ns_url(NS, "put"), frames(NS, hs, blocks), bearer(TOKEN_A))
    for method, path in (("DELETE", ns_url(NS)), ("POST", ns_url(NS, "reset")), ("POST", "/v1/admin/reset"),
                         ("DELETE", f"/v1/admin/tenants/a/namespaces/{NS.hex()}"), ("GET", "/v1/admin/namespaces")):
        for token in (TOKEN_A, TOKEN_B):
            status, _, reply = call(daemon.port, method, path, b"", bearer(token))
            assert status == 403 and b"admin" in reply, (method, path, token, status)
    got = parse_frames(call(daemon.port, "POST", ns_url(NS, "get"), pack({"block_hashes": hs}), bearer(TOKEN_A))[2])
    assert [p for _, _, p in got] == _payloads(blocks)  # nothing was dropped
    status, _, reply = call(daemon.port, "GET", "/v1/admin/namespaces", b"", bearer(ADMIN))
    assert status == 200 and [(n["tenant"], n["namespace"]) for n in msgpack.unpackb(reply)["namespaces"]] \
        == [("a", NS.hex())]
    assert call(daemon.port, "DELETE", f"/v1/admin/tenants/a/namespaces/{NS.hex()}", b"", bearer(ADMIN))[0] == 200
    assert call(daemon.port, "POST", ns_url(NS, "lookup"), pack({"block_hashes": hs}), bearer(TOKEN_A))[0] == 404


def test_head_has_its_get_routes_access(secure_daemon):
    """HEAD of a tenant's GET route is the tenant's (it was refused as "needs an admin token");
    HEAD of an admin route stays admin; no token stays 401."""
    daemon = secure_daemon()
    assert call(daemon.port, "HEAD", "/v1/stats", b"", bearer(TOKEN_A))[0] == 200
    status, _, reply = call(daemon.port, "HEAD", "/v1/channel", b"", bearer(TOKEN_A))
    assert status not in (401, 403) and status < 500, status
    assert call(daemon.port, "HEAD", "/v1/admin/namespaces", b"", bearer(TOKEN_A))[0] == 403
    assert call(daemon.port, "HEAD", "/v1/admin/namespaces", b"", bearer(ADMIN))[0] == 200
    assert call(daemon.port, "HEAD", "/v1/stats", b"", {})[0] == 401


def test_a_tenant_limited_to_namespaces_cannot_use_another(secure_daemon, tmp_path):
    path = token_file(tmp_path / "limited.json", {"tenants": {
        "ops": {"admin": True, "tokens": [ADMIN]}, "a": {"tokens": [TOKEN_A], "namespaces": [OTHER_NS.hex()]}}})
    daemon = secure_daemon(token_file=path)
    assert register(daemon.port, TOKEN_A, NS) == 403
    assert register(daemon.port, TOKEN_A, OTHER_NS) == 201


def test_metrics_and_stats_never_publish_a_namespace_id_and_a_tenant_sees_only_its_own(secure_daemon):
    daemon = secure_daemon()
    for token, namespace in ((TOKEN_A, NS), (TOKEN_B, NS), (TOKEN_B, OTHER_NS)):
        assert register(daemon.port, token, namespace) == 201
        call(daemon.port, "POST", ns_url(namespace, "lookup"), pack({"block_hashes": hashes(2)}), bearer(token))
    seen = {}
    for who, token in (("a", TOKEN_A), ("b", TOKEN_B), ("ops", ADMIN)):
        metrics = call(daemon.port, "GET", "/metrics", b"", bearer(token))[2]
        stats = call(daemon.port, "GET", "/v1/stats", b"", bearer(token))[2]
        for body in (metrics, stats):
            for namespace in (NS, OTHER_NS):  # no 12 hex digits of an id, wherever they start
                text = namespace.hex().encode()
                assert not any(text[i : i + 12] in body for i in range(64 - 12)), (who, namespace.hex())
        labels = {x.decode() for x in re.findall(rb'namespace="([^"]+)"', metrics)}
        assert labels == set(json.loads(stats)["namespaces"]), who
        seen[who] = labels
    assert all(label.startswith("a/ns-") for label in seen["a"]) and len(seen["a"]) == 1
    assert "b/b-model" in seen["b"] and all(x.startswith("b/") for x in seen["b"]) and len(seen["b"]) == 2
    assert seen["ops"] == seen["a"] | seen["b"]


def test_remote_tier_of_one_tenant_misses_what_another_stored(secure_daemon):
    daemon = secure_daemon()
    a, b = RemoteTier(daemon.url, token=TOKEN_A), RemoteTier(daemon.url, token=TOKEN_B)
    try:
        a.register(NS, SPEC)
        b.register(NS, SPEC)
        hs, blocks = hashes(3), list(random_blocks(SPEC, 3, seed=8))
        assert a.put(NS, hs, blocks) == [True] * 3
        assert a.lookup(NS, hs) == 3 and b.lookup(NS, hs) == 0
        outs = [torch.empty(SPEC.block_shape, dtype=SPEC.dtype) for _ in hs]
        assert b.get_into(NS, hs, outs)[0] is ReadStatus.MISSING
        assert not a.errors and not b.errors
    finally:
        a.close()
        b.close()
