"""Fixtures: an aiohttp app served from its own thread (for clients that block: the CLI,
a browser driven by playwright's sync API)."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Iterator

import pytest
from aiohttp import web


class LiveServer:
    """Serves ``make_app()`` on 127.0.0.1 (a free port) from a thread with its own loop."""

    def __init__(self, make_app: Callable[[], web.Application]) -> None:
        self._make_app = make_app
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-test-server", daemon=True)
        self.url = ""
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _start(self) -> None:
        self.app = self._make_app()
        self._runner = web.AppRunner(self.app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> "LiveServer":
        self._thread.start()
        assert self._started.wait(30), "server did not start"
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


@pytest.fixture
def live_server() -> Iterator[Callable[[Callable[[], web.Application]], LiveServer]]:
    servers: list[LiveServer] = []

    def start(make_app: Callable[[], web.Application]) -> LiveServer:
        server = LiveServer(make_app).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
