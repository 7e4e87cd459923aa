"""RemoteTier against real daemons: round trips, a daemon that is down, slow or restarting
(misses, counted, bounded in time, then it works again), corruption on the wire and on the
daemon's DISK (never OK), lazy registration, auth."""

from __future__ import annotations

import socket
import time

import lmdb
import pytest
import torch

from kvtier.records import ReadStatus
from kvtier.server.app import REGISTRY
from kvtier.tiers.backend import RemoteBackend, make_remote
from kvtier.tiers.remote import RemoteTier
from kvtier.types import KVSpec
from tests.conftest import random_blocks
from tests.unit.server.conftest import NAMESPACE, SPEC, CorruptingProxy, hashes

OK, MISSING = ReadStatus.OK, ReadStatus.MISSING
HANG_BOUND_S = 10.0  # a call that takes longer than this is a hang, not a slow miss


@pytest.fixture
def remotes():
    made: list[RemoteTier] = []

    def factory(url: str, **kwargs) -> RemoteTier:
        kwargs.setdefault("timeout_s", 1.0)
        kwargs.setdefault("backoff_s", 0.01)
        kwargs.setdefault("max_backoff_s", 0.05)
        remote = RemoteTier(url, **kwargs)
        made.append(remote)
        return remote

    yield factory
    for remote in made:
        remote.close()


def empty_outs(n: int, spec: KVSpec = SPEC) -> list[torch.Tensor]:
    return list(torch.full((n, *spec.block_shape), float("nan"), dtype=spec.dtype))


def until(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_round_trip_is_bit_exact(thread_daemon, remotes):
    daemon = thread_daemon()
    remote = remotes(daemon.url)
    assert isinstance(remote, RemoteBackend)
    remote.register(NAMESPACE, SPEC)
    hs, blocks = hashes(7), random_blocks(SPEC, 7, seed=1)
    assert remote.put(NAMESPACE, hs[:5], list(blocks[:5])) == [True] * 5
    assert remote.lookup(NAMESPACE, hs) == 5
    assert remote.lookup(NAMESPACE, [hs[6]] + hs[:5]) == 0
    outs = empty_outs(7)
    assert remote.get_into(NAMESPACE, hs, outs) == [OK] * 5 + [MISSING] * 2
    assert torch.equal(torch.stack(outs[:5]), blocks[:5])
    assert not remote.errors


def test_batches_larger_than_the_daemon_limit_are_split(thread_daemon, remotes):
    daemon = thread_daemon(max_batch_blocks=3)
    remote = remotes(daemon.url)
    remote.register(NAMESPACE, SPEC)
    hs, blocks = hashes(10, size=16), random_blocks(SPEC, 10, seed=2)  # xxh3-128-sized hashes
    assert remote.put(NAMESPACE, hs, list(blocks)) == [True] * 10
    assert remote.lookup(NAMESPACE, hs) == 10
    outs = empty_outs(10)
    assert remote.get_into(NAMESPACE, hs, outs) == [OK] * 10
    assert torch.equal(torch.stack(outs), blocks)


def test_make_remote_maps_http_urls_to_remote_tier(thread_daemon):
    remote = make_remote(thread_daemon().url, token=None, timeout_s=0.5)
    try:
        assert isinstance(remote, RemoteTier) and remote.timeout_s == 0.5
    finally:
        remote.close()


def test_caller_bugs_raise_value_error(thread_daemon, remotes):
    remote = remotes(thread_daemon().url)
    remote.register(NAMESPACE, SPEC)
    with pytest.raises(ValueError, match="16 or 32 bytes"):
        remote.lookup(NAMESPACE, [b"short"])
    with pytest.raises(ValueError, match="shape"):
        remote.put(NAMESPACE, hashes(1), [torch.zeros(3)])
    with pytest.raises(ValueError, match="one out tensor"):
        remote.get_into(NAMESPACE, hashes(2), empty_outs(1))
    with pytest.raises(ValueError, match="contiguous"):
        remote.get_into(NAMESPACE, hashes(1), [torch.zeros(SPEC.block_shape[::-1]).permute(4, 3, 2, 1, 0)])
    with pytest.raises(ValueError, match="namespace of 32 bytes"):
        remote.lookup(b"ns", hashes(1))


def test_another_spec_for_a_known_namespace_raises(thread_daemon, remotes):
    daemon = thread_daemon()
    remotes(daemon.url).register(NAMESPACE, SPEC)
    other = KVSpec(num_layers=3, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="another block shape"):
        remotes(daemon.url).register(NAMESPACE, other)


def test_stopped_daemon_gives_misses_then_it_comes_back(thread_daemon, remotes):
    daemon = thread_daemon()
    remote = remotes(daemon.url, timeout_s=0.5)
    remote.register(NAMESPACE, SPEC)
    hs, blocks = hashes(4), random_blocks(SPEC, 4, seed=3)
    assert remote.put(NAMESPACE, hs, list(blocks)) == [True] * 4
    daemon.stop()  # flushes its blocks to DISK

    started = time.monotonic()
    assert remote.lookup(NAMESPACE, hs) == 0
    assert remote.get_into(NAMESPACE, hs, empty_outs(4)) == [ReadStatus.UNAVAILABLE] + [MISSING] * 3
    assert remote.put(NAMESPACE, hashes(2, salt=1), list(blocks[:2])) == [False, False]
    assert time.monotonic() - started < HANG_BOUND_S
    assert remote.errors["unavailable"] + remote.errors["skipped"] >= 3

    daemon.start()  # same port, same data dir: the blocks come back from DISK
    assert until(lambda: remote.lookup(NAMESPACE, hs) == 4)
    outs = empty_outs(4)
    assert remote.get_into(NAMESPACE, hs, outs) == [OK] * 4
    assert torch.equal(torch.stack(outs), blocks)


def test_register_while_down_is_retried_lazily(thread_daemon, remotes):
    daemon = thread_daemon()
    url = daemon.url
    daemon.stop()
    remote = remotes(url)
    remote.register(NAMESPACE, SPEC)  # no exception: counted, retried later
    assert remote.errors["unavailable"] >= 1
    daemon.start()
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=4)
    assert until(lambda: remote.put(NAMESPACE, hs, list(blocks)) == [True] * 3)
    assert remote.lookup(NAMESPACE, hs) == 3


