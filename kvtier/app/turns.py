"""How the demo runs one turn: the same prompt twice, full prefill and then through kvtier.

- *without*: full prefill into an empty ``DynamicCache``;
- *with*: ``connector.before_prefill`` (lookup + load of the cached prefix from the memory
  pools, DISK or REMOTE), then prefill of the remaining suffix only.

TTFT is the wall time from the moment the prompt's token ids exist to the argmax of the first
output token (for *with* it includes ``before_prefill``). Both runs then decode the rest one
token at a time; the two outputs are compared token by token, and where they differ the
no-cache run's top-2 logit margin at the first differing position tells a floating-point
near-tie (tiny margin) from a bug (large margin). After the *with* run,
``connector.after_request(prompt + output, cache)`` stores the new full blocks (not timed).

:class:`SequentialTurns` is the transformers engine, one request at a time; another engine
(continuous batching, vLLM) plugs into :func:`kvtier.app.demo.run_turns` by providing the same
``run_turn(prompt_ids) -> (without, with)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvtier.connectors.hf import HFConnector, cache_kwarg


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
    """Cached prompt tokens per tier name (``{"CPU": 64, "DISK": 32}``)."""


class TurnRunner(Protocol):
    """Runs one prompt without and with kvtier (see the module docstring)."""

    def run_turn(self, prompt_ids: torch.Tensor) -> tuple[RunResult, RunResult]:
        """``prompt_ids``: ``[1, prompt_len]`` int64. Returns ``(without, with)``; both
        results' ``cache`` may be dropped (``None``)."""
        ...


class SequentialTurns:
    """The transformers model, one request at a time, greedy (:func:`greedy`)."""

    def __init__(self, connector: HFConnector, max_new_tokens: int, eos_token_id: int | None) -> None:
        self.connector = connector
        self.max_new_tokens = max_new_tokens
        self.eos_token_id = eos_token_id

    def run_turn(self, prompt_ids: torch.Tensor) -> tuple[RunResult, RunResult]:
        prompt_ids = prompt_ids.to(self.connector.model.device)
        base = run_without(self.connector.model, prompt_ids, self.max_new_tokens, self.eos_token_id)
        base.cache = None  # free it before the second run
        cand = run_with(self.connector, prompt_ids, self.max_new_tokens, self.eos_token_id)
        cand.cache = None
        return base, cand


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
    return greedy(model, prompt_ids, empty_cache(model), 0, max_new_tokens, eos_token_id, t0)


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


def warm_up(model: Any) -> None:
    """One short prefill and one decode step, so turn 1 pays no first-call overhead."""
    ids = torch.arange(16, dtype=torch.int64, device=model.device).unsqueeze(0) + 100
    greedy(model, ids, empty_cache(model), 0, 2, None, time.perf_counter())


def empty_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)
