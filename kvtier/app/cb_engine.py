"""One model served by transformers' continuous batching, with or without kvtier, for asyncio.

    engine = ContinuousEngine(model, tokenizer, model_id, EngineOptions(), store_config)
    engine.start()
    async for step in engine.generate(prompt_ids, max_new_tokens=64):
        ...  # step.token_ids: the new tokens; step.finish_reason once done
    engine.close()                      # stops the manager, closes the store (flush to DISK)

``store_config=None`` is transformers' continuous batching alone, with its own prefix sharing
on (the baseline): a :class:`~kvtier.connectors.hf_paged.probe.PrefixProbe` counts its hits.
With a store config the same manager runs under :class:`HFPagedConnector`. Both use the same
``ContinuousBatchingConfig`` (:meth:`EngineOptions.cb_config`).

Outputs come back through one dispatcher thread reading the manager's output queue
(``get_result``) and handing each one to its request's asyncio queue; a consumer that stops
early (a client that went away) cancels its request in the manager.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from kvtier.config import StoreConfig

Sampling = Literal["greedy", "sample"]


@dataclass(frozen=True)
class EngineOptions:
    """transformers' continuous batching settings, the same with and without kvtier."""

    page_size: int = 256
    """Tokens per paged block (transformers' default); a multiple of kvtier's block_size."""
    num_blocks: int | None = None
    """Paged blocks of transformers' cache; ``None``: ``paged_cache_bytes`` worth of them."""
    paged_cache_bytes: int = 1 << 30
    """Size of transformers' paged cache when ``num_blocks`` is ``None`` (transformers' own
    default, a share of free memory, would zero-fill most of the host's RAM on a CPU)."""
    max_batch_tokens: int | None = None
    """Tokens per forward; ``None``: transformers' default."""
    sampling: Sampling = "greedy"
    """``greedy`` (argmax for every request) or ``sample`` (per-request temperature/top_p)."""
    seed: int | None = None
    """Seed of the sampler (``sample``)."""
    load_deadline_s: float = 2.0
    """How long a request waits for its kvtier load before computing instead."""

    def __post_init__(self) -> None:
        if self.sampling not in ("greedy", "sample"):
            raise ValueError(f"expected sampling 'greedy' or 'sample', got {self.sampling!r}")
        if self.page_size < 4:
            raise ValueError(f"expected page_size >= 4, got {self.page_size}")

    def cb_config(self, model: Any) -> Any:
        """The ``ContinuousBatchingConfig`` for ``model`` (its K/V shape sizes the cache)."""
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from kvtier.connectors.hf import kv_spec_for
        from kvtier.connectors.hf_paged import check_transformers

        name = "block_size" if check_transformers() == "block_manager" else "page_size"
        num_blocks = self.num_blocks
        if num_blocks is None:
            num_blocks = max(1, self.paged_cache_bytes // kv_spec_for(model, self.page_size).block_nbytes)
        values: dict[str, Any] = {name: self.page_size, "num_blocks": num_blocks,
                                  "max_batch_tokens": self.max_batch_tokens, "seed": self.seed}
        if self.sampling == "sample":
            values["per_request_processors"] = True
        return ContinuousBatchingConfig(**values)

    def generation_config(self, eos_token_id: int | list[int] | None, max_new_tokens: int) -> Any:
        from transformers import GenerationConfig

        eos = -1 if eos_token_id is None else eos_token_id
        if self.sampling == "greedy":
            return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos)
        # temperature/top_p away from 1.0 so that transformers builds their (per-request) processors
        return GenerationConfig(do_sample=True, temperature=0.7, top_p=0.95, max_new_tokens=max_new_tokens,
                                eos_token_id=eos)


@dataclass(frozen=True, slots=True)
class Step:
    """New output of one request.

    Attributes:
        token_ids: tokens generated since the previous step.
        finish_reason: ``"stop"`` (EOS), ``"length"`` (max tokens) or ``None`` while running.
        error: transformers' error message for a failed request.
        t: ``time.perf_counter()`` when the dispatcher received it.
    """

    token_ids: list[int]
    finish_reason: str | None
    error: str | None
    t: float


