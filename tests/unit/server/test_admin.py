"""The daemon's admin calls (issue 12, item 6): list, empty (reset) and delete namespaces of
any tenant, live, through :class:`~kvtier.tiers.remote.RemoteTier`; admin token only."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from kvtier.records import ReadStatus
from kvtier.server.app import REGISTRY
from kvtier.tiers.remote import RemoteTier
from kvtier.wire import pack
from tests.conftest import random_blocks
from tests.security.conftest import ADMIN, NS, OTHER_NS, TOKEN_A, TOKEN_B, bearer, request_bytes
from tests.security.conftest import secure_daemon  # noqa: F401 (a fixture)
from tests.unit.server.conftest import SPEC, hashes, ns_url


@pytest.fixture
def clients(secure_daemon):
    daemon = secure_daemon(idle_timeout_s=30.0, grace_s=30.0)
    made = {name: RemoteTier(daemon.url, token=token) for name, token in
            (("admin", ADMIN), ("a", TOKEN_A), ("b", TOKEN_B))}
    for name in ("a", "b"):
        for ns in (NS, OTHER_NS):
            made[name].register(ns, SPEC)
    yield daemon, made
    for remote in made.values():
        remote.close()


def _fill(remote: RemoteTier, namespace: bytes, n: int = 4, seed: int = 0) -> list[bytes]:
    hs = hashes(n, salt=seed)
    assert remote.put(namespace, hs, list(random_blocks(SPEC, n, seed=seed))) == [True] * n
    return hs


def test_admin_empties_one_namespace_of_one_tenant_live_and_it_stays_registered(clients):
    daemon, c = clients
    a_ns, a_other, b_ns = _fill(c["a"], NS), _fill(c["a"], OTHER_NS, seed=1), _fill(c["b"], NS, seed=2)
    assert c["admin"].reset(NS, tenant="a") == 1
    assert c["a"].lookup(NS, a_ns) == 0  # emptied, every tier
    assert c["a"].lookup(OTHER_NS, a_other) == 4 and c["b"].lookup(NS, b_ns) == 4  # the others untouched
    assert _fill(c["a"], NS, seed=3) and not c["a"].errors  # still registered: stores again
    disk = daemon.call(lambda: daemon.app[REGISTRY].get("a", NS).store.usage()["DISK"]["blocks"])
    assert disk == 0  # DISK emptied too (a write-back store keeps new blocks in memory)


def test_admin_empties_everything_and_deletes(clients):
    daemon, c = clients
    _fill(c["a"], NS)
    _fill(c["b"], OTHER_NS, seed=1)
    listed = c["admin"].namespaces()
    assert sorted((n["tenant"], n["namespace"]) for n in listed) == sorted(
        (t, ns.hex()) for t in ("a", "b") for ns in (NS, OTHER_NS))
    assert all(n["label"].startswith(n["tenant"] + "/") for n in listed)
    assert c["admin"].reset() == 4
    assert c["a"].lookup(NS, hashes(4)) == 0 and c["b"].lookup(OTHER_NS, hashes(4, salt=1)) == 0
    c["admin"].delete(NS, tenant="b")
    assert sorted((n["tenant"], n["namespace"]) for n in c["admin"].namespaces()) == sorted(
        [("a", NS.hex()), ("a", OTHER_NS.hex()), ("b", OTHER_NS.hex())])
    with pytest.raises(LookupError):
        c["admin"].delete(NS, tenant="b")


def test_a_tenant_token_may_not_call_admin(clients):
    _, c = clients
    for fn in (lambda: c["a"].namespaces(), lambda: c["a"].reset(), lambda: c["a"].reset(NS),
               lambda: c["a"].delete(NS), lambda: c["a"].reset(NS, tenant="b")):
        with pytest.raises(PermissionError, match="403"):
            fn()
    assert c["b"].lookup(NS, hashes(1)) == 0 and not c["b"].errors


def test_reset_cuts_a_get_nobody_reads_and_frees_its_pins(clients):
    daemon, c = clients
    hs = _fill(c["a"], NS, n=32, seed=4)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", daemon.port))
    body = pack({"block_hashes": hs})
    sock.sendall(request_bytes("POST", ns_url(NS, "get"), body, {**bearer(TOKEN_A),
                                                                   "Content-Type": "application/msgpack"}) * 64)
    old = daemon.call(lambda: daemon.app[REGISTRY].get("a", NS))
    assert _within(5.0, lambda: daemon.call(lambda: old.pins.used) > 0)  # a get holds pins, unread
    start = time.monotonic()
    assert c["admin"].reset(NS, tenant="a") == 1
    assert time.monotonic() - start < 5.0
    assert daemon.call(lambda: old.pins.used) == 0  # the cut get gave its pins back
    # a get of the pipeline that began after the reset runs on the new, empty store until the
    # socket goes: then nothing may stay pinned there either
    sock.close()
    new = daemon.call(lambda: daemon.app[REGISTRY].get("a", NS))
    assert new is not old
    assert _within(5.0, lambda: daemon.call(lambda: (new.store.residency.pinned(), new.pins.used)) == ({}, 0))
    outs = [torch.empty(SPEC.block_shape, dtype=SPEC.dtype)]
    assert c["a"].get_into(NS, hs[:1], outs) == [ReadStatus.MISSING]


def _within(seconds: float, condition) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_clear_namespace_empties_the_callers_own_namespace_and_says_how_many_blocks(clients):
    """What ``TieredStore.reset`` calls on its REMOTE tier (the RemoteBackend's optional
    ``clear_namespace``): the blocks dropped; ``None``, never an exception, when refused."""
    _, c = clients
    c["admin"].register(NS, SPEC)
    hs = _fill(c["admin"], NS, n=5, seed=5)
    a_hs = _fill(c["a"], NS, seed=6)
    assert c["admin"].clear_namespace(NS) == 5
    assert c["admin"].lookup(NS, hs) == 0 and c["a"].lookup(NS, a_hs) == 4  # its own tenant's only
    assert c["admin"].clear_namespace(NS) == 0
    assert _fill(c["admin"], NS, n=2, seed=7) and not c["admin"].errors  # still registered
    assert c["a"].clear_namespace(NS) is None  # a tenant token: 403, no exception
    assert c["a"].lookup(NS, a_hs) == 4


def test_clear_namespace_of_a_daemon_that_is_down_is_none_at_once():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    remote = RemoteTier(f"http://127.0.0.1:{port}", token=ADMIN, timeout_s=0.5)
    start = time.monotonic()
    assert remote.clear_namespace(NS) is None
    assert time.monotonic() - start < 5.0
    remote.close()


def test_kvtier_cache_lists_empties_and_deletes_namespaces_with_an_admin_token_only(clients):
    from click.testing import CliRunner

    from kvtier.app.cli import main

    daemon, c = clients
    a_hs, b_hs = _fill(c["a"], NS), _fill(c["b"], NS, seed=1)
    run = lambda *args, token=ADMIN: CliRunner().invoke(main, ["admin", *args, "--url", daemon.url],  # noqa: E731
                                                        env={"KVTIER_TOKEN": token})
    out = run("ls")
    assert out.exit_code == 0, out.output
    rows = [line.split() for line in out.output.splitlines()[1:]]
    assert sorted((r[0], r[2]) for r in rows) == sorted((t, ns.hex()) for t in ("a", "b") for ns in (NS, OTHER_NS))
    assert any(r[0] == "a" and r[2] == NS.hex() and "CPU" in r and r[r.index("CPU") + 1] == "4" for r in rows)

    out = run("clear", "--namespace", NS.hex(), "--tenant", "a")
    assert out.exit_code == 0 and "emptied" in out.output, out.output
    assert c["a"].lookup(NS, a_hs) == 0 and c["b"].lookup(NS, b_hs) == 4  # only a's

    out = run("rm", "--namespace", NS.hex(), "--tenant", "b", "--yes")
    assert out.exit_code == 0, out.output
    assert ("b", NS.hex()) not in {(n["tenant"], n["namespace"]) for n in c["admin"].namespaces()}

    refused = run("clear", "--all", "--yes", token=TOKEN_A)
    assert refused.exit_code == 1 and "403" in refused.output and "admin token" in refused.output
    assert run("clear", "--namespace", NS.hex().upper()).exit_code == 2  # one spelling of a namespace
    assert run("clear").exit_code == 2 and run("rm", "--namespace", "00" * 32, "--tenant", "a", "--yes").exit_code == 1
    out = run("clear", "--all", "--yes")
    assert out.exit_code == 0 and "emptied 3 namespaces" in out.output, out.output
