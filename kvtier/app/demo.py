"""``kvtier demo``: multi-turn ShareGPT chats, each turn run twice - full prefill, then kvtier.

For every turn of every conversation a :class:`~kvtier.app.turns.TurnRunner` runs the same
prompt without and with kvtier (:mod:`kvtier.app.turns`: TTFT, greedy decode, identity); this
module draws the conversations, builds each turn's prompt, collects a :class:`TurnResult` per
turn and reports through a :class:`DemoOutput` (:mod:`kvtier.app.demo_output` prints them).

The next turn's prompt is the chat so far plus the assistant's reply - the model's own reply
(``history="model"``: decoded text of the baseline run's output, so the K/V of the previous
prompt and of the generated reply are reused) or the dataset's (``history="dataset"``) - plus
the next user message, rendered by the tokenizer's chat template.

The draw: ``num_conversations - long_conversations`` conversations drawn at random, plus
``long_conversations`` drawn among those whose history passes :data:`LONG_HISTORY_TOKENS`
before their last turn (so that turn has >= :data:`GOAL_MIN_CACHED_TOKENS` cached tokens:
the case kvtier exists for; ShareGPT's median user message is 17 tokens, so a random draw of
short chats rarely gets there). Each message is cut to ``max_message_tokens`` tokens and
conversations whose last prompt would exceed ``max_prompt_tokens`` are skipped, so that the
default run fits ~5 minutes on 2 quiet CPU cores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Literal, Protocol

import torch

from kvtier.app.models import ModelName, load_model, render_chat, smollm2_installed
from kvtier.app.sharegpt import Conversation, read_conversations, select_conversations
from kvtier.app.turns import RunResult, SequentialTurns, TurnRunner, compare, greedy, run_with, run_without, warm_up
from kvtier.config import StoreConfig
from kvtier.connectors.hf import HFConnector

__all__ = ["DemoOptions", "DemoReport", "TurnResult", "RunResult", "compare", "greedy", "percentile", "run_demo",
           "run_turns", "run_with", "run_without", "warm_up"]

History = Literal["model", "dataset"]
GOAL_MIN_CACHED_TOKENS = 1000
GOAL_MAX_RATIO = 0.2
"""Goal: median TTFT with/without kvtier on turns with >= 1,000 cached tokens."""
GOAL_FIRST_TURN_MAX_RATIO = 1.05
"""Goal: median TTFT with/without kvtier on first turns that miss (the lookup's overhead)."""
LONG_HISTORY_TOKENS = GOAL_MIN_CACHED_TOKENS + 32
"""History (before the last user message, replies counted as empty) of a long conversation:
its last turn then finds >= 1,000 cached tokens (whole blocks of the previous prompt)."""


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs; the CLI maps its flags onto these fields one to one."""

    model: ModelName = "smollm2"
    num_conversations: int = 8
    """ShareGPT conversations, a seeded choice among those with >= ``num_turns`` user turns."""
    long_conversations: int = 2
    """How many of them are drawn among those whose history passes 1,000 tokens (at most
    ``num_conversations``)."""
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
        if self.long_conversations < 0:
            raise ValueError(f"expected long_conversations >= 0, got {self.long_conversations}")
        if self.history not in ("model", "dataset"):
            raise ValueError(f"expected history 'model' or 'dataset', got {self.history!r}")

    @property
    def num_long(self) -> int:
        return min(self.long_conversations, self.num_conversations)

    @staticmethod
    def quick_defaults() -> dict[str, Any]:
        """``--quick``: a CI-sized run, one short and one long chat (the tiny random Llama
        when SmolLM2 is not installed)."""
        return {
            "model": "smollm2" if smollm2_installed() else "tiny-llama",
            "num_conversations": 2,
            "long_conversations": 1,
            "num_turns": 3,
            "max_new_tokens": 16,
            "max_message_tokens": 1024,
            "max_prompt_tokens": 1536,
        }


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


class DemoOutput(Protocol):
    """Where :func:`run_demo` reports as it goes (:class:`kvtier.app.demo_output.ConsoleOutput`)."""

    def note(self, text: str) -> None:
        """A line about the run (what is loaded, the store, warnings)."""

    def step(self, text: str) -> ContextManager[Any]:
        """A long step (loading the model), reported while it runs."""

    def begin_turns(self, total: int) -> None: ...

    def turn_done(self, result: TurnResult, done: int, total: int) -> None: ...

    def end_turns(self) -> None: ...


class QuietOutput:
    """A :class:`DemoOutput` that says nothing."""

    def note(self, text: str) -> None: ...

    def step(self, text: str) -> ContextManager[Any]:
        return nullcontext()

    def begin_turns(self, total: int) -> None: ...

    def turn_done(self, result: TurnResult, done: int, total: int) -> None: ...

    def end_turns(self) -> None: ...


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
    load_averages: list[float]
    """1-minute load average before the turns and after each: other work skews TTFT."""
    long_conversations: int = 0
    """Conversations drawn among those whose history passes 1,000 tokens."""

    @property
    def load_average(self) -> tuple[float, float]:
        """Before and after the turns."""
        return self.load_averages[0], self.load_averages[-1]

    @property
    def host_busy(self) -> bool:
        """The load average exceeded the cores at some point of the run: TTFT figures are
        skewed by other work (and the goal verdicts with them)."""
        cores = os.cpu_count() or 1
        return any(load > cores for load in self.load_averages if not math.isnan(load))

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
        doc: dict[str, Any] = {
            "turns": [_turn_json(t) for t in turns],
            "token_hit_rate": sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0,
        }
        for name, subset in (("", turns), ("_turn2plus", later)):
            for q in (50, 90):
                doc[f"ttft_p{q}_without{name}_s"] = percentile([t.ttft_without_s for t in subset], q)
                doc[f"ttft_p{q}_with{name}_s"] = percentile([t.ttft_with_s for t in subset], q)
        doc.update({
            "median_speedup_turn2plus": percentile([1 / t.ratio for t in later], 50),
            "identical_turns": sum(t.identical for t in turns),
            "total_turns": len(turns),
            "cached_tokens_by_tier": dict(by_tier),
            "goal_turns_cached_ge_1000": len(goal),
            "goal_median_ratio_cached_ge_1000": percentile([t.ratio for t in goal], 50),
            "first_turn_misses": len(cold),
            "first_turn_miss_median_ratio": percentile([t.ratio for t in cold], 50),
            "model_id": self.model_id,
            "options": asdict(self.options),
            "long_conversations": self.long_conversations,
            "data_dir": str(self.data_dir),
            "skipped_conversations": self.skipped_conversations,
            "disk_blocks_before": self.disk_blocks_before,
            "disk_blocks_after": self.disk_blocks_after,
            "load_s": self.load_s,
            "run_s": self.run_s,
            "cpu_count": os.cpu_count(),
            "load_average": list(self.load_average),
            "load_average_max": max(self.load_averages),
            "host_busy": self.host_busy,
        })
        return doc

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.summary(), indent=2) + "\n")

    def write_plot(self, path: str | Path) -> Path:
        """TTFT per turn without and with kvtier as a PNG (:func:`kvtier.app.plots.plot_demo`)."""
        from kvtier.app.plots import plot_demo

        return plot_demo(self.summary(), path)


def _turn_json(t: TurnResult) -> dict[str, Any]:
    names = ("conversation", "turn", "prompt_tokens", "cached_tokens", "cached_from", "ttft_without_s", "ttft_with_s",
             "identical", "cached_by_tier", "first_diff", "margin_at_diff", "output_tokens")
    return {name: getattr(t, name) for name in names}


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); ``None`` for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- the demo ----------------------------------------------------------------------------------
def clear_disk_tier(data_dir: Path) -> bool:
    """Delete the DISK tier's files in ``data_dir / "disk"`` but its lock file (which the CLI
    may hold: :func:`run_demo`'s ``before_store``). Returns whether there was anything to delete."""
    disk = Path(data_dir) / "disk"
    found = False
    for path in disk.iterdir() if disk.is_dir() else ():
        if path.name == "kvtier.lock":
            continue
        found = True
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return found


def run_turns(
    tokenizer: Any,
    runner: TurnRunner,
    conversations: list[Conversation],
    history: History = "model",
    on_turn: Any = None,
) -> list[TurnResult]:
    """Every turn of every conversation through ``runner``; ``on_turn(result)`` after each."""
    results: list[TurnResult] = []
    eos = tokenizer.eos_token_id
    for c, turns in enumerate(conversations, start=1):
        messages: list[dict[str, str]] = []
        for t, (user, dataset_reply) in enumerate(turns, start=1):
            messages.append({"role": "user", "content": user})
            prompt_ids = torch.tensor([render_chat(tokenizer, messages)], dtype=torch.int64)
            base, cand = runner.run_turn(prompt_ids)
            results.append(_turn_result(c, t, prompt_ids.shape[1], base, cand))
            if on_turn is not None:
                on_turn(results[-1])
            if history == "model":
                reply = tokenizer.decode([i for i in base.token_ids if i != eos], skip_special_tokens=True)
            else:
                reply = dataset_reply
            messages.append({"role": "assistant", "content": reply})
    return results


def _turn_result(conversation: int, turn: int, prompt_tokens: int, base: RunResult, cand: RunResult) -> TurnResult:
    identical, first_diff, margin = compare(base, cand)
    by_tier = cand.cached_by_tier
    return TurnResult(
        conversation=conversation, turn=turn, prompt_tokens=prompt_tokens, cached_tokens=cand.num_cached_tokens,
        cached_from=max(by_tier, key=lambda m: (by_tier[m], _TIER_ORDER.index(m))) if by_tier else None,
        cached_by_tier=dict(by_tier), ttft_without_s=base.ttft_s, ttft_with_s=cand.ttft_s,
        identical=identical, first_diff=first_diff, margin_at_diff=margin, output_tokens=len(base.token_ids),
    )


_TIER_ORDER = ["GPU", "CPU", "DISK", "REMOTE"]


def draw_conversations(tokenizer: Any, options: DemoOptions) -> tuple[list[Conversation], int, int]:
    """``(conversations, skipped, long)``: the random draw, then the long ones (see the module
    docstring); ``skipped`` counts random draws over the prompt budget."""
    pool = read_conversations()
    common = dict(seed=options.seed, max_message_tokens=options.max_message_tokens,
                  max_prompt_tokens=options.max_prompt_tokens, conversations=pool,
                  model_reply_tokens=options.max_new_tokens if options.history == "model" else None)
    short, skipped = select_conversations(tokenizer, options.num_conversations - options.num_long, options.num_turns,
                                          min_history_tokens=options.min_history_tokens, **common)
    long, _ = select_conversations(tokenizer, options.num_long, options.num_turns, exclude=short,
                                   min_history_tokens=max(options.min_history_tokens, LONG_HISTORY_TOKENS), **common)
    return short + long, skipped, len(long)


def run_demo(options: DemoOptions, config: StoreConfig, fresh: bool = False, output: DemoOutput | None = None,
             before_store: Callable[[], None] | None = None) -> DemoReport:
    """Load the model and the conversations, run every turn both ways, close the store
    (flushing memory tiers to DISK).

    ``before_store()`` is called after the model load, right before the store opens its DISK
    tier: the CLI holds the tier's lock during the load (so a second demo on the same data dir
    is refused at once, not after its own load) and releases it there."""
    output = output or QuietOutput()
    t_load = time.perf_counter()
    if fresh and clear_disk_tier(config.data_dir):
        output.note(f"--fresh: emptied the DISK tier at {config.data_dir / 'disk'}")
    if options.num_threads is not None:
        torch.set_num_threads(options.num_threads)
    with output.step(f"loading {options.model} and the ShareGPT conversations"):
        model, tokenizer, model_id = load_model(options.model, cache_dir=Path(config.data_dir) / "models")
        conversations, skipped, num_long = draw_conversations(tokenizer, options)
    if before_store is not None:
        before_store()
    with torch.inference_mode():
        connector = HFConnector.from_model(model, config, model_id=model_id)
        try:
            disk_before = len(connector.store.disk) if connector.store.disk is not None else 0
            for line in _start_lines(options, config, model_id, conversations, num_long, disk_before, connector):
                output.note(line)
            warm_up(model)
            load_s = time.perf_counter() - t_load
            loads = [_load_average()]
            t_run = time.perf_counter()
            total = sum(len(c) for c in conversations)
            output.begin_turns(total)

            def on_turn(result: TurnResult) -> None:
                loads.append(_load_average())
                output.turn_done(result, len(loads) - 1, total)

            runner = SequentialTurns(connector, options.max_new_tokens, tokenizer.eos_token_id)
            try:
                turns = run_turns(tokenizer, runner, conversations, options.history, on_turn)
            finally:
                output.end_turns()
            run_s = time.perf_counter() - t_run
        finally:
            connector.close()
        disk_after = len(connector.store.disk) if connector.store.disk is not None else 0
    return DemoReport(options, model_id, config.data_dir, turns, skipped, disk_before, disk_after, load_s, run_s,
                      config.block_size, loads, num_long)


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return float("nan")


def _start_lines(options: DemoOptions, config: StoreConfig, model_id: str, conversations: list[Conversation],
                 num_long: int, disk_blocks: int, connector: HFConnector) -> list[str]:
    pools = connector.store.pools
    memory = ", ".join(f"{p.medium} {p.capacity_bytes >> 20} MiB" for p in pools)
    if config.gpu_bytes and not any(str(p.medium) == "GPU" for p in pools):
        memory += " (no CUDA: --gpu-bytes joined the CPU pool)"
    disk = (f"DISK {config.disk_bytes >> 20} MiB at {config.data_dir / 'disk'} ({disk_blocks} blocks from earlier "
            "runs)") if config.disk_bytes else "no DISK tier"
    history = "the model's own replies" if options.history == "model" else "the dataset's replies"
    drawn = len(conversations) - num_long
    long = f", {num_long} among those whose history passes {GOAL_MIN_CACHED_TOKENS} tokens" if num_long else ""
    return [
        f"model {model_id}, {torch.get_num_threads()} torch threads; greedy, {options.max_new_tokens} new tokens "
        f"per turn; history = {history}",
        f"{len(conversations)} ShareGPT conversations x {options.num_turns} turns: {drawn} drawn at random{long} "
        f"(seed {options.seed}; messages cut to {options.max_message_tokens} tokens, prompts <= "
        f"{options.max_prompt_tokens})",
        f"store: {memory}; {disk}; block_size {config.block_size}",
        f"K/V layout (layer groups): {connector.store.spec.layout_name}",
    ]
