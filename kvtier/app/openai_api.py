"""OpenAI chat completions: the request parsed strictly, the response and stream chunks shaped.

A request body is checked field by field (:func:`parse_chat_request`); anything wrong is an
:class:`ApiError` with the HTTP status and the OpenAI error body
(``{"error": {"message", "type", "param", "code"}}``). Fields: ``model``, ``messages``
(``system`` / ``user`` / ``assistant``; content a string or a list of text parts),
``max_completion_tokens`` (or the older ``max_tokens``), ``temperature``, ``top_p``,
``stream``, ``stream_options.include_usage``, ``stop`` (up to 4 strings), ``seed``, ``n`` (1
only); ``user``, ``presence_penalty`` / ``frequency_penalty`` (0 only), ``logprobs`` (false
only) are accepted and change nothing; any other field is refused (400), so a client never
believes a setting took effect when it did not.

Responses carry ``usage.prompt_tokens_details.cached_tokens`` (every cached prompt token) and
a ``kvtier`` object: cached tokens per source (``paged``: transformers' own cache; ``CPU``,
``DISK``, ``REMOTE``, ``GPU``: kvtier's tiers).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
ACCEPTED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stream",
            "stream_options", "stop", "seed", "n", "user", "presence_penalty", "frequency_penalty", "logprobs"}


class ApiError(Exception):
    """An error answered to the client: ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What the server allows: served names, token limits, its sampling mode."""

    model_names: tuple[str, ...]
    max_model_len: int
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    sampling: str = "greedy"


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"expected '{name}' to be a number, got {value!r}", name)
    if value > high or value < low or (low_open and value <= low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise _bad(f"expected '{name}' in {bound}, got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"expected '{name}' to be an integer, got {value!r}", name)
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _bad("expected 'messages' to be a non-empty list", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _bad(f"expected messages[{i}] to be an object", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise _bad(f"expected messages[{i}].role in {list(ROLES)}, got {role!r}", "messages")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"expected messages[{i}].content parts of type 'text' (this model reads text only)",
                               "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"expected messages[{i}].content to be a string or text parts", "messages")
        out.append({"role": role, "content": content})
    return out


def parse_chat_request(body: Any, limits: Limits) -> ChatRequest:
    """Check a chat completions body against ``limits``.

    Raises:
        ApiError: 400 for a malformed or unsupported field, 404 for a model not served.
    """
    if not isinstance(body, dict):
        raise _bad("expected a JSON object")
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise _bad(f"unsupported field(s) {unknown}; this server accepts {sorted(ACCEPTED)}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("expected 'model' to be a non-empty string", "model")
    if model not in limits.model_names:
        raise ApiError(404, f"model {model!r} is not served here; served: {list(limits.model_names)}", "model",
                       "model_not_found")
    messages = _messages(body.get("messages"))
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    max_tokens = limits.default_max_tokens if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= limits.max_tokens_limit:
        raise _bad(f"expected max_completion_tokens in [1, {limits.max_tokens_limit}], got {max_tokens}",
                   "max_completion_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"expected 'stream' to be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise _bad("expected 'stream_options' = {\"include_usage\": bool}, with stream true", "stream_options")
    request = ChatRequest(messages, max_tokens, stream, bool((options or {}).get("include_usage", False)))
    request.temperature = _number(body, "temperature", 0.0, 2.0)
    request.top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    request.seed = _integer(body, "seed")
    request.stop = _stop(body.get("stop"))
    _check_ignored(body)
    _check_sampling(request, limits.sampling)
    return request


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(s, str) and s for s in stops):
        raise _bad("expected 'stop' to be a non-empty string or a list of 1 to 4 of them", "stop")
    return stops


def _check_ignored(body: dict) -> None:
    n = _integer(body, "n")
    if n not in (None, 1):
        raise _bad(f"expected 'n' = 1 (one choice per request), got {n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2.0, 2.0) not in (None, 0.0):
            raise _bad(f"expected '{name}' = 0 (not supported)", name)
    if body.get("logprobs") not in (None, False):
        raise _bad("expected 'logprobs' false (not supported)", "logprobs")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("expected 'user' to be a string", "user")


def _check_sampling(request: ChatRequest, sampling: str) -> None:
    """Greedy servers decode every request by argmax: only temperature 0 (or none) fits.
    Sampling servers apply each request's temperature and top_p; their seed is the server's."""
    if sampling == "greedy":
        if request.temperature not in (None, 0.0) or request.top_p not in (None, 1.0):
            raise _bad("this server decodes greedily (kvtier serve-model --sampling greedy): expected temperature 0 "
                       "and top_p 1 (or neither); start it with --sampling sample for sampling", "temperature")
        request.temperature = request.top_p = None
        return
    if request.temperature == 0.0:
        raise _bad("this server samples (--sampling sample): expected temperature > 0", "temperature")
    if request.seed is not None:
        raise _bad("per-request seeds are not supported when sampling (the server's --seed seeds its sampler)", "seed")


def completion_id() -> str:
    return f"chatcmpl-{time.time_ns():x}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(cid: str, model: str, text: str, finish_reason: str, usage_: dict, kvtier: dict) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
            "usage": usage_, "kvtier": kvtier}


def chunk(cid: str, model: str, delta: dict, finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    body = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
    body.update(extra)
    return body
