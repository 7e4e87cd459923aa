"""``POST /v1/explain``: where a prompt's blocks would hit, and why the rest would miss.

The caller hashes its prompt (it knows the key context: :func:`kvtier.hashing.block_hashes_for`,
:func:`kvtier.hashing.content_keys`) and sends, as msgpack (hashes as bytes) or JSON (hashes
as hex strings)::

    {"namespace": NAME, "block_hashes": [...], "num_tokens": 517, "content_keys": [...]}

(``namespace`` is optional when the app serves one store; ``num_tokens`` and
``content_keys`` are optional). The reply is :meth:`kvtier.store.misses.Explanation.to_dict`
as JSON: ``{"block_size", "tail_tokens", "hit_tokens", "blocks": [{"index", "tier", "reason",
"detail"}]}``. Nothing is counted, pinned or moved. The daemon serves the same reply at
``POST /v1/namespaces/{ns}/explain`` (kvtier.server.observe).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvtier.checks import BatchTooLarge, check_block_hashes
from kvtier.dashboard.events import StoresFor, pick_store
from kvtier.store.results import PromptInfo
from kvtier.wire import unpack_map

if TYPE_CHECKING:
    from kvtier.store import TieredStore

MAX_BLOCKS = 1 << 16
"""Blocks one explanation may ask about (a 1M-token prompt at 16 tokens per block)."""
MAX_BODY_BYTES = 8 << 20


def setup_explain(app: web.Application, stores_for: StoresFor, path: str = "/v1/explain") -> None:
    """Add ``POST path`` (see the module docstring) over the caller's stores."""

    async def handler(request: web.Request) -> web.Response:
        body = await read_body(request)
        name = body.get("namespace")
        if name is not None and not isinstance(name, str):
            raise _bad(f"expected namespace to be a string, got {type(name).__name__}")
        _, store = pick_store(stores_for(request), name)
        return await explain_response(store, body)

    app.router.add_post(path, handler)


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request body as a map (msgpack or JSON, by ``Content-Type``). Raises 400/413."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=request.content_length)
    raw = await request.content.read(MAX_BODY_BYTES + 1)
    if len(raw) > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=len(raw))
    if request.content_type == "application/json":
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise _bad(f"expected a JSON object, got undecodable bytes ({exc})") from None
        if not isinstance(body, dict):
            raise _bad(f"expected a JSON object, got {type(body).__name__}")
        return _hex_fields(body)
    try:
        return unpack_map(raw, "explain")
    except ValueError as exc:
        raise _bad(str(exc)) from None


def _hex_fields(body: dict[str, Any]) -> dict[str, Any]:
    """JSON bodies carry hashes and content keys as hex strings."""
    out = dict(body)
    for key in ("block_hashes", "content_keys"):
        values = body.get(key)
        if values is None:
            continue
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise _bad(f"expected {key} to be a list of hex strings")
        try:
            out[key] = [bytes.fromhex(v) for v in values]
        except ValueError:
            raise _bad(f"expected {key} to be a list of hex strings") from None
    return out


def parse_request(body: dict[str, Any]) -> tuple[list, PromptInfo]:
    """Block hashes and the prompt's info from a body. Raises 400/413."""
    try:
        hashes = check_block_hashes(body.get("block_hashes"), MAX_BLOCKS)
    except BatchTooLarge as exc:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BLOCKS, actual_size=len(body["block_hashes"]),
                                            text=json.dumps({"error": str(exc)})) from None
    except ValueError as exc:
        raise _bad(str(exc)) from None
    num_tokens = body.get("num_tokens")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                                   or not 0 <= num_tokens <= 64 * MAX_BLOCKS * 1024):
        raise _bad(f"expected num_tokens to be an integer >= 0, got {num_tokens!r}")
    keys = body.get("content_keys")
    if keys is not None and (not isinstance(keys, list) or len(keys) > len(hashes)
                             or not all(isinstance(k, bytes) and len(k) == 8 for k in keys)):
        raise _bad("expected content_keys to be at most one 8-byte key per block hash")
    return hashes, PromptInfo(num_tokens, keys)


async def explain_response(store: "TieredStore", body: dict[str, Any]) -> web.Response:
    """Explain the body's prompt against ``store`` (on a thread: it may ask REMOTE)."""
    hashes, prompt = parse_request(body)
    explanation = await asyncio.get_running_loop().run_in_executor(None, store.explain, hashes, prompt)
    return web.json_response(explanation.to_dict())


def _bad(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")
