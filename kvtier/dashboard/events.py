"""``GET /v1/events``: a store's KV events as server-sent events, with a resume cursor.

For cache-aware routers (kvtier.store.events has the schema: vLLM's BlockStored,
BlockRemoved, AllBlocksCleared). Each SSE message is one batch::

    id: 42
    event: kv
    data: {"seq": 42, "ts": 1767225600.1, "namespace": "SmolLM2-135M", "data_parallel_rank": null,
           "events": [{"type": "BlockStored", "block_hashes": ["9f0c..."], "medium": "GPU", ...}]}

Query: ``namespace`` (a name of the stores this app serves; optional when it serves one) and
``cursor`` (the last ``seq`` the client applied; the ``Last-Event-ID`` header works too).
Without a cursor, or with one the server's history no longer reaches (a long disconnect, a
restarted server), the stream starts with a snapshot batch: ``AllBlocksCleared``, then a
``BlockStored`` per tier of every block held, numbered so that the live batches continue
after it. A client that applies batches in order therefore always holds the store's view.
Comment lines (``: keep-alive``) every ``keepalive_s`` keep proxies from closing the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping

from aiohttp import web

from kvtier.store.events import EventBatch, batch_to_dict

if TYPE_CHECKING:
    from kvtier.store import TieredStore

logger = logging.getLogger(__name__)

HISTORY_BATCHES = 4096
"""Batches each streamed store keeps for resuming (a few seconds of a busy engine)."""
QUEUE_BATCHES = 8192
"""Batches one slow client may lag behind before its stream restarts with a snapshot."""
KEEPALIVE_S = 15.0

StoresFor = Callable[[web.Request], Mapping[str, "TieredStore"]]
"""``stores_for(request) -> {name: store}``: the stores this caller may see, by name."""

_STOP = object()
"""Put in a stream's queue when the app shuts down: the stream ends."""


def setup_events(app: web.Application, stores_for: StoresFor, path: str = "/v1/events",
                 keepalive_s: float = KEEPALIVE_S) -> None:
    """Add ``GET path``: the SSE stream of the module docstring. Open streams end when the
    app shuts down (``on_shutdown``), so a stopping server never waits for its clients."""
    streams: set[asyncio.Queue] = set()

    async def handler(request: web.Request) -> web.StreamResponse:
        name, store = pick_store(stores_for(request), request.query.get("namespace"))
        return await stream_events(request, name, store, keepalive_s, streams)

    async def end_streams(app: web.Application) -> None:
        for queue in list(streams):
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(_STOP)

    app.router.add_get(path, handler)
    app.on_shutdown.append(end_streams)


def pick_store(stores: Mapping[str, "TieredStore"], name: str | None) -> tuple[str, "TieredStore"]:
    """The store named ``name`` (the ``namespace`` parameter; the only one when ``None``).

    Raises:
        web.HTTPNotFound: no such name among the caller's stores.
        web.HTTPBadRequest: no name given while there are several (or none).
    """
    if name is None:
        if len(stores) != 1:
            raise web.HTTPBadRequest(text=json.dumps({"error": f"expected ?namespace=NAME ({len(stores)} stores)"}),
                                     content_type="application/json")
        name = next(iter(stores))
    store = stores.get(name)
    if store is None:
        raise web.HTTPNotFound(text=json.dumps({"error": f"unknown namespace {name[:80]!r}"}),
                               content_type="application/json")
    return name, store


def parse_cursor(request: web.Request) -> int | None:
    """``cursor`` (or ``Last-Event-ID``) as an int >= 0, or ``None``. Raises 400 otherwise."""
    raw = request.query.get("cursor", request.headers.get("Last-Event-ID"))
    if raw is None or raw == "":
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"expected cursor to be an integer >= 0, got {raw[:40]!r}"}),
                                 content_type="application/json")
    return int(raw)


async def stream_events(request: web.Request, name: str, store: "TieredStore",
                        keepalive_s: float = KEEPALIVE_S, streams: set | None = None) -> web.StreamResponse:
    """Stream ``store``'s events to the client until it goes away or the app shuts down
    (see the module doc); ``streams``: the app's open streams (their queues)."""
    cursor = parse_cursor(request)
    store.events.keep_history(HISTORY_BATCHES)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(QUEUE_BATCHES)
    if streams is not None:
        streams.add(queue)

    def on_batch(batch: EventBatch) -> None:  # on the store's threads
        loop.call_soon_threadsafe(_offer, queue, batch)

    unsubscribe = store.events.subscribe(on_batch)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    try:
        await response.prepare(request)
        last = await _catch_up(response, name, store, cursor)
        while True:
            try:
                batch = await asyncio.wait_for(queue.get(), keepalive_s)
            except asyncio.TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            if batch is _STOP:
                break
            if batch is None:  # this client fell too far behind: start over from a snapshot
                last = await _catch_up(response, name, store, None)
                continue
            if batch.seq > last:
                await _send(response, name, batch)
                last = batch.seq
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        unsubscribe()
        if streams is not None:
            streams.discard(queue)
    return response


def _offer(queue: asyncio.Queue, batch: EventBatch) -> None:
    try:
        queue.put_nowait(batch)
    except asyncio.QueueFull:
        while not queue.empty():
            if queue.get_nowait() is _STOP:  # shutting down: keep the stop
                queue.put_nowait(_STOP)
                return
        queue.put_nowait(None)


async def _catch_up(response: web.StreamResponse, name: str, store: "TieredStore", cursor: int | None) -> int:
    """Send what the client missed: the history after ``cursor`` when it reaches that far,
    else a snapshot. Returns the last ``seq`` sent."""
    if cursor is not None:
        batches, complete = store.events.since(cursor)
        if complete:
            for batch in batches:
                await _send(response, name, batch)
            return batches[-1].seq if batches else cursor
    snapshot = await asyncio.get_running_loop().run_in_executor(None, store.events_snapshot)
    await _send(response, name, snapshot)
    return snapshot.seq


async def _send(response: web.StreamResponse, name: str, batch: EventBatch) -> None:
    doc: dict[str, Any] = {**batch_to_dict(batch), "namespace": name}
    await response.write(f"id: {batch.seq}\nevent: kv\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n".encode())