def test_a_namespace_deleted_on_the_daemon_is_registered_again(thread_daemon, remotes):
    import urllib3

    daemon = thread_daemon()
    remote = remotes(daemon.url)
    remote.register(NAMESPACE, SPEC)
    hs, blocks = hashes(2), random_blocks(SPEC, 2, seed=5)
    remote.put(NAMESPACE, hs, list(blocks))
    assert urllib3.request("DELETE", f"{daemon.url}/v1/namespaces/{NAMESPACE.hex()}").status == 200
    assert remote.lookup(NAMESPACE, hs) == 0  # registered again, empty
    assert remote.put(NAMESPACE, hs, list(blocks)) == [True, True]
    assert remote.lookup(NAMESPACE, hs) == 2


def test_slow_daemon_times_out_within_the_bound(remotes):
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:  # accepts, never answers
        remote = remotes(f"http://127.0.0.1:{server.getsockname()[1]}", timeout_s=0.3)
        started = time.monotonic()
        remote.register(NAMESPACE, SPEC)
        statuses = remote.get_into(NAMESPACE, hashes(2), empty_outs(2))
        assert remote.lookup(NAMESPACE, hashes(2)) == 0
        assert time.monotonic() - started < HANG_BOUND_S
    assert statuses[0] in (ReadStatus.TIMEOUT, ReadStatus.UNAVAILABLE) and statuses[1] is MISSING
    assert remote.errors["timeout"] >= 1


def test_wrong_token_is_a_counted_miss(thread_daemon, remotes):
    daemon = thread_daemon(token="right")
    good, bad = remotes(daemon.url, token="right"), remotes(daemon.url, token="wrong")
    good.register(NAMESPACE, SPEC)
    hs, blocks = hashes(2), random_blocks(SPEC, 2, seed=6)
    assert good.put(NAMESPACE, hs, list(blocks)) == [True, True]
    assert bad.lookup(NAMESPACE, hs) == 0
    assert bad.put(NAMESPACE, hs, list(blocks)) == [False, False]
    assert bad.errors["unauthorized"] >= 2


def test_corrupted_on_the_wire_is_corrupt_never_ok(thread_daemon, remotes):
    daemon = thread_daemon()
    direct = remotes(daemon.url)
    direct.register(NAMESPACE, SPEC)
    hs, blocks = hashes(4), random_blocks(SPEC, 4, seed=7)
    assert direct.put(NAMESPACE, hs, list(blocks)) == [True] * 4
    pattern = blocks[1].view(torch.uint8).numpy().tobytes()[100:116]
    proxy = CorruptingProxy(daemon.port, pattern, to_client=True)
    try:
        via_proxy = remotes(proxy.url)
        via_proxy.register(NAMESPACE, SPEC)
        outs = empty_outs(4)
        assert via_proxy.get_into(NAMESPACE, hs, outs) == [OK, ReadStatus.CORRUPT, MISSING, MISSING]
        assert torch.equal(outs[0], blocks[0]) and proxy.flips >= 1
        assert via_proxy.errors["corrupt"] == 1
        # the connection was dropped, the next call works on a new one
        assert via_proxy.get_into(NAMESPACE, hs[:1], outs[:1]) == [OK]
    finally:
        proxy.close()
    outs = empty_outs(4)
    assert direct.get_into(NAMESPACE, hs, outs) == [OK] * 4  # the daemon's copy is intact
    assert torch.equal(torch.stack(outs), blocks)


