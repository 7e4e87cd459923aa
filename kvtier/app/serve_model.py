"""``kvtier serve-model``: an OpenAI-compatible chat completions server on transformers'
continuous batching, with kvtier underneath (or without it: ``--no-kvtier``, the baseline).

    kvtier serve-model smollm2 --port 8000         # embedded store: CPU + DISK in --data-dir
    curl localhost:8000/v1/chat/completions -d '{"model":"smollm2","messages":[{"role":"user","content":"hi"}]}'

Routes: ``POST /v1/chat/completions`` (fields: :mod:`kvtier.app.openai_api`; ``stream`` sends
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /kvtier/stats`` (cached tokens by source over all requests, kvtier's store counters).
Every request is one request of transformers' ``ContinuousBatchingManager``: requests are
batched together, prefill and decode steps mixed. A client that disconnects has its request
cancelled at once (the handler is cancelled, which cancels the request in the manager). On
SIGINT / SIGTERM the server stops the manager and closes kvtier's store, which flushes its
memory tiers to DISK, so the next server process on the same data directory hits them.
With ``--remote-url`` the store also shares blocks through the ``kvtier serve`` daemon or Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from kvtier.app.cb_engine import ContinuousEngine
from kvtier.app.openai_api import ApiError, ChatRequest, Limits, chunk, completion, completion_id, parse_chat_request, usage
from kvtier.server.serve import until_stopped

logger = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", ContinuousEngine)
LIMITS = web.AppKey("limits", Limits)
STARTED = web.AppKey("started", float)


class Detokenizer:
    """Text of a growing list of tokens, released as it becomes final: a trailing incomplete
    UTF-8 character and anything that could still become a stop string are held back."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """New final text after ``token_ids``; sets :attr:`stopped` when a stop string appeared
        (the text is cut before it)."""
        self.tokens.extend(token_ids)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self.flush()
        self.text = text
        end = len(text) - self.holdback
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        return self._release(end)

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out


def make_app(engine: ContinuousEngine, limits: Limits, close_engine: bool = True) -> web.Application:
    """The server's routes over a started ``engine``; closing the app closes the engine
    (unless ``close_engine`` is False: the caller's)."""
    app = web.Application(client_max_size=4 << 20, middlewares=[_errors])
    app[ENGINE], app[LIMITS], app[STARTED] = engine, limits, time.time()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/kvtier/stats", stats)

    async def close(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, app[ENGINE].close)

    if close_engine:
        app.on_cleanup.append(close)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine, limits = request.app[ENGINE], request.app[LIMITS]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"expected a JSON body: {exc}") from None
    chat = parse_chat_request(body, limits)
    if not engine.healthy():
        raise ApiError(503, "the engine's generation loop is not running", kind="server_error")
    from kvtier.app.models import render_chat

    prompt = render_chat(engine.tokenizer, chat.messages)
    if len(prompt) + chat.max_tokens > limits.max_model_len:
        raise ApiError(400, f"prompt ({len(prompt)} tokens) + max_completion_tokens ({chat.max_tokens}) exceeds the "
                            f"model's context of {limits.max_model_len} tokens", "messages", "context_length_exceeded")
    if chat.stream:
        return await _stream(request, engine, chat, prompt, body["model"])
    return await _complete(engine, chat, prompt, body["model"])


async def _complete(engine: ContinuousEngine, chat: ChatRequest, prompt: list[int], model: str) -> web.Response:
    text = Detokenizer(engine.tokenizer, chat.stop)
    reason, request_id = "length", engine.new_request_id()
    async with contextlib.aclosing(engine.generate(prompt, chat.max_tokens, request_id=request_id,
                                                   temperature=chat.temperature, top_p=chat.top_p)) as steps:
        async for step in steps:
            if step.error is not None:
                raise ApiError(500, f"generation failed: {step.error}", kind="server_error")
            text.add(step.token_ids)
            if text.stopped:
                reason = "stop"
                break
            reason = step.finish_reason or reason
    used, kvtier = _cached(engine, request_id)
    body = completion(completion_id(), model, text.text, reason, usage(len(prompt), len(text.tokens), used), kvtier)
    return web.json_response(body)


