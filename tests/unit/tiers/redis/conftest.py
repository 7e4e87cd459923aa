"""redis-server processes for the RedisTier tests: one per test (single node) and one local
3-node Redis Cluster per module, each on free loopback ports with its files in a temp dir.
Tests skip when redis-server / redis-cli are not on PATH (CI installs Debian's redis-server)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

redis = pytest.importorskip("redis")

_START_TIMEOUT_S = 10.0


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _pdeathsig_kill():
    """A ``preexec_fn``: SIGKILL the server when pytest dies (Linux ``PR_SET_PDEATHSIG``), so
    a killed test run leaves no redis-server behind. ``prctl`` is looked up in the parent."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, 9)


_die_with_parent = _pdeathsig_kill()


def _require_binaries() -> None:
    for name in ("redis-server", "redis-cli"):
        if shutil.which(name) is None:
            pytest.skip(f"{name} not on PATH (apt-get install redis-server)")


class RedisServer:
    """One redis-server on 127.0.0.1:``port``; no persistence; can be killed, paused and
    restarted on the same port."""

    def __init__(self, work_dir: Path, port: int | None = None, *extra: str) -> None:
        self.dir = work_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", str(self.dir / "redis.log"),
            "--maxmemory-policy", "allkeys-lru", *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:] if (self.dir / "redis.log").exists() else ""
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def client(self, **kwargs):
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def kill(self) -> None:
        """SIGKILL and wait: the port refuses connections afterwards."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        self.proc.send_signal(19)  # SIGSTOP: connects succeed (backlog), replies never come

    def resume(self) -> None:
        self.proc.send_signal(18)  # SIGCONT


@pytest.fixture
def redis_server(tmp_path):
    _require_binaries()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.resume()
    server.kill()


@pytest.fixture
def make_redis_server(tmp_path):
    """``make_redis_server(*extra_args)`` -> a started RedisServer (killed at teardown)."""
    _require_binaries()
    servers: list[RedisServer] = []

    def factory(*extra: str) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(servers)}", None, *extra).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.kill()


class RedisClusterNodes:
    def __init__(self, servers: list[RedisServer]) -> None:
        self.servers = servers

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def flush(self) -> None:
        for server in self.servers:
            with server.client() as c:
                c.flushall()

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for server in self.servers:
                with server.client() as c:
                    states.append(c.execute_command("CLUSTER INFO").get("cluster_state"))
            if states == ["ok"] * len(self.servers):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not reach cluster_state ok: {states}")
            time.sleep(0.1)

    def kill(self) -> None:
        for server in self.servers:
            server.kill()


def start_cluster(base: Path) -> RedisClusterNodes:
    """Three primaries (no replicas) on loopback, slots assigned, ``cluster_state:ok``."""
    servers = [
        RedisServer(base / f"node{i}", None, "--cluster-enabled", "yes", "--cluster-config-file",
                    str(base / f"node{i}" / "nodes.conf"), "--cluster-node-timeout", "2000")
        for i in range(3)
    ]
    nodes = RedisClusterNodes(servers)
    try:
        for server in servers:
            server.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )
        nodes.wait_ok()
    except BaseException:
        nodes.kill()
        raise
    return nodes


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A 3-primary Redis Cluster shared by a module's tests."""
    _require_binaries()
    nodes = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield nodes
    nodes.kill()


@pytest.fixture
def own_redis_cluster(tmp_path):
    """A 3-primary Redis Cluster for one test (which may kill its nodes)."""
    _require_binaries()
    nodes = start_cluster(tmp_path / "redis-cluster")
    yield nodes
    nodes.kill()
