"""``kvtier demo``: multi-turn ShareGPT chats, each turn run twice - full prefill, then kvtier.

For every turn of every conversation the same greedy loop runs twice on the same prompt:

- *without*: full prefill into an empty ``DynamicCache``;
- *with*: ``connector.before_prefill`` (lookup + load of the cached prefix from GPU/CPU/DISK),
  then prefill of the remaining suffix only.

TTFT is the wall time from the moment the prompt's token ids exist to the argmax of the first
output token (for *with* it includes ``before_prefill``). Both runs then decode the rest one
token at a time; the two outputs are compared token by token, and where they differ the
no-cache run's top-2 logit margin at the first differing position tells a floating-point
near-tie (tiny margin) from a bug (large margin). After the *with* run,
``connector.after_request(prompt + output, cache)`` stores the new full blocks (not timed).

The next turn's prompt is the chat so far plus the assistant's reply - the model's own reply
(``history="model"``: decoded text of the baseline run's output, so the K/V of the previous
prompt and of the generated reply are reused) or the dataset's (``history="dataset"``) - plus
the next user message, rendered by the tokenizer's chat template.

Budget: each message is cut to ``max_message_tokens`` tokens, and conversations whose last
prompt would exceed ``max_prompt_tokens`` are skipped (the draw moves on to the next one in
the seeded order), so that the default run fits ~10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from kvtier.config import StoreConfig
from kvtier.connectors.hf import HFConnector, cache_kwarg
from kvtier.app.models import ModelName, load_model, render_chat, smollm2_installed
from kvtier.app.sharegpt import Conversation, select_conversations

logger = logging.getLogger(__name__)

History = Literal["model", "dataset"]
GOAL_MIN_CACHED_TOKENS = 1000
GOAL_MAX_RATIO = 0.2
GOAL_FIRST_TURN_MAX_RATIO = 1.05


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs; the CLI maps its flags onto these fields one to one."""

    model: ModelName = "smollm2"
    num_conversations: int = 8
    """ShareGPT conversations, a seeded choice among those with >= ``num_turns`` user turns."""
    num_turns: int = 4
    """User turns run per conversation."""
    max_new_tokens: int = 32
    """Greedy tokens per turn (fewer when the model ends its reply)."""
    history: History = "model"
    """Assistant turns of the history: the model's own replies, or the dataset's."""
    seed: int = 0
    max_message_tokens: int = 1024
    """Each user message (and dataset reply) is cut to this many tokens."""
    max_prompt_tokens: int = 2500
    """Conversations whose last prompt would exceed this are skipped."""
    min_history_tokens: int = 0
    """Conversations whose last turn's history is shorter are skipped (0: no filter)."""
    num_threads: int | None = None
    """``torch.set_num_threads`` for the run; ``None`` leaves torch's default."""

    def __post_init__(self) -> None:
        for name in ("num_conversations", "num_turns", "max_new_tokens", "max_message_tokens", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"expected {name} >= 1, got {getattr(self, name)}")
        if self.history not in ("model", "dataset"):
            raise ValueError(f"expected history 'model' or 'dataset', got {self.history!r}")

    @staticmethod
    def quick_defaults() -> dict[str, Any]:
        """``--quick``: a CI-sized run (the tiny random Llama when SmolLM2 is not installed)."""
        return {
            "model": "smollm2" if smollm2_installed() else "tiny-llama",
            "num_conversations": 2,
            "num_turns": 3,
            "max_new_tokens": 16,
            "max_message_tokens": 256,
            "max_prompt_tokens": 1024,
        }


@dataclass(slots=True)
class RunResult:
    """One greedy run of one prompt."""

    token_ids: list[int]
    ttft_s: float
    decode_s: float
    margins: list[float]
    """Top-2 logit margin at each output position."""
    cache: Any
    num_cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    cached_from: str | None
    """The tier that supplied most of the cached tokens (``None`` on a miss)."""
    cached_by_tier: dict[str, int]
    ttft_without_s: float
    ttft_with_s: float
    identical: bool
    first_diff: int | None
    """First position where the outputs differ (``None`` when identical)."""
    margin_at_diff: float | None
    """The no-cache run's top-2 logit margin at ``first_diff``."""
    output_tokens: int

    @property
    def ratio(self) -> float:
        return self.ttft_with_s / self.ttft_without_s


