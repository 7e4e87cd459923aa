"""Attack kind 1 (issue 12): a path parameter that reaches the filesystem. Once, 64 characters
of whitespace named the data directory itself, and a failed registration's cleanup deleted
every namespace. Every spelling of a namespace or tenant is parsed strictly
(kvtier.checks), and the daemon removes only a directory it made (kvtier.server.layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.server.app import REGISTRY
from kvtier.wire import pack, spec_to_wire
from tests.conftest import random_blocks
from tests.security.conftest import ADMIN, NS, TOKEN_A, bearer, call, register
from tests.unit.server.conftest import SPEC, frames, hashes, ns_url, parse_frames


def payload(block) -> bytes:
    return block.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

EDGES = [
    " " * 64, "%20" * 64, "00" * 31 + "%20%20", "%09" + "0" * 63, "0" * 63 + "%0A", "0" * 63 + "%00",
    NS.hex().upper(), NS.hex()[:-1], NS.hex() + "0", "+" + NS.hex()[1:], "%30" * 64,
    "٠" * 64, "０" * 64, "%D9%A0" * 64, ".." , "%2E%2E", "..%2F..%2Ftenants", "0" * 63 + "%2F",
]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("name", EDGES)
def test_no_spelling_of_a_namespace_touches_a_directory_or_a_block(secure_daemon, tmp_path, name):
    daemon = secure_daemon()
    assert register(daemon.port, TOKEN_A) == 201
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=5)
    assert call(daemon.port, "POST", ns_url(NS, "put"), frames(NS, hs, blocks), bearer(TOKEN_A))[0] == 200
    before = _tree(tmp_path / "data")

    url = f"/v1/namespaces/{name}"
    for token in (TOKEN_A, ADMIN):
        for method, path, body in (("PUT", url, pack(spec_to_wire(SPEC))), ("GET", url, b""), ("DELETE", url, b""),
                                   ("POST", url + "/reset", b""), ("POST", url + "/put", frames(NS, hs, blocks)),
                                   ("DELETE", f"/v1/admin/tenants/a/namespaces/{name}", b""),
                                   ("POST", f"/v1/admin/tenants/{name}/namespaces/{NS.hex()}/reset", b"")):
            status, _, reply = call(daemon.port, method, path, body, bearer(token))
            assert status in (400, 403, 404, 405), (method, path, status, reply)

    assert _tree(tmp_path / "data") == before
    status, _, body = call(daemon.port, "POST", ns_url(NS, "get"), pack({"block_hashes": hs}), bearer(TOKEN_A))
    assert [p for _, _, p in parse_frames(body)] == [payload(b) for b in blocks]


def test_a_failed_registration_never_deletes_a_directory_the_daemon_did_not_make(secure_daemon, tmp_path):
    """A directory at a namespace's path that the daemon did not create (no marker: copied
    there by hand, restored from a backup) is left alone: a registration whose store cannot
    open (its block is larger than the CPU pool) used to delete it on the way out; now it is
    a 409 before anything is opened, and so is any other registration over it."""
    daemon = secure_daemon()
    path = daemon.call(lambda: daemon.app[REGISTRY].data_dir) / "tenants" / "a" / NS.hex()
    path.mkdir(parents=True)
    (path / "precious.txt").write_text("not the daemon's")
    too_big = type(SPEC)(num_layers=64, num_kv_heads=4, head_dim=8, block_size=4, dtype=SPEC.dtype)  # > the pool
    assert too_big.block_nbytes > 64 * SPEC.block_nbytes
    for spec in (too_big, SPEC):
        status, _, reply = call(daemon.port, "PUT", ns_url(NS), pack(spec_to_wire(spec)), bearer(TOKEN_A))
        assert (path / "precious.txt").exists(), f"deleted by a registration that answered {status} {reply!r}"
        assert status == 409, reply


def test_delete_removes_only_the_directory_the_daemon_made_never_a_symlinked_one(secure_daemon, tmp_path):
    """A namespace directory swapped for a symlink to elsewhere (by anyone who could) is not
    followed by a delete: the target keeps its files."""
    daemon = secure_daemon()
    assert register(daemon.port, TOKEN_A) == 201
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    data_dir = daemon.call(lambda: daemon.app[REGISTRY].data_dir)
    path = data_dir / "tenants" / "a" / NS.hex()
    for f in list(path.iterdir()):
        (elsewhere / f.name).write_bytes(f.read_bytes()) if f.is_file() else None
    moved = path.rename(tmp_path / "moved")
    path.symlink_to(elsewhere, target_is_directory=True)

    status, _, _ = call(daemon.port, "DELETE", "/v1/admin/tenants/a/namespaces/" + NS.hex(), b"", bearer(ADMIN))
    assert status == 200  # the namespace is gone from the daemon ...
    assert (elsewhere / "keep.txt").read_text() == "keep" and moved.is_dir()  # ... and nothing it did not make
