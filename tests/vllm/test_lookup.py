"""Scheduler -> worker lookups over the Unix socket (no vLLM)."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from kvtier.connectors.vllm.lookup import LookupClient, LookupServer, socket_path


@pytest.fixture
def paths():
    engine_id = f"test-{uuid.uuid4().hex[:12]}"
    return [socket_path(engine_id, 0, rank) for rank in range(2)]


@pytest.fixture
def servers():
    started: list[LookupServer] = []
    yield started
    for server in started:
        server.close()


def fixed(answer):
    calls = []

    def handler(op, req_id, hashes, wait_s, fingerprints=None):
        calls.append((op, req_id, hashes, wait_s))
        handler.fingerprints.append(fingerprints)
        return answer(hashes) if callable(answer) else answer

    handler.calls = calls
    handler.fingerprints = []
    return handler


def test_answer_is_the_shortest_rank(paths, servers) -> None:
    first, second = fixed((3, ["CPU", "CPU", "DISK"])), fixed((2, ["DISK", "DISK"]))
    servers += [LookupServer(paths[0], first), LookupServer(paths[1], second)]
    client = LookupClient(paths, timeout_s=5)
    assert client.match("r1", [[b"a" * 32, b"b" * 32], [b"c" * 32]], 0.25) == (2, ["DISK", "DISK"])
    assert first.calls == [("match", "r1", [b"a" * 32, b"b" * 32], 0.25)]
    assert second.calls == [("match", "r1", [b"c" * 32], 0.25)]
    client.drop("r1")
    assert first.calls[-1][:2] == ("drop", "r1")
    client.close()


def test_each_rank_gets_its_own_fingerprints(paths, servers) -> None:
    first, second = fixed((1, ["CPU"])), fixed((1, ["CPU"]))
    servers += [LookupServer(paths[0], first), LookupServer(paths[1], second)]
    client = LookupClient(paths, timeout_s=5)
    client.match("r", [[b"a" * 32], [b"c" * 32]], 0, [[b"f" * 32], [b"g" * 32]])
    client.match("r", [[b"a" * 32], [b"c" * 32]], 0)  # without: None on both
    assert first.fingerprints == [[b"f" * 32], None] and second.fingerprints == [[b"g" * 32], None]
    client.close()


def test_not_yet_on_any_rank_is_not_yet(paths, servers) -> None:
    servers += [LookupServer(paths[0], fixed((3, ["CPU"] * 3))), LookupServer(paths[1], fixed((None, [])))]
    assert LookupClient(paths, timeout_s=5).match("r", [[], []], 0) == (None, [])


def test_unreachable_worker_is_a_miss_then_reconnects(paths, servers) -> None:
    client = LookupClient(paths[:1], timeout_s=5)
    assert client.match("r", [[b"x"]], 0) == (0, [])
    servers.append(LookupServer(paths[0], fixed((1, ["CPU"]))))
    assert client.match("r", [[b"x"]], 0) == (1, ["CPU"])


def test_silent_worker_times_out_and_a_late_reply_is_never_read(paths, servers) -> None:
    release = threading.Event()

    def handler(op, req_id, hashes, wait_s, fingerprints=None):
        if req_id == "slow":
            release.wait(5)
            return 7, ["DISK"] * 7
        return 1, ["CPU"]

    servers.append(LookupServer(paths[0], handler))
    client = LookupClient(paths[:1], timeout_s=0.2)
    start = time.monotonic()
    assert client.match("slow", [[b"x"]], 0) == (0, [])
    assert time.monotonic() - start < 3
    release.set()
    assert client.match("fast", [[b"x"]], 0) == (1, ["CPU"])  # its own answer, not the late 7


def test_handler_error_is_a_miss_and_the_connection_stays(paths, servers) -> None:
    def handler(op, req_id, hashes, wait_s, fingerprints=None):
        if req_id == "bad":
            raise RuntimeError("boom")
        return 2, ["CPU", "CPU"]

    servers.append(LookupServer(paths[0], handler))
    client = LookupClient(paths[:1], timeout_s=5)
    assert client.match("bad", [[b"x"]], 0) == (0, [])
    assert client.match("good", [[b"x"]], 0) == (2, ["CPU", "CPU"])


def test_stale_sockets_are_swept_and_a_live_one_refused(paths, servers) -> None:
    for path in paths:
        with open(path, "w"):
            pass  # files left by killed engines
    servers.append(LookupServer(paths[0], fixed((0, []))))
    assert not os.path.exists(paths[1])  # another dead engine's socket went too
    with pytest.raises(RuntimeError, match="another kvtier lookup server"):
        LookupServer(paths[0], fixed((0, [])))
    assert LookupClient(paths[:1], timeout_s=5).match("r", [[]], 0) == (0, [])


def test_reset_reaches_every_rank(paths, servers) -> None:
    first, second = fixed((0, [])), fixed((0, []))
    servers += [LookupServer(paths[0], first), LookupServer(paths[1], second)]
    client = LookupClient(paths, timeout_s=5)
    assert client.reset() is True
    assert first.calls == [("reset", "", [], 0.0)] and second.calls == [("reset", "", [], 0.0)]
    client.close()
    servers.pop().close()
    assert LookupClient(paths, timeout_s=5).reset() is False  # a rank gone: not known to be reset