@dataclass
class DemoReport:
    options: DemoOptions
    model_id: str
    data_dir: Path
    turns: list[TurnResult]
    skipped_conversations: int
    disk_blocks_before: int
    disk_blocks_after: int
    load_s: float
    run_s: float
    block_size: int
    load_average: tuple[float, float]
    """1-minute load average before and after the turns: other work on the host skews TTFT."""

    def first_turn_misses(self) -> list[TurnResult]:
        """Turn-1 requests that found at most one block (the system prompt all chats share)."""
        return [t for t in self.turns if t.turn == 1 and t.cached_tokens <= self.block_size]

    def goal_turns(self) -> list[TurnResult]:
        """Turns whose cached history is >= 1000 tokens."""
        return [t for t in self.turns if t.cached_tokens >= GOAL_MIN_CACHED_TOKENS]

    def summary(self) -> dict[str, Any]:
        """The JSON document ``--json`` writes."""
        turns = self.turns
        prompt = sum(t.prompt_tokens for t in turns)
        by_tier: Counter = Counter()
        for t in turns:
            by_tier.update(t.cached_by_tier)
        later = [t for t in turns if t.turn >= 2]
        goal = self.goal_turns()
        cold = self.first_turn_misses()
        return {
            "turns": [_turn_json(t) for t in turns],
            "token_hit_rate": sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0,
            "ttft_p50_without_s": percentile([t.ttft_without_s for t in turns], 50),
            "ttft_p50_with_s": percentile([t.ttft_with_s for t in turns], 50),
            "ttft_p90_without_s": percentile([t.ttft_without_s for t in turns], 90),
            "ttft_p90_with_s": percentile([t.ttft_with_s for t in turns], 90),
            "ttft_p50_without_turn2plus_s": percentile([t.ttft_without_s for t in later], 50),
            "ttft_p50_with_turn2plus_s": percentile([t.ttft_with_s for t in later], 50),
            "ttft_p90_without_turn2plus_s": percentile([t.ttft_without_s for t in later], 90),
            "ttft_p90_with_turn2plus_s": percentile([t.ttft_with_s for t in later], 90),
            "identical_turns": sum(t.identical for t in turns),
            "total_turns": len(turns),
            "cached_tokens_by_tier": dict(by_tier),
            "goal_turns_cached_ge_1000": len(goal),
            "goal_median_ratio_cached_ge_1000": percentile([t.ratio for t in goal], 50),
            "first_turn_misses": len(cold),
            "first_turn_miss_median_ratio": percentile([t.ratio for t in cold], 50),
            "model_id": self.model_id,
            "options": asdict(self.options),
            "data_dir": str(self.data_dir),
            "skipped_conversations": self.skipped_conversations,
            "disk_blocks_before": self.disk_blocks_before,
            "disk_blocks_after": self.disk_blocks_after,
            "load_s": self.load_s,
            "run_s": self.run_s,
            "cpu_count": os.cpu_count(),
            "load_average": list(self.load_average),
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.summary(), indent=2) + "\n")

    def write_plot(self, path: str | Path) -> Path:
        """TTFT per turn without and with kvtier as a PNG (:func:`kvtier.app.plots.plot_demo`)."""
        from kvtier.app.plots import plot_demo

        return plot_demo(self.summary(), path)


