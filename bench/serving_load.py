"""The load of bench/serving.py: simulated users, the OpenAI streaming client, launched servers.

Workload (the shape of LMCache's multi-round QA benchmark and vLLM's multi-turn serving
benchmark): ``users`` simulated users, each holding one ShareGPT conversation of ``rounds``
user turns, all behind one shared system prompt (``system_tokens`` tokens of ShareGPT text).
A user sends round ``r`` (system prompt + the chat so far + the next user message), reads the
streamed answer, thinks (``think_s``), then sends round ``r + 1``. Request starts are paced to
at most ``qps`` per second over all users (0: no pacing). The chat history holds the
dataset's replies (``history="dataset"``: every endpoint sees the same prompts, so outputs can
be compared across endpoints) or the endpoint's own replies (``"model"``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Workload:
    system_prompt: str
    conversations: list[list[tuple[str, str]]]
    """Per user: ``(user message, dataset reply)`` per round."""
    max_tokens: int
    think_s: float
    qps: float
    history: str = "dataset"


@dataclass
class Record:
    """One request as the client saw it (times in seconds from the pass start)."""

    user: int
    round: int
    start_s: float
    ttft_s: float | None = None
    end_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_by_source: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def itl_s(self) -> float | None:
        """Mean time per output token after the first (TPOT)."""
        n = self.completion_tokens or len(self.token_times_s)
        if self.ttft_s is None or self.end_s is None or n < 2:
            return None
        return (self.end_s - self.start_s - self.ttft_s) / (n - 1)


def build_workload(tokenizer: Any, users: int, rounds: int, seed: int, system_tokens: int, max_message_tokens: int,
                   max_prompt_tokens: int, max_tokens: int, think_s: float, qps: float, history: str) -> Workload:
    """Seeded ShareGPT draw (kvtier.app.sharegpt) and a shared system prompt of ShareGPT text."""
    from kvtier.app.models import truncate_tokens
    from kvtier.app.sharegpt import read_conversations, select_conversations

    pool = read_conversations()
    chosen, _ = select_conversations(tokenizer, users, rounds, seed=seed + 1, max_message_tokens=max_message_tokens,
                                     max_prompt_tokens=max(1, max_prompt_tokens - system_tokens),
                                     model_reply_tokens=max_tokens if history == "model" else None,
                                     conversations=pool)
    if len(chosen) < users:
        raise ValueError(f"expected {users} conversations with {rounds} rounds that fit, found {len(chosen)}")
    text = " ".join(reply for conv in pool[:50] for _, reply in conv)
    system = "You are a helpful assistant. Background notes follow.\n" + truncate_tokens(tokenizer, text, system_tokens)
    return Workload(system, chosen, max_tokens, think_s, qps, history)


class Pacer:
    """Request starts at most ``qps`` per second (0: no pacing)."""

    def __init__(self, qps: float) -> None:
        self.interval = 1.0 / qps if qps > 0 else 0.0
        self.next = 0.0
        self.lock = asyncio.Lock()

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self.lock:
            now = time.monotonic()
            delay = max(0.0, self.next - now)
            self.next = max(now, self.next) + self.interval
        await asyncio.sleep(delay)


async def chat_stream(session: Any, url: str, model: str, messages: list[dict], max_tokens: int, record: Record,
                      t0: float) -> None:
    """One streamed chat completion into ``record`` (greedy: temperature 0)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    parts: list[str] = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
            return
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.monotonic() - t0
            if "error" in event:
                record.error = str(event["error"])
                break
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if record.ttft_s is None:
                        record.ttft_s = now - record.start_s
                    record.token_times_s.append(now)
                    parts.append(content)
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
            if event.get("kvtier"):
                record.cached_by_source = dict(event["kvtier"].get("cached_tokens") or {})
            if event.get("usage"):
                usage = event["usage"]
                record.prompt_tokens, record.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
                record.cached_tokens = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    record.end_s = time.monotonic() - t0
    record.text = "".join(parts)
    if record.cached_tokens is None and record.cached_by_source:
        record.cached_tokens = sum(record.cached_by_source.values())


async def run_users(url: str, model: str, workload: Workload, timeout_s: float = 1800) -> tuple[list[Record], float]:
    """Every user's rounds against ``url``; returns the records and the pass's wall time."""
    import aiohttp

    pacer = Pacer(workload.qps)
    records: list[Record] = []
    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:

        async def user(u: int, conversation: list[tuple[str, str]]) -> None:
            messages = [{"role": "system", "content": workload.system_prompt}]
            for r, (question, reply) in enumerate(conversation):
                messages.append({"role": "user", "content": question})
                await pacer.wait()
                record = Record(u, r + 1, time.monotonic() - t0)
                records.append(record)
                await chat_stream(session, url, model, messages, workload.max_tokens, record, t0)
                messages.append({"role": "assistant", "content": reply if workload.history == "dataset" else record.text})
                if r + 1 < len(conversation):
                    await asyncio.sleep(workload.think_s)

        await asyncio.gather(*(user(u, conv) for u, conv in enumerate(workload.conversations)))
    return sorted(records, key=lambda r: (r.user, r.round)), time.monotonic() - t0


async def served_model(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as response:
            return (await response.json())["data"][0]["id"]


async def scrape_cached_by_source(url: str) -> dict[str, float]:
    """``vllm:prompt_tokens_cached_by_source`` from ``/metrics`` (vLLM), by source; ``{}`` elsewhere."""
    import aiohttp

    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/metrics") as response:
                if response.status != 200:
                    return {}
                text = await response.text()
    except aiohttp.ClientError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="([^"]+)"[^}]*\} ([0-9.e+]+)$',
                         text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


class Launched:
    """A server process started from a shell command with ``{port}`` (and ``{data_dir}``)."""

    def __init__(self, name: str, command: str, data_dir: str, log_dir: str) -> None:
        self.name, self.command, self.data_dir, self.log_dir = name, command, data_dir, log_dir
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0

    def start(self, ready_timeout_s: float = 600) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.starts += 1
        log = open(os.path.join(self.log_dir, f"{self.name}-{self.starts}.log"), "w")
        cmd = self.command.replace("{port}", str(port)).replace("{data_dir}", self.data_dir)
        self.process = subprocess.Popen(cmd, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} (log: {log.name})")
            try:
                asyncio.run(served_model(self.url))
                return self.url
            except Exception:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {ready_timeout_s} s (log: {log.name})")

    def stop(self, timeout_s: float = 180) -> None:
        """SIGINT to the process group (a clean stop: kvtier flushes to DISK), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
