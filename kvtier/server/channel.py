"""The daemon's lookup channel: one WebSocket (RFC 6455, aiohttp's ``web.WebSocketResponse``)
per client connection, carrying msgpack lookup frames (issue 17: server CPU per lookup).

Why: a lookup of 32 blocks over HTTP cost ~235 us of daemon CPU against Redis's 70 us
(bench/results/2026-12-02-quiet), and a bare aiohttp app with a fixed reply already costs
123-147 us per request (bench/results/2026-12-02-daemon/aiohttp_floor.py): aiohttp's
per-request machinery (parser, request object, a task per request, the response's headers)
is most of it. On an open WebSocket a lookup is one frame each way, read by aiohttp's
C frame reader: no task, no headers, and authentication done once
(bench/results/2026-12-02-daemon-3).

Route: ``GET /v1/channel`` (``tenant`` access) with ``Upgrade: websocket`` and
``Sec-WebSocket-Protocol: kvtier.v1``. The upgrade request passes the daemon's one middleware
like any request: the guard (Host, Origin: a browser page of another origin cannot open
it), then authentication (Bearer or a signed session, kvtier.server.auth; the 101 reply
carries ``KVTier-Proof`` to a signed upgrade). The caller's tenant is fixed for the
connection's life. No compression (``permessage-deflate`` is declined: an inflated frame
would bypass the size cap).

Frames (binary, one msgpack map each way; one request at a time per connection)::

    {"op": "lookup", "namespace": "<64 hex digits>", "block_hashes": [bytes, ...]}
        -> {"num_blocks": int, "media": [str, ...]}     (what POST .../lookup answers)
        -> {"error": str, "status": int}                 (what POST .../lookup would have
                                                          answered: 400, 403, 404, 409, 413, 500)

The same checks as the HTTP route, per frame: the namespace's spelling and the tenant's
right to it (:func:`kvtier.server.app.allowed_namespace`), the hashes
(:func:`kvtier.server.app.checked_hashes`, ``--max-batch-blocks``), the store's own lookup
(it counts the lookup like the HTTP route). A bad frame (not msgpack, not a map, an unknown
op, a text frame) gets an error frame and the connection keeps serving. A frame larger than
the route's HTTP body cap (``64 x --max-batch-blocks + 64 KiB``) closes the connection with
code 1009 (message too big), before it is buffered whole.

Deadlines as for HTTP keep-alives (kvtier.server.connections): between frames the
connection counts as idle (closed after ``idle_timeout_s`` without a complete frame, a
frame that trickles included; the first to go when ``--max-connections`` is exceeded); a
frame being answered has ``request_timeout_s``. A client that goes away mid-reply ends its
channel quietly (no error logged). A channel waiting for its next frame does not
hold the daemon's shutdown (aiohttp closes it; tests/security/test_channel.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import WSMsgType, web

from kvtier.server.auth import CALLER
from kvtier.server.connections import SUPERVISOR, Supervisor, own_deadline
from kvtier.server.errors import LOG, error
from kvtier.server.keys import ACCESS, SETTINGS
from kvtier.server.tenants import Caller
from kvtier.wire import pack, unpack_map

logger = logging.getLogger(__name__)

PATH = "/v1/channel"
PROTOCOL = "kvtier.v1"
"""The subprotocol a client must ask for (``Sec-WebSocket-Protocol``)."""
OPS = ("lookup",)


def setup(app: web.Application, max_frame_nbytes: int, checks: tuple) -> None:
    """Add ``GET /v1/channel`` (``tenant``); frames over ``max_frame_nbytes`` close the
    connection. ``checks``: the HTTP route's own ``(allowed_namespace, checked_hashes,
    lookup_now, lookup_off_loop)`` (kvtier.server.app passes them: the channel applies exactly those)."""

    async def channel(request: web.Request) -> web.WebSocketResponse:
        return await serve(request, max_frame_nbytes, checks)

    app.router.add_get(PATH, channel)
    app[ACCESS][("GET", PATH)] = "tenant"


async def serve(request: web.Request, max_frame_nbytes: int, checks: tuple) -> web.WebSocketResponse:
    """Upgrade ``request`` (400 when it is not a WebSocket upgrade asking for
    :data:`PROTOCOL`) and answer its frames until the client closes or a deadline passes."""
    ws = web.WebSocketResponse(protocols=(PROTOCOL,), compress=False, max_msg_size=max_frame_nbytes,
                               autoping=True)
    ready = ws.can_prepare(request)
    if not ready.ok:
        raise error(web.HTTPBadRequest, f"expected a WebSocket upgrade (GET {PATH}, Upgrade: websocket)")
    if ready.protocol != PROTOCOL:
        raise error(web.HTTPBadRequest, f"expected Sec-WebSocket-Protocol: {PROTOCOL}")
    app = request.app
    caller: Caller = request[CALLER]
    own_deadline(request)  # the connection's life: bounded per frame below
    await ws.prepare(request)
    supervisor = app.get(SUPERVISOR)
    conn = supervisor.conns.get(request.protocol) if supervisor is not None else None
    request_timeout_s = app[SETTINGS].request_timeout_s
    task = asyncio.current_task()
    Supervisor.end(conn)  # idle until a frame is in
    try:
        while True:
            msg = await ws.receive()
            if msg.type is WSMsgType.BINARY:
                if conn is not None:
                    conn.task, conn.deadline = task, time.monotonic() + request_timeout_s
                await ws.send_bytes(await answer(app, caller, msg.data, checks))
                Supervisor.end(conn)
            elif msg.type is WSMsgType.TEXT:
                await ws.send_bytes(pack({"error": "expected binary msgpack frames", "status": 400}))
            else:  # CLOSE, CLOSING, CLOSED, ERROR (a frame over the cap: closed with 1009)
                if msg.type is WSMsgType.ERROR:
                    LOG.log(logger, logging.INFO, "channel error", "channel: %s", msg.data)
                break
    except ConnectionResetError:  # the client went away mid-reply (as a get's: kvtier.server.frames)
        logger.debug("channel: client went away")
    finally:
        Supervisor.end(conn)
    return ws


async def answer(app: web.Application, caller: Caller, data: bytes, checks) -> bytes:
    """The packed reply to one request frame (module docstring); never raises but for
    cancellation. ``checks``: kvtier.server.app's ``(allowed_namespace, checked_hashes,
    lookup_now, lookup_off_loop)``."""
    allowed_namespace, checked_hashes, lookup_now, lookup_off_loop = checks
    try:
        try:
            obj = unpack_map(data, "channel frame")
        except ValueError as exc:
            raise error(web.HTTPBadRequest, str(exc)) from None
        op = obj.get("op")
        if op not in OPS:
            raise error(web.HTTPBadRequest, f"expected an op in {list(OPS)}, got {str(op)[:40]!r}")
        namespace = allowed_namespace(caller, obj.get("namespace"))
        hashes = checked_hashes(obj, app[SETTINGS].max_batch_blocks)
        reply = lookup_now(app, caller, namespace, hashes)  # None: the store's lock is busy
        return pack(reply if reply is not None else await lookup_off_loop(app, caller, namespace, hashes))
    except web.HTTPException as exc:
        return pack({"error": _message(exc), "status": exc.status})
    except Exception as exc:  # as the HTTP routes' 500: logged, the daemon keeps serving
        LOG.log(logger, logging.ERROR, f"500 {type(exc).__name__}", "channel frame failed", exc_info=True)
        return pack({"error": f"internal error ({type(exc).__name__})", "status": 500})


def _message(exc: web.HTTPException) -> str:
    try:
        return str(json.loads(exc.text or "{}").get("error", exc.reason))
    except ValueError:
        return exc.reason