class ContinuousEngine:
    """transformers' ``ContinuousBatchingManager`` for one model, kvtier on or off.

    Args:
        model, tokenizer, model_id: from :func:`kvtier.app.models.load_model`.
        options: the continuous batching settings.
        store_config: kvtier's store; ``None`` runs without kvtier.
        model_revision: key revision for kvtier (default: a fingerprint of the weights).
    """

    def __init__(self, model: Any, tokenizer: Any, model_id: str, options: EngineOptions,
                 store_config: StoreConfig | None = None, model_revision: str | None = None,
                 max_new_tokens: int = 256) -> None:
        from kvtier.connectors.hf_paged import HFPagedConnector
        from kvtier.connectors.hf_paged.probe import PrefixProbe

        self.model, self.tokenizer, self.model_id, self.options = model, tokenizer, model_id, options
        self.eos_token_id = tokenizer.eos_token_id
        generation = options.generation_config(self.eos_token_id, max_new_tokens)
        self.connector = None
        self.probe = None
        if store_config is not None:
            self.connector = HFPagedConnector.from_model(model, store_config, model_id=model_id,
                                                         model_revision=model_revision,
                                                         load_deadline_s=options.load_deadline_s)
            self.manager = self.connector.init_continuous_batching(generation, options.cb_config(model))
        else:
            self.probe = PrefixProbe()
            self.manager = model.init_continuous_batching(generation_config=generation,
                                                          continuous_batching_config=options.cb_config(model))
            self.probe.attach(self.manager)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._running = False
        self._dispatcher: threading.Thread | None = None

    @property
    def admissions(self) -> Any:
        """Per-request cached tokens by source (kvtier's tiers, or transformers' own ``paged``)."""
        return (self.connector or self.probe).admissions

    def start(self, warmup: bool = True) -> None:
        """Start the generation loop; ``warmup`` first serves one 4-token request (counted in
        the admissions): the first step of a manager allocates and touches its static input
        tensors, seconds on a CPU, which would otherwise land on the first client's TTFT."""
        self.manager.start()
        if warmup:
            token = self.eos_token_id if isinstance(self.eos_token_id, int) else 0
            rid = self.manager.add_request([token] * 4, request_id="kvtier-warmup", max_new_tokens=1)
            if rid is not None:
                self.manager.get_result(request_id=rid, timeout=600)
                self.admissions.pop(rid)
        self._running = True
        self._dispatcher = threading.Thread(target=self._dispatch, name="kvtier-cb-dispatch", daemon=True)
        self._dispatcher.start()

    def close(self) -> None:
        """Stop the manager (requests in flight are cut), close kvtier's store (flush)."""
        self._running = False
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=5)
        self.manager.stop(block=True, timeout=30)
        if self.connector is not None:
            self.connector.close()
        elif self.probe is not None:
            self.probe.detach()

    def healthy(self) -> bool:
        return self.manager.is_running() and self.manager.background_thread_status.fatal_error is None

    def new_request_id(self) -> str:
        return f"chat-{next(self._ids)}"

    async def generate(self, prompt_ids: list[int], max_new_tokens: int, *, request_id: str | None = None,
                       temperature: float | None = None, top_p: float | None = None) -> AsyncIterator[Step]:
        """Stream the request's output; leaving the loop early (``aclose``, a cancelled task)
        cancels the request. ``engine.admissions.pop(request_id)`` afterwards says where its
        cached prompt tokens came from.

        Raises:
            RuntimeError: the engine refused the request (stopping, or its loop died).
        """
        request_id = request_id or self.new_request_id()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        kwargs: dict[str, Any] = {}
        if temperature is not None:
            kwargs["temperature"] = float(temperature)
        if top_p is not None:
            kwargs["top_p"] = float(top_p)
        finished = False
        try:
            added = self.manager.add_request(list(prompt_ids), request_id=request_id, max_new_tokens=max_new_tokens,
                                             streaming=True, eos_token_id=self.eos_token_id, **kwargs)
            if added is None:
                raise RuntimeError("the engine is not accepting requests (stopping or stopped)")
            sent = 0
            while not finished:
                output, t = await queue.get()
                tokens = list(output.generated_tokens)
                finished = output.is_finished()
                reason = None
                if finished:
                    reason = "stop" if tokens and tokens[-1] == self.eos_token_id else "length"
                if len(tokens) > sent or finished:
                    yield Step(tokens[sent:], reason, output.error, t)
                sent = len(tokens)
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
            if not finished:
                self.manager.cancel_request(request_id)

    def _dispatch(self) -> None:
        while self._running:
            output = self.manager.get_result(timeout=0.05)
            if output is None:
                if not self.manager.is_running():
                    time.sleep(0.05)
                continue
            with self._lock:
                target = self._queues.get(output.request_id)
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, (output, time.perf_counter()))