def test_put_corrupted_on_the_wire_is_not_stored(thread_daemon, remotes):
    daemon = thread_daemon()
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=8)
    pattern = blocks[1].view(torch.uint8).numpy().tobytes()[200:216]
    proxy = CorruptingProxy(daemon.port, pattern, to_client=False, to_server=True)
    try:
        via_proxy = remotes(proxy.url)
        via_proxy.register(NAMESPACE, SPEC)
        assert via_proxy.put(NAMESPACE, hs, list(blocks)) == [True, False, True]
    finally:
        proxy.close()
    direct = remotes(daemon.url)
    assert direct.lookup(NAMESPACE, hs) == 1
    outs = empty_outs(1)
    assert direct.get_into(NAMESPACE, hs[2:], outs) == [OK] and torch.equal(outs[0], blocks[2])


def test_a_corrupt_record_on_the_daemons_disk_is_never_served(thread_daemon, remotes, tmp_path):
    daemon = thread_daemon()
    remote = remotes(daemon.url)
    remote.register(NAMESPACE, SPEC)
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=9)
    remote.put(NAMESPACE, hs, list(blocks))
    daemon.stop()  # flushed to DISK
    env = lmdb.open(str(tmp_path / "data" / NAMESPACE.hex() / "disk"), map_size=1 << 26)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(hs[1]))
        value[-5] ^= 0x04  # one payload bit
        txn.put(hs[1], bytes(value))
    env.close()

    daemon.start()
    outs = empty_outs(3)
    assert remote.get_into(NAMESPACE, hs, outs) == [OK, MISSING, MISSING]
    assert torch.equal(outs[0], blocks[0])
    store = daemon.call(lambda: daemon.app[REGISTRY].get(NAMESPACE).store)
    assert sum(store.stats.load_failures.values()) == 1
    assert remote.lookup(NAMESPACE, hs) == 1  # the corrupt record was dropped


def test_concurrent_calls_from_io_threads(thread_daemon, remotes):
    from concurrent.futures import ThreadPoolExecutor

    daemon = thread_daemon(cpu_blocks=256)
    remote = remotes(daemon.url, max_connections=2)  # fewer pooled connections than threads
    remote.register(NAMESPACE, SPEC)

    def worker(k: int) -> None:
        hs, blocks = hashes(6, salt=k), random_blocks(SPEC, 6, seed=k)
        for _ in range(4):
            assert remote.put(NAMESPACE, hs, list(blocks)) == [True] * 6
            outs = empty_outs(6)
            assert remote.get_into(NAMESPACE, hs, outs) == [OK] * 6
            assert torch.equal(torch.stack(outs), blocks)
            assert remote.lookup(NAMESPACE, hs) == 6

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(worker, range(8)))
    assert not remote.errors


def test_two_stores_share_blocks_through_the_daemon(thread_daemon, remotes, make_store, namespace, tmp_path):
    from tests.conftest import chain

    daemon = thread_daemon()
    spec = SPEC
    a = make_store(gpu_blocks=8, remote=remotes(daemon.url), data_dir=tmp_path / "a")
    b = make_store(gpu_blocks=8, remote=remotes(daemon.url), data_dir=tmp_path / "b")
    hs, blocks = chain(5, spec, namespace), random_blocks(spec, 5, seed=11)
    assert a.store(hs, blocks) == 5
    a.wait_for_writes()  # the background puts to REMOTE are done
    result = b.lookup(hs)
    assert result.num_hit_blocks == 5 and {str(m) for m in result.media} == {"REMOTE"}
    loaded = b.load(hs)
    assert torch.equal(b.top.tensor[loaded.block_ids], blocks)
    loaded.lease.release()


def test_a_spec_the_daemon_refuses_is_not_asked_again(thread_daemon, remotes):
    daemon = thread_daemon(max_block_bytes=SPEC.block_nbytes - 1)
    remote = remotes(daemon.url)
    remote.register(NAMESPACE, SPEC)  # 413: counted, not raised
    assert remote.errors["rejected"] == 1
    assert remote.lookup(NAMESPACE, hashes(2)) == 0
    assert remote.put(NAMESPACE, hashes(1), list(random_blocks(SPEC, 1))) == [False]
    assert remote.errors["rejected"] == 3
    assert not remote.errors["unavailable"]


def test_a_daemon_that_trickles_bytes_is_cut_off(remotes):
    import threading

    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def trickle() -> None:  # answers every request with a get stream one byte per 50 ms
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 16)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-kvtier-frames\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                try:
                    while not stop.is_set():
                        conn.sendall(b"1\r\n\x20\r\n")
                        time.sleep(0.05)
                except OSError:
                    pass

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        remote = remotes(f"http://127.0.0.1:{server.getsockname()[1]}", timeout_s=0.3)
        started = time.monotonic()
        statuses = remote.get_into(NAMESPACE, hashes(2), empty_outs(2))
        assert time.monotonic() - started < HANG_BOUND_S
    finally:
        stop.set()
        server.close()
    assert statuses == [ReadStatus.TIMEOUT, MISSING]  # after ~6 of the 33 bytes of the first frame
    assert remote.errors["timeout"] == 1
