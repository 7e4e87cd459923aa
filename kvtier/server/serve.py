"""Running the daemon: ``kvtier serve`` (kvtier.app.cli) calls :func:`serve`."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from kvtier.server.app import REGISTRY, make_app
from kvtier.server.settings import ServeConfig

logger = logging.getLogger(__name__)


def serve(settings: ServeConfig, announce: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM, then close every namespace's store (flushing memory
    tiers to DISK when ``flush_on_close``).

    ``announce`` gets one line once the socket listens: ``kvtier serve: listening on
    http://HOST:PORT ...`` (with the real port when ``port`` is 0).

    Raises:
        ValueError: a non-loopback ``host`` without a token.
        RuntimeError: another daemon holds the data directory.
        OSError: the address is in use or cannot be bound.
    """
    settings.check_bind()
    asyncio.run(_serve(settings, announce))


async def _serve(settings: ServeConfig, announce: Callable[[str], None]) -> None:
    app = make_app(settings)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()  # opens the registry: the data directory lock, the namespaces on DISK
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        registry = app[REGISTRY]
        announce(f"kvtier serve: listening on {url} (data {registry.data_dir}, {len(registry.namespaces)} namespaces "
                 f"reopened, auth {'on' if settings.token else 'off'}, durable puts {'on' if settings.durable else 'off'})")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
