"""``TieredStore.reset()`` (harden-lib) with the daemon as REMOTE: it calls
``RemoteTier.clear_namespace`` (harden-daemon), which empties the namespace on the daemon
for an admin token, and is refused for a tenant's (``remote_cleared`` False, nothing raised,
the daemon's blocks stay)."""

from __future__ import annotations

import torch

from kvtier.store import TieredStore
from kvtier.tiers.remote import RemoteTier
from tests.conftest import config_in_blocks, random_blocks
from tests.security.conftest import ADMIN, TOKEN_A, token_file
from tests.unit.server.conftest import NAMESPACE, SPEC, hashes


def _store(tmp_path, name: str, url: str, token: str) -> TieredStore:
    config = config_in_blocks(tmp_path / name, gpu=8, spec=SPEC, remote_url=url, remote_token=token)
    return TieredStore(SPEC, config, NAMESPACE, device="cpu", emulate_gpu=True)


def _fill(store: TieredStore, hs: list[bytes]) -> None:
    assert store.store(hs, torch.stack(list(random_blocks(SPEC, len(hs), seed=7)))) == len(hs)
    store.wait_for_writes()


def test_reset_empties_the_daemon_namespace_with_an_admin_token(thread_daemon, tmp_path):
    daemon = thread_daemon(token_file=token_file(tmp_path / "tokens.json"))
    hs = hashes(4)
    store = _store(tmp_path, "s", daemon.url, ADMIN)
    probe = RemoteTier(daemon.url, token=ADMIN)
    try:
        _fill(store, hs)
        assert probe.lookup(NAMESPACE, hs) == 4  # written through to the daemon
        result = store.reset()
        assert result.remote_cleared is True and result.dropped_blocks["REMOTE"] == 4
        assert result.dropped_blocks["GPU"] == 4
        assert probe.lookup(NAMESPACE, hs) == 0  # the daemon's namespace is empty, still registered
        assert store.lookup(hs).num_hit_blocks == 0
        _fill(store, hs[:2])  # and the store keeps working against it
        assert probe.lookup(NAMESPACE, hs) == 2
    finally:
        probe.close()
        store.close()


def test_reset_with_a_tenant_token_leaves_the_daemon_as_it_is_and_raises_nothing(thread_daemon, tmp_path):
    daemon = thread_daemon(token_file=token_file(tmp_path / "tokens.json"))
    hs = hashes(3, salt=1)
    store = _store(tmp_path, "s", daemon.url, TOKEN_A)
    probe = RemoteTier(daemon.url, token=TOKEN_A)
    try:
        _fill(store, hs)
        result = store.reset()
        assert result.remote_cleared is False and "REMOTE" not in result.dropped_blocks
        assert result.dropped_blocks["GPU"] == 3  # the local tiers are empty all the same
        assert probe.lookup(NAMESPACE, hs) == 3  # a tenant may not empty a namespace: the blocks stay
    finally:
        probe.close()
        store.close()