async def _stream(request: web.Request, engine: ContinuousEngine, chat: ChatRequest, prompt: list[int],
                  model: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    cid, text = completion_id(), Detokenizer(engine.tokenizer, chat.stop)
    await _event(response, chunk(cid, model, {"role": "assistant", "content": ""}))
    reason, request_id = "length", engine.new_request_id()
    async with contextlib.aclosing(engine.generate(prompt, chat.max_tokens, request_id=request_id,
                                                   temperature=chat.temperature, top_p=chat.top_p)) as steps:
        async for step in steps:
            if step.error is not None:
                await _event(response, {"error": {"message": f"generation failed: {step.error}", "type": "server_error"}})
                return response
            delta = text.add(step.token_ids)
            if step.finish_reason is not None and not text.stopped:
                delta += text.flush()
            if delta:
                await _event(response, chunk(cid, model, {"content": delta}))
            if text.stopped:
                reason = "stop"
                break
            reason = step.finish_reason or reason
    used, kvtier = _cached(engine, request_id)
    tokens = usage(len(prompt), len(text.tokens), used)
    await _event(response, chunk(cid, model, {}, reason, kvtier=kvtier))
    if chat.include_usage:
        await _event(response, {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                                "model": model, "choices": [], "usage": tokens})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _event(response: web.StreamResponse, body: dict) -> None:
    await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


def _cached(engine: ContinuousEngine, request_id: str) -> tuple[int, dict[str, Any]]:
    """Cached prompt tokens of the request just served, and its ``kvtier`` response field."""
    admission = engine.admissions.pop(request_id)
    by_source = dict(admission.cached_by_source) if admission else {}
    return sum(by_source.values()), {"cached_tokens": by_source, "enabled": engine.connector is not None}


async def models(request: web.Request) -> web.Response:
    names = request.app[LIMITS].model_names
    created = int(request.app[STARTED])
    return web.json_response({"object": "list", "data": [{"id": n, "object": "model", "created": created,
                                                          "owned_by": "kvtier"} for n in names]})


async def health(request: web.Request) -> web.Response:
    healthy = request.app[ENGINE].healthy()
    return web.json_response({"status": "ok" if healthy else "engine stopped"}, status=200 if healthy else 503)


async def stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    totals = engine.admissions.stats
    body: dict[str, Any] = {"kvtier": engine.connector is not None, "requests": totals.requests,
                            "prompt_tokens": totals.prompt_tokens, "cached_tokens": dict(totals.cached_by_source),
                            "late_loads": totals.late_loads, "stored_blocks": totals.stored_blocks,
                            "errors": totals.errors}
    if engine.connector is not None:
        store = engine.connector.store
        body["store"] = {"usage": store.usage(), "hit_blocks": {str(k): v for k, v in store.stats.hit_blocks.items()},
                         "load_failures": dict(store.stats.load_failures)}
    return web.json_response(body)


@dataclass(frozen=True)
class ServeModelSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096


def serve_model(engine: ContinuousEngine, limits: Limits, settings: ServeModelSettings,
                announce: Callable[[str], None] = print) -> None:
    """Serve ``engine`` (started here) until SIGINT or SIGTERM, then close it (flush)."""
    asyncio.run(_serve(engine, limits, settings, announce))


async def _serve(engine: ContinuousEngine, limits: Limits, settings: ServeModelSettings,
                 announce: Callable[[str], None]) -> None:
    engine.start()
    app = make_app(engine, limits)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        mode = "with kvtier" if engine.connector is not None else "WITHOUT kvtier (transformers' own prefix sharing)"
        announce(f"kvtier serve-model: {limits.model_names[0]} on http://{host}:{port}/v1 ({mode}, "
                 f"{engine.options.sampling} decoding, page size {engine.options.page_size})")
        await until_stopped()
    finally:
        await runner.cleanup()


def run_from_cli(options: dict[str, Any], store_config: Any, announce: Callable[[str], None] = print) -> None:
    """``kvtier serve-model``: load the model, build the engine (kvtier on unless
    ``store_config`` is ``None``) and serve.

    Raises:
        ValueError: a page size that is not a multiple of the block size, a bad option.
        kvtier.app.models.ModelNotInstalledError: SmolLM2 is not installed.
    """
    import torch

    from kvtier.app.cb_engine import EngineOptions
    from kvtier.app.models import load_model

    if options.get("num_threads"):
        torch.set_num_threads(options["num_threads"])
    from kvtier.config import parse_bytes

    engine_options = EngineOptions(page_size=options["page_size"], num_blocks=options["num_blocks"],
                                   paged_cache_bytes=parse_bytes(options["paged_cache_bytes"]),
                                   max_batch_tokens=options["max_batch_tokens"], sampling=options["sampling"],
                                   seed=options["seed"], load_deadline_s=options["load_deadline_s"])
    if store_config is not None and engine_options.page_size % store_config.block_size:
        raise ValueError(f"expected --page-size ({engine_options.page_size}) to be a multiple of --block-size "
                         f"({store_config.block_size})")
    model, tokenizer, model_id = load_model(options["model"])
    max_model_len = int(getattr(model.config, "max_position_embeddings", 2048))
    engine = ContinuousEngine(model, tokenizer, model_id, engine_options, store_config,
                              max_new_tokens=options["default_max_tokens"])
    names = tuple(dict.fromkeys((options["model"], model_id, *options.get("served_names", ()))))
    limits = Limits(names, max_model_len, options["default_max_tokens"], options["max_tokens_limit"],
                    engine_options.sampling)
    settings = ServeModelSettings(options["host"], options["port"], options["default_max_tokens"],
                                  options["max_tokens_limit"])
    with torch.inference_mode():
        serve_model(engine, limits, settings, announce)
