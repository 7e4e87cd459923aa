"""``kvtier demo --engine continuous --users N``: the demo's chats as N concurrent users served
by transformers' continuous batching, without kvtier, then with it.

Each user holds one ShareGPT conversation and sends its turns one after the other (the next
turn ``think_s`` after the previous answer); all users run at once, so the engine batches
their prefills and decodes together. Two passes in this process, one engine each, with the same
``ContinuousBatchingConfig`` (:class:`kvtier.app.cb_engine.EngineOptions`):

1. *without*: transformers' continuous batching alone, its own prefix sharing on. Its replies
   make the chats' history (``history="model"``, or the dataset's replies).
2. *with*: the same engine under :class:`~kvtier.connectors.hf_paged.HFPagedConnector`,
   replaying exactly pass 1's prompts with the same arrival pattern.

Every turn's output is compared token for token (greedy), TTFT measured from the request's
submission to its first token, and cached prompt tokens counted by source (``paged``:
transformers' own cache; kvtier's tiers). The store is closed after pass 2 (memory tiers
flushed to DISK): run the demo again and turn 1 hits from DISK. The report has the sequential
demo's JSON fields plus the concurrency figures of both passes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.app.cb_engine import ContinuousEngine, EngineOptions
from kvtier.app.demo import DemoOptions, DemoReport, TurnResult, _load_average, _TIER_ORDER, clear_disk_tier, percentile
from kvtier.app.models import load_model, render_chat
from kvtier.connectors.hf_paged.models import check_model
from kvtier.app.sharegpt import Conversation, select_conversations
from kvtier.config import StoreConfig


@dataclass(frozen=True)
class ContinuousOptions:
    users: int = 8
    """Concurrent users, one ShareGPT conversation each."""
    think_s: float = 0.5
    """Seconds a user waits between an answer and its next turn."""
    engine: EngineOptions = field(default_factory=lambda: EngineOptions(page_size=64, paged_cache_bytes=256 << 20,
                                                                         max_batch_tokens=1024))


@dataclass
class Served:
    """One turn as one pass served it."""

    prompt: list[int]
    tokens: list[int]
    ttft_s: float
    start_s: float
    end_s: float
    cached_by_source: dict[str, int]


@dataclass
class ContinuousReport(DemoReport):
    users: int = 0
    concurrency: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(engine="continuous", users=self.users, concurrency=self.concurrency)
        return out


async def _serve_user(engine: ContinuousEngine, user: int, turns: Conversation, prompts: list[list[int]] | None,
                      options: DemoOptions, think_s: float, tokenizer: Any, t0: float, out: dict) -> None:
    """One user's turns; ``prompts`` replays given prompts, else builds them from the replies."""
    messages: list[dict[str, str]] = []
    for t, (question, dataset_reply) in enumerate(turns):
        messages.append({"role": "user", "content": question})
        prompt = prompts[t] if prompts is not None else render_chat(tokenizer, messages)
        request_id = engine.new_request_id()
        start = time.perf_counter()
        tokens: list[int] = []
        first = None
        async for step in engine.generate(prompt, options.max_new_tokens, request_id=request_id):
            if step.error is not None:
                raise RuntimeError(f"user {user} turn {t + 1}: {step.error}")
            if first is None and step.token_ids:
                first = step.t
            tokens.extend(step.token_ids)
        admission = engine.admissions.pop(request_id)
        out[user, t] = Served(prompt, tokens, (first or time.perf_counter()) - start, start - t0,
                              time.perf_counter() - t0, dict(admission.cached_by_source) if admission else {})
        reply = tokenizer.decode([i for i in tokens if i != tokenizer.eos_token_id], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply if options.history == "model" else dataset_reply})
        if t + 1 < len(turns):
            await asyncio.sleep(think_s)


def serve_pass(engine: ContinuousEngine, conversations: list[Conversation], prompts: dict | None, options: DemoOptions,
               think_s: float, tokenizer: Any) -> tuple[dict, float]:
    """All users at once; returns ``{(user, turn_index): Served}`` and the wall time."""
    out: dict = {}

    async def run() -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(
            _serve_user(engine, u, conv, [prompts[u, t] for t in range(len(conv))] if prompts else None, options,
                        think_s, tokenizer, t0, out)
            for u, conv in enumerate(conversations)
        ))

    t = time.perf_counter()
    asyncio.run(run())
    return out, time.perf_counter() - t