def _turn_json(t: TurnResult) -> dict[str, Any]:
    return {
        "conversation": t.conversation,
        "turn": t.turn,
        "prompt_tokens": t.prompt_tokens,
        "cached_tokens": t.cached_tokens,
        "cached_from": t.cached_from,
        "ttft_without_s": t.ttft_without_s,
        "ttft_with_s": t.ttft_with_s,
        "identical": t.identical,
        "cached_by_tier": t.cached_by_tier,
        "first_diff": t.first_diff,
        "margin_at_diff": t.margin_at_diff,
        "output_tokens": t.output_tokens,
    }


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); ``None`` for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- the greedy loop both runs share -----------------------------------------------------------
def greedy(
    model: Any,
    prompt_ids: torch.Tensor,
    cache: Any,
    num_cached_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    t0: float,
) -> RunResult:
    """Prefill ``prompt_ids[:, num_cached_tokens:]`` into ``cache``, then decode greedily.

    Args:
        model: a transformers causal LM in eval mode (call under ``torch.inference_mode``).
        prompt_ids: ``[1, prompt_len]`` int64 on the model's device.
        cache: a ``DynamicCache`` holding the K/V of the first ``num_cached_tokens`` tokens.
        t0: ``time.perf_counter()`` when the prompt's ids came to exist (TTFT starts there).
    """
    kwarg = cache_kwarg(model)
    out = model(input_ids=prompt_ids[:, num_cached_tokens:], use_cache=True, logits_to_keep=1, **{kwarg: cache})
    logits = out.logits[0, -1]
    token = int(torch.argmax(logits))
    ttft_s = time.perf_counter() - t0
    tokens, margins = [token], [_margin(logits)]
    t1 = time.perf_counter()
    while len(tokens) < max_new_tokens and token != eos_token_id:
        step = torch.tensor([[token]], dtype=prompt_ids.dtype, device=prompt_ids.device)
        logits = model(input_ids=step, use_cache=True, **{kwarg: cache}).logits[0, -1]
        token = int(torch.argmax(logits))
        tokens.append(token)
        margins.append(_margin(logits))
    return RunResult(tokens, ttft_s, time.perf_counter() - t1, margins, cache, num_cached_tokens)


def _margin(logits: torch.Tensor) -> float:
    top2 = torch.topk(logits.float(), 2).values
    return float(top2[0] - top2[1])


def run_without(model: Any, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None) -> RunResult:
    """Full prefill into an empty ``DynamicCache``."""
    t0 = time.perf_counter()
    return greedy(model, prompt_ids, _empty_cache(model), 0, max_new_tokens, eos_token_id, t0)


def run_with(
    connector: HFConnector, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None
) -> RunResult:
    """Load the cached prefix through kvtier, prefill the suffix, decode, then store."""
    t0 = time.perf_counter()
    plan = connector.before_prefill(prompt_ids)
    result = greedy(connector.model, prompt_ids, plan.cache, plan.num_cached_tokens, max_new_tokens, eos_token_id, t0)
    result.cached_by_tier = plan.cached_tokens_by_medium(connector.block_size)
    connector.after_request(prompt_ids[0].tolist() + result.token_ids, result.cache)
    return result


def compare(baseline: RunResult, candidate: RunResult) -> tuple[bool, int | None, float | None]:
    """``(identical, first_diff, baseline margin at first_diff)``."""
    a, b = baseline.token_ids, candidate.token_ids
    if a == b:
        return True, None, None
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    margin = baseline.margins[pos] if pos < len(baseline.margins) else None
    return False, pos, margin


# -- the demo ----------------------------------------------------------------------------------
def clear_disk_tier(data_dir: Path) -> bool:
    """Delete the DISK tier's LMDB directory (``data_dir / "disk"``). Returns whether it existed."""
    disk = Path(data_dir) / "disk"
    if disk.exists():
        shutil.rmtree(disk)
        return True
    return False


def warm_up(model: Any) -> None:
    """One short prefill and one decode step, so turn 1 pays no first-call overhead."""
    ids = torch.arange(16, dtype=torch.int64, device=model.device).unsqueeze(0) + 100
    greedy(model, ids, _empty_cache(model), 0, 2, None, time.perf_counter())


def _empty_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def run_turns(
    model: Any,
    tokenizer: Any,
    connector: HFConnector,
    conversations: list[Conversation],
    options: DemoOptions,
    on_turn: Any = None,
) -> list[TurnResult]:
    """Every turn of every conversation, without and with kvtier. ``on_turn(result)`` is
    called after each turn (progress)."""
    results: list[TurnResult] = []
    eos = tokenizer.eos_token_id
    for c, turns in enumerate(conversations, start=1):
        messages: list[dict[str, str]] = []
        for t, (user, dataset_reply) in enumerate(turns, start=1):
            messages.append({"role": "user", "content": user})
            prompt_ids = torch.tensor([render_chat(tokenizer, messages)], dtype=torch.int64, device=model.device)
            base = run_without(model, prompt_ids, options.max_new_tokens, eos)
            base.cache = None  # free it before the second run
            cand = run_with(connector, prompt_ids, options.max_new_tokens, eos)
            cand.cache = None
            identical, first_diff, margin = compare(base, cand)
            by_tier = cand.cached_by_tier
            results.append(TurnResult(
                conversation=c, turn=t, prompt_tokens=prompt_ids.shape[1],
                cached_tokens=cand.num_cached_tokens,
                cached_from=max(by_tier, key=lambda m: (by_tier[m], _TIER_ORDER.index(m))) if by_tier else None,
                cached_by_tier=dict(by_tier), ttft_without_s=base.ttft_s, ttft_with_s=cand.ttft_s,
                identical=identical, first_diff=first_diff, margin_at_diff=margin,
                output_tokens=len(base.token_ids),
            ))
            if on_turn is not None:
                on_turn(results[-1])
            if options.history == "model":
                reply_ids = [i for i in base.token_ids if i != eos]
                reply = tokenizer.decode(reply_ids, skip_special_tokens=True)
            else:
                reply = dataset_reply
            messages.append({"role": "assistant", "content": reply})
    return results


