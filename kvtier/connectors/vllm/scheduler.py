"""Scheduler side: ask the workers what kvtier holds, plan loads and saves per step.

Per request (vLLM calls, in this order):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: hash the request's full
   blocks (at most ``(num_tokens - 1) // block_size``: prefill always keeps at least one token)
   and ask every worker for the blocks after the ``num_computed_tokens`` vLLM already holds
   (with their token fingerprints: a block of other tokens is never counted).
   The worker pins them and starts reading any that are on DISK/REMOTE into its CPU pool;
   until that is done the answer is ``None`` and vLLM retries the request next step while it
   serves others. The final answer counts only blocks that arrived and were verified, so a
   corrupt or missing DISK record shortens the hit (those tokens are computed) instead of
   failing a load that vLLM already counted.
2. ``update_state_after_alloc``: the vLLM blocks for those tokens are known: plan a
   :class:`LoadSpec` (or tell the worker to release the match when vLLM took none of it).
3. ``build_connector_meta`` (every step): the loads, plus a :class:`SaveSpec` for every full
   block whose K/V the step computes (prompt and generated tokens alike), once per block.
4. ``request_finished``: forget the request. Saves complete within their step (the worker
   copies during the forward and publishes in ``wait_for_save``), so vLLM may free the blocks
   at once; the per-tier token counts go back in ``kv_transfer_params["kvtier"]``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.connectors.vllm.keys import EngineKey, HashChain, request_chains, request_media
from kvtier.connectors.vllm.lookup import LookupClient
from kvtier.connectors.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec

logger = logging.getLogger(__name__)


@dataclass
class _Match:
    start_block: int
    num_blocks: int
    media: list[str]


@dataclass
class _RequestState:
    request: Any
    chains: list[HashChain]
    saved_blocks: int = 0
    """Leading blocks already planned for saving (each block is saved once)."""
    match: _Match | None = None
    """Answered by the workers, not yet taken by ``update_state_after_alloc``."""
    last_load: list[str] = field(default_factory=list)
    """Media of the blocks of the latest planned load (for hit-source metrics)."""
    loaded_tokens: Counter = field(default_factory=Counter)
    """Tokens planned to load, by medium, over the request's life."""


def cacheable(request: Any) -> bool:
    """Requests whose every input is keyed: token ids, and media items with a vLLM identifier
    (:func:`~kvtier.connectors.vllm.keys.request_media`); prompt embeddings are not keyed."""
    return getattr(request, "prompt_embeds", None) is None and request_media(request) is not None


class SchedulerSide:
    """Scheduler-side state of the connector.

    Args:
        engine_key: the engine's key fields (chain roots per request and rank).
        client: lookups on the workers.
        block_ids_of: ``block_ids_of(req_id)`` -> the request's vLLM block ids (group 0).
        match_wait_s: how long a worker may wait for reads before answering "not yet".
    """

    def __init__(
        self, engine_key: EngineKey, client: LookupClient, block_ids_of: Callable[[str], list[int]], match_wait_s: float
    ) -> None:
        self.engine_key, self.client, self.match_wait_s = engine_key, client, match_wait_s
        self.block_size = engine_key.block_size
        self._block_ids_of = block_ids_of
        self._requests: dict[str, _RequestState] = {}
        self._loads: list[LoadSpec] = []
        self._drops: list[str] = []
        self.matched_tokens: Counter = Counter()
        """Tokens planned to load, by medium, since start (logged at shutdown)."""

    def _state(self, request: Any) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request, request_chains(self.engine_key, request))
        return state

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvtier supplies after vLLM's ``num_computed_tokens`` (block-aligned), and
        ``False`` (the copy into vLLM's cache is synchronous, in the forward); ``(None,
        False)`` while the worker still reads them from DISK/REMOTE."""
        if not cacheable(request):
            return 0, False
        state = self._state(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        start = num_computed_tokens // self.block_size
        if start >= max_blocks:
            self._release_match(state)
            return 0, False
        tokens = request.all_token_ids
        keys = [chain.keys_upto(tokens, max_blocks) for chain in state.chains]
        hashes, fingerprints = [h[start:] for h, _ in keys], [f[start:] for _, f in keys]
        num_blocks, media = self.client.match(request.request_id, hashes, self.match_wait_s, fingerprints)
        if num_blocks is None:
            return None, False
        state.match = _Match(start, num_blocks, media) if num_blocks else None
        return num_blocks * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        match, state.match = state.match, None
        if match is None or num_external_tokens <= 0:
            if match is not None:
                self._drops.append(request.request_id)
            state.last_load = []
            return
        num_blocks = min(num_external_tokens // self.block_size, match.num_blocks)
        block_ids = list(blocks.get_block_ids()[0])
        self._loads.append(LoadSpec(request.request_id, block_ids[match.start_block : match.start_block + num_blocks]))
        state.last_load = match.media[:num_blocks]
        for medium in state.last_load:
            state.loaded_tokens[medium] += self.block_size
            self.matched_tokens[medium] += self.block_size

    def hit_sources(self, request: Any, num_external_tokens: int) -> Counter:
        """Tokens of the latest load of ``request`` by medium (sums to ``num_external_tokens``
        when the plan matches vLLM's count)."""
        state = self._requests.get(request.request_id)
        counts: Counter = Counter()
        for medium in (state.last_load if state is not None else []):
            counts[medium] += self.block_size
        return counts

    def build_meta(self, scheduler_output: Any) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._loads, drops=self._drops)
        self._loads, self._drops = [], []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_save(meta, new.req_id, new.num_computed_tokens + num_scheduled.get(new.req_id, 0))
            meta.prefill_tokens += self._prefill_tokens(new.req_id, new.num_computed_tokens, num_scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_save(meta, req_id, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0))
            meta.prefill_tokens += self._prefill_tokens(req_id, cached.num_computed_tokens[i], num_scheduled)
        return meta

    def _prefill_tokens(self, req_id: str, num_computed: int, num_scheduled: dict) -> int:
        """Prompt tokens of ``req_id`` this step computes (0 for decodes)."""
        state = self._requests.get(req_id)
        if state is None:
            return 0
        return max(0, min(num_scheduled.get(req_id, 0), state.request.num_prompt_tokens - num_computed))

    def _plan_save(self, meta: KVTierMetadata, req_id: str, num_computed_after: int) -> None:
        """Save the blocks that become full this step (their tokens all known: speculative
        tokens that may be rejected are not in ``all_token_ids``)."""
        state = self._requests.get(req_id)
        if state is None or not cacheable(state.request):
            return
        tokens = state.request.all_token_ids
        block_ids = self._block_ids_of(req_id)
        full = min(num_computed_after, len(tokens)) // self.block_size
        full = min(full, len(block_ids))
        if full <= state.saved_blocks:
            return
        keys = [chain.keys_upto(tokens, full) for chain in state.chains]
        hashes = [h[state.saved_blocks :] for h, _ in keys]
        fingerprints = [f[state.saved_blocks :] for _, f in keys]
        meta.saves.append(SaveSpec(req_id, hashes, list(block_ids[state.saved_blocks : full]), fingerprints))
        state.saved_blocks = full

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """Forget ``request``; returns ``{"kvtier": {"loaded_tokens": {medium: tokens},
        "saved_blocks": n}}`` for its output's ``kv_transfer_params``."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return None
        self._release_match(state)
        return {"kvtier": {"loaded_tokens": dict(state.loaded_tokens), "saved_blocks": state.saved_blocks}}

    def _release_match(self, state: _RequestState) -> None:
        if state.match is not None:
            state.match = None
            self._drops.append(state.request.request_id)
