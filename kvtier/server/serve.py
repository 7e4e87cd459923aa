"""Running the daemon: ``kvtier serve`` (kvtier.app.cli) calls :func:`serve`; tests and
embedders use :func:`start` / :meth:`Running.stop` on their own event loop.

Listeners: a Unix socket (``unix_socket``: mode 0600; its directory is created 0700, and an
existing one must belong to this user and be writable by no one else), a TCP port, or both.
On SIGINT/SIGTERM the daemon stops accepting, gives calls in flight ``shutdown_timeout_s``,
closes every connection, then closes the stores (flushing memory tiers to DISK when
``flush_on_close``): a few seconds, not a minute.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from kvtier.server import loop as event_loop
from kvtier.server.app import make_app
from kvtier.server.connections import SUPERVISOR
from kvtier.server.errors import RateLimitedLogger
from kvtier.server.keys import REGISTRY
from kvtier.server.settings import ServeConfig

logger = logging.getLogger(__name__)


def serve(settings: ServeConfig, announce: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM (files created owner-only: umask 077).

    ``announce`` gets one line once the sockets listen: ``kvtier serve: listening on
    http://HOST:PORT [unix:///PATH] ...`` (with the real port when ``port`` is 0).

    Raises:
        ValueError: a non-loopback ``host`` without a token, a bad token file.
        RuntimeError: another daemon holds the data directory or the socket, a data
            directory or socket directory of another user or writable by others.
        OSError: the address is in use or cannot be bound.
    """
    settings.check_bind()
    os.umask(0o077)
    event_loop.run(_serve(settings, announce), settings.event_loop)


async def _serve(settings: ServeConfig, announce: Callable[[str], None]) -> None:
    running = await start(settings)
    try:
        registry = running.app[REGISTRY]
        tenants = registry.tenants
        auth = "off" if tenants.open else f"{len(tenants.tenants)} tenant(s)"
        loop_name = event_loop.running()
        logger.info("event loop: %s", loop_name)
        announce(f"kvtier serve: listening on {' '.join(running.urls)} (data {registry.data_dir}, "
                 f"{len(registry.namespaces)} namespaces reopened, auth {auth}, durable puts "
                 f"{'on' if settings.durable else 'off'}, event loop {loop_name})")
        await until_stopped()
    finally:
        await running.stop()


@dataclass
class Running:
    """A started daemon: its app, runner and listening URLs (``http://..``, ``unix://..``)."""

    app: web.Application
    runner: web.AppRunner
    urls: list[str]
    unix_socket: Path | None

    async def stop(self) -> None:
        supervisor = self.app[SUPERVISOR]
        try:
            await self.runner.cleanup()  # stop accepting, wait shutdown_timeout_s, close stores
        finally:
            supervisor.abort_all()
            await supervisor.stop()
            if self.unix_socket is not None:
                try:
                    os.unlink(self.unix_socket)
                except FileNotFoundError:
                    pass


async def until_stopped() -> None:
    """Return once the process gets SIGINT or SIGTERM (the servers then shut down in order)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def start(settings: ServeConfig) -> Running:
    """Open the stores and listen (see the module docstring); raises like :func:`serve`."""
    app = make_app(settings)
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=settings.shutdown_timeout_s,
        keepalive_timeout=settings.idle_timeout_s + 1, handler_cancellation=True, auto_decompress=False,
        lingering_time=0, logger=RateLimitedLogger(logging.getLogger("aiohttp.server"), {}),
    )
    await runner.setup()  # opens the registry: the data directory lock, the namespaces on DISK
    urls: list[str] = []
    sock_path = None
    try:
        app[SUPERVISOR].attach(runner.server)
        if settings.unix_socket is not None:
            sock_path = prepare_socket_path(settings.unix_socket)
            await web.UnixSite(runner, str(sock_path)).start()
            os.chmod(sock_path, 0o600)
            urls.append(f"unix://{sock_path}")
        if settings.port is not None:
            await web.TCPSite(runner, settings.host, settings.port).start()
            host, port = [a for a in runner.addresses if isinstance(a, tuple)][0][:2]
            urls.insert(0, f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    except BaseException:
        await runner.cleanup()
        await app[SUPERVISOR].stop()
        raise
    return Running(app, runner, urls, sock_path)


def prepare_socket_path(path: Path) -> Path:
    """``path``, ready to bind: its directory exists (created 0700), belongs to this user and
    no one else may write it; a stale socket left by a daemon that died is removed.

    Raises:
        RuntimeError: the directory belongs to another user or others may write it, the
            path is not a socket, or a daemon answers on it.
    """
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.parent.resolve().stat()
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"refusing to put the socket in {path.parent}: it must belong to this user and be "
                           f"writable by no one else (mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}); "
                           "e.g. a 0700 directory of your own")
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(f"{path} exists and is not a socket: refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody listens: a socket left by a daemon that died
            return path
    raise RuntimeError(f"another daemon listens on {path}")