_TIER_ORDER = ["GPU", "CPU", "DISK", "REMOTE"]


def run_demo(
    options: DemoOptions,
    config: StoreConfig,
    fresh: bool = False,
    progress: Any = None,
    console: Any = None,
) -> DemoReport:
    """Load the model and the conversations, run every turn both ways, close the store
    (flushing memory tiers to DISK). ``progress(total)`` returns a callback per turn."""
    t_load = time.perf_counter()
    if fresh and clear_disk_tier(config.data_dir) and console is not None:
        console.print(f"--fresh: deleted {config.data_dir / 'disk'}")
    if console is not None:
        console.print(f"loading {options.model} and the ShareGPT conversations ...")
    if options.num_threads is not None:
        torch.set_num_threads(options.num_threads)
    model, tokenizer, model_id = load_model(options.model, cache_dir=Path(config.data_dir) / "models")
    conversations, skipped = select_conversations(
        tokenizer, options.num_conversations, options.num_turns, seed=options.seed,
        max_message_tokens=options.max_message_tokens, max_prompt_tokens=options.max_prompt_tokens,
        min_history_tokens=options.min_history_tokens,
        model_reply_tokens=options.max_new_tokens if options.history == "model" else None,
    )
    with torch.inference_mode():
        connector = HFConnector.from_model(model, config, model_id=model_id)
        try:
            disk_before = len(connector.store.disk) if connector.store.disk is not None else 0
            if console is not None:
                lines = _start_lines(options, config, model_id, conversations, skipped, disk_before,
                                     connector.store.pools, connector.store.spec.layout_name)
                console.print(lines, markup=False)  # the layout name has [brackets]
            warm_up(model)
            load_s = time.perf_counter() - t_load
            load_before = _load_average()
            t_run = time.perf_counter()
            total = sum(len(c) for c in conversations)
            on_turn = progress(total) if progress is not None else None
            turns = run_turns(model, tokenizer, connector, conversations, options, on_turn)
            run_s = time.perf_counter() - t_run
            load_average = (load_before, _load_average())
        finally:
            connector.close()
        disk_after = len(connector.store.disk) if connector.store.disk is not None else 0
    return DemoReport(options, model_id, config.data_dir, turns, skipped, disk_before, disk_after, load_s, run_s,
                      config.block_size, load_average)


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return float("nan")


def _start_lines(
    options: DemoOptions, config: StoreConfig, model_id: str, conversations: list[Conversation],
    skipped: int, disk_blocks: int, pools: list, layout: str,
) -> str:
    # the store's pools as they are: without CUDA there is no GPU pool (its budget joins CPU)
    memory = ", ".join(f"{p.medium} {p.capacity_bytes >> 20} MiB ({p.device})" for p in pools)
    history = "the model's own replies" if options.history == "model" else "the dataset's replies"
    return (
        f"model {model_id}; {len(conversations)} ShareGPT conversations x {options.num_turns} turns "
        f"(seed {options.seed}; {skipped} draws skipped: last prompt > {options.max_prompt_tokens} tokens"
        + (f" or history < {options.min_history_tokens}" if options.min_history_tokens else "")
        + f"; messages cut to {options.max_message_tokens} tokens); history = {history}; "
        f"greedy, {options.max_new_tokens} new tokens per turn; {torch.get_num_threads()} torch threads\n"
        f"K/V layout (layer groups): {layout}\n"
        f"store: {memory}, "
        f"DISK {config.disk_bytes >> 20} MiB at {config.data_dir / 'disk'} "
        f"({disk_blocks} blocks there from earlier runs); block_size {config.block_size}"
    )