def concurrency(served: dict, wall_s: float) -> dict[str, Any]:
    """Requests in flight (max, time-weighted mean), throughput, TTFT and per-token latency."""
    events = sorted([(s.start_s, 1) for s in served.values()] + [(s.end_s, -1) for s in served.values()])
    level = peak = 0
    area, last = 0.0, 0.0
    for t, delta in events:
        area += level * (t - last)
        level, last = level + delta, t
        peak = max(peak, level)
    tokens = sum(len(s.tokens) for s in served.values())
    tpot = [(s.end_s - s.start_s - s.ttft_s) / (len(s.tokens) - 1) for s in served.values() if len(s.tokens) > 1]
    cached: Counter = Counter()
    for s in served.values():
        cached.update(s.cached_by_source)
    return {"requests": len(served), "wall_s": wall_s, "max_in_flight": peak,
            "mean_in_flight": area / wall_s if wall_s else 0.0, "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "ttft_p50_s": percentile([s.ttft_s for s in served.values()], 50),
            "ttft_p90_s": percentile([s.ttft_s for s in served.values()], 90),
            "inter_token_latency_p50_s": percentile(tpot, 50), "cached_tokens_by_source": dict(cached)}


def run_continuous_demo(options: DemoOptions, config: StoreConfig, cont: ContinuousOptions, fresh: bool = False,
                        console: Any = None) -> ContinuousReport:
    """Load the model and ``cont.users`` conversations; pass 1 without kvtier, pass 2 with it
    (the store closed afterwards: its memory tiers flushed to DISK)."""
    t_load = time.perf_counter()
    if fresh and clear_disk_tier(config.data_dir) and console is not None:
        console.print(f"--fresh: deleted {config.data_dir / 'disk'}")
    if options.num_threads is not None:
        torch.set_num_threads(options.num_threads)
    model, tokenizer, model_id = load_model(options.model)
    check_model(model, config.block_size)  # refuse before the pass without kvtier, not after it
    conversations, skipped = select_conversations(
        tokenizer, cont.users, options.num_turns, seed=options.seed, max_message_tokens=options.max_message_tokens,
        max_prompt_tokens=options.max_prompt_tokens, min_history_tokens=options.min_history_tokens,
        model_reply_tokens=options.max_new_tokens if options.history == "model" else None,
    )
    with torch.inference_mode():
        load_s = time.perf_counter() - t_load
        load_before = _load_average()
        t_run = time.perf_counter()
        baseline = ContinuousEngine(model, tokenizer, model_id, cont.engine, None, max_new_tokens=options.max_new_tokens)
        baseline.start()
        try:
            without, without_s = serve_pass(baseline, conversations, None, options, cont.think_s, tokenizer)
        finally:
            baseline.close()
        engine = ContinuousEngine(model, tokenizer, model_id, cont.engine, config, max_new_tokens=options.max_new_tokens)
        store = engine.connector.store
        disk_before = len(store.disk) if store.disk is not None else 0
        engine.start()
        try:
            prompts = {key: s.prompt for key, s in without.items()}
            with_kv, with_s = serve_pass(engine, conversations, prompts, options, cont.think_s, tokenizer)
        finally:
            engine.close()
        disk_after = len(store.disk) if store.disk is not None else 0
        run_s = time.perf_counter() - t_run
    turns = [_turn(u + 1, t + 1, without[u, t], with_kv[u, t]) for u, t in sorted(without)]
    report = ContinuousReport(options, model_id, config.data_dir, turns, skipped, disk_before, disk_after, load_s,
                              run_s, config.block_size, [load_before, _load_average()], users=cont.users,
                              concurrency={"without": concurrency(without, without_s),
                                           "with": concurrency(with_kv, with_s),
                                           "page_size": cont.engine.page_size, "think_s": cont.think_s})
    return report


def _turn(user: int, turn: int, base: Served, cand: Served) -> TurnResult:
    a, b = base.tokens, cand.tokens
    first_diff = None if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    by = cand.cached_by_source
    order = _TIER_ORDER + ["paged"]
    return TurnResult(conversation=user, turn=turn, prompt_tokens=len(cand.prompt), cached_tokens=sum(by.values()),
                      cached_from=max(by, key=lambda m: (by[m], -order.index(m) if m in order else 0)) if by else None,
                      cached_by_tier=dict(by), ttft_without_s=base.ttft_s, ttft_with_s=cand.ttft_s,
                      identical=a == b, first_diff=first_diff, margin_at_diff=None, output_tokens=len(a))
