"""kvtier under transformers' continuous batching (``ContinuousBatchingManager``).

    connector = HFPagedConnector.from_model(model, StoreConfig.from_env(), model_id="...")
    manager = connector.init_continuous_batching(generation_config, cb_config)  # or connector.attach(manager)
    manager.start(); manager.add_request(input_ids, max_new_tokens=32); ...; manager.stop()
    connector.close()                      # flushes kvtier's memory tiers to DISK

Request flow (hooks on the manager, its paged cache and its scheduler; see :mod:`.hooks`):

1. ``manager.add_request`` (any thread): hash the prompt's full blocks and start the prefetch
   (:mod:`.tickets`): DISK and REMOTE reads run while the engine computes other requests.
2. The scheduler's waiting list holds the request back while its load is in flight, up to
   ``load_deadline_s`` (then it is admitted without it and computes those tokens).
3. Admission (``cache.search_prefix_match``, generation thread): transformers matches its own
   cached prefix first; kvtier takes the chain from there: it gives the request paged blocks
   for the loaded tokens, copies the blocks from kvtier's top pool into them
   (``gather_blocks_to_paged`` through strided views, :mod:`.layout`) and registers the full
   paged blocks with transformers' block sharing, so every later request shares them. The
   reported prefix is transformers' plus kvtier's; at least one prompt token is always left to
   compute. Anything that fails here falls back to transformers' own prefix (never to unset K/V).
4. After every forward (``cache.mark_complete_blocks``): the request's newly computed full
   blocks are stored in kvtier (the last sampled token has no K/V yet and is never stored), so
   a block transformers later evicts from its cache is still a hit.

Threads: 1 runs on the caller's thread, 2-4 on transformers' generation thread, the loads on
the connector's prefetch threads and the store's I/O threads. Batch size, mixed prefill and
decode steps and chunked prefill are transformers' own; the connector sees one request at a
time. Block sharing must be allowed.

Which models: :func:`.models.check_model` (full attention in every layer; others refused).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvtier.config import StoreConfig
from kvtier.connectors.hf import check_store_matches, token_list, weights_fingerprint
from kvtier.connectors.hf_cache import UnsupportedModelError
from kvtier.connectors.hf_paged.admissions import PAGED, Admission, Admissions
from kvtier.connectors.hf_paged.compat import check_transformers
from kvtier.connectors.hf_paged.hooks import Hooks
from kvtier.connectors.hf_paged.layout import PagedLayout, make_layout
from kvtier.connectors.hf_paged.models import check_model
from kvtier.connectors.hf_paged.tickets import Tickets
from kvtier.hashing import KeyContext, block_keys_for, key_block_tokens
from kvtier.kernels import gather_blocks_to_paged, scatter_paged_to_blocks
from kvtier.model_keys import kv_config_bytes, kv_config_fields
from kvtier.store import LoadResult, TieredStore
from kvtier.types import BlockHash, Fingerprint, dtype_name

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Progress:
    """A running request's kvtier chain: hashes and token fingerprints of its full blocks so
    far, blocks stored."""

    hashes: list[BlockHash] = field(default_factory=list)
    fingerprints: list[Fingerprint] = field(default_factory=list)
    stored: int = 0


class HFPagedConnector:
    """Connects a :class:`TieredStore` to transformers' continuous batching.

    Args:
        model: a decoder-only full-attention transformers model (the Llama family and alike).
        store: its spec must match the model's K/V shape and dtype.
        key_context: the namespace's fields; its block_size is the store's.
        load_deadline_s: how long the scheduler holds a request back while its kvtier load is
            in flight; later, it computes those tokens instead.

    Raises:
        UnsupportedTransformersError: transformers outside the supported range (:mod:`.compat`).
        UnsupportedModelError: a model the connector cannot serve exactly (:func:`check_model`).
        ValueError: a spec, layout, namespace or ``load_deadline_s`` that does not fit.
    """

    def __init__(self, model: torch.nn.Module, store: TieredStore, key_context: KeyContext,
                 load_deadline_s: float = 2.0) -> None:
        self.generation = check_transformers()
        spec = check_model(model, store.spec.block_size)
        check_store_matches(spec, store, key_context)
        if not 0 <= load_deadline_s < float("inf"):
            raise ValueError(f"expected load_deadline_s >= 0 seconds, got {load_deadline_s!r}")
        self.model, self.store, self.key_context = model, store, key_context
        self.block_size = spec.block_size
        self.admissions = Admissions()
        self.tickets = Tickets(store, load_deadline_s, self._wake)
        self._hooks = Hooks()
        self._manager: Any = None
        self._layout: PagedLayout | None = None
        self._compute_stream: Any = None
        self._async = False
        self._progress: dict[str, _Progress] = {}
        self._ids = itertools.count()

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, config: StoreConfig | None = None, *, model_id: str | None = None,
        model_revision: str | None = None, cache_salt: str | None = None, load_deadline_s: float = 2.0,
    ) -> "HFPagedConnector":
        """Build the key context and the store (top pool on the model's device) for ``model``:
        the same namespace as :meth:`kvtier.connectors.hf.HFConnector.from_model` with the same
        arguments and ``head_major=False`` (the token-major layout of the paged cache, and of
        this connector's kernels; ``HFConnector``'s default head-major layout is another
        namespace), so blocks stored by either connector are hits for the other.
        ``model_revision`` defaults to :func:`~kvtier.connectors.hf.weights_fingerprint`."""
        check_transformers()
        config = config or StoreConfig.from_env()
        spec = check_model(model, config.block_size)
        key_context = KeyContext(
            model_id=model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__,
            model_revision=model_revision or weights_fingerprint(model), dtype=dtype_name(spec.dtype),
            kv_layout=spec.layout_name, block_size=config.block_size, cache_salt=cache_salt, hash_name=config.hash_name,
            kv_config=kv_config_bytes(kv_config_fields(model.config, kv_cache_dtype=dtype_name(spec.dtype))),
        )
        store = TieredStore(spec, config, key_context.namespace(), device=model.device)
        try:
            return cls(model, store, key_context, load_deadline_s)
        except BaseException:
            store.close()
            raise

    # -- attaching ---------------------------------------------------------------------------
    def init_continuous_batching(self, generation_config: Any = None, continuous_batching_config: Any = None,
                                 **kwargs: Any) -> Any:
        """``model.init_continuous_batching(...)`` with this connector attached."""
        manager = self.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=continuous_batching_config, **kwargs
        )
        self.attach(manager)
        return manager

    def attach(self, manager: Any) -> None:
        """Hook ``manager`` (a ``ContinuousBatchingManager`` of this connector's model).

        Raises:
            ValueError: another manager is attached, the manager is another model's, block
                sharing is off, or the page size is not a multiple of ``block_size``.
        """
        if self._manager is not None:
            raise ValueError("expected a connector without a manager; detach() the current one first")
        if manager.model is not self.model:
            raise ValueError("expected a manager of the connector's model")
        cfg = manager.continuous_batching_config
        if not cfg.allow_block_sharing:
            raise ValueError("expected ContinuousBatchingConfig(allow_block_sharing=True): kvtier's hits are shared blocks")
        page_size = page_size_of(cfg)
        if page_size % self.block_size:
            raise ValueError(f"expected a page size that is a multiple of block_size {self.block_size}, got {page_size}")
        self._manager = manager
        self._hooks.wrap(manager, "add_request", self._add_request)
        self._hooks.on_batch_processors(manager, self._install)

    def detach(self) -> None:
        """Remove every hook (the manager goes on without kvtier). Idempotent."""
        self._hooks.restore()
        self._manager, self._layout = None, None
        self._progress.clear()

    def close(self) -> None:
        """Detach, abandon pending loads, close the store (flushes memory tiers to DISK)."""
        self.detach()
        self.tickets.close()
        self.store.close()

    def _install(self, processor: Any) -> None:
        cache, scheduler = processor.cache, processor.scheduler
        if not cache.use_prefix_sharing:
            raise UnsupportedModelError("transformers turned prefix sharing off for this model's cache")
        self._layout = make_layout(cache, self.block_size)
        self._compute_stream = getattr(processor.inputs_and_outputs, "compute_stream", None)
        self._async = bool(getattr(processor, "use_async_batching", False))
        complete = "mark_shareable_blocks_as_complete" if self.generation == "block_manager" else "mark_complete_blocks"
        self._hooks.wrap(cache, "search_prefix_match", self._admit)
        self._hooks.wrap(cache, complete, self._after_forward)
        self._hooks.wrap(cache, "free_blocks", self._free)
        self._hooks.wrap(scheduler, "_get_waiting_candidates", self._waiting_candidates)
        self._hooks.wrap(scheduler, "add_waiting_request", self._add_waiting_request)

    # -- 1, 2: prefetch when a request arrives, hold it back while the load is in flight ------
    def _add_request(self, original: Any, input_ids: Sequence[int], request_id: str | None = None,
                     *args: Any, **kwargs: Any) -> Any:
        tokens = _token_ids(input_ids)  # before anything is started for the request
        if request_id is None:
            request_id = f"kvtier-{next(self._ids)}"
        self.tickets.start(request_id, *self.prompt_keys(tokens))
        added = original(tokens, request_id, *args, **kwargs)
        if added is None:  # refused (stopping, or not the TP driver)
            self.tickets.cancel(request_id)
        return added

    def _add_waiting_request(self, original: Any, state: Any) -> Any:
        """A request that reaches the waiting list without a ticket (a soft-reset one comes
        back with its output in its prompt) starts its prefetch here."""
        if not getattr(state, "is_cpu_offloaded", False) and not self.tickets.has(state.request_id):
            self.tickets.start(state.request_id, *self.prompt_keys(state.initial_tokens))
        return original(state)

    def _waiting_candidates(self, original: Any) -> list[Any]:
        return [state for state in original() if self.tickets.ready(state.request_id)]

    def _wake(self) -> None:
        manager = self._manager
        event = getattr(manager, "_wake_up_loop", None) or getattr(manager, "_has_new_requests", None)
        if event is not None:
            event.set()

    def prompt_keys(self, tokens: Sequence[int]) -> tuple[list[BlockHash], list[Fingerprint]]:
        """Hashes and token fingerprints (:func:`kvtier.hashing.block_keys_for`) of the
        prompt's blocks a hit may cover: ``(len - 1) // block_size`` of them (at least one
        token is always left to compute, case B1). A load serves only blocks of these tokens."""
        usable = max(0, (len(tokens) - 1) // self.block_size) * self.block_size
        return block_keys_for(tokens[:usable], self.store.namespace, self.block_size, self.key_context.hash_name)

    def prompt_hashes(self, tokens: Sequence[int]) -> list[BlockHash]:
        """The hashes of :meth:`prompt_keys`."""
        return self.prompt_keys(tokens)[0]

    # -- 3: admission ------------------------------------------------------------------------
    def _admit(self, original: Any, request_id: str, prompt_ids: list[int]) -> int:
        matched = original(request_id, prompt_ids)
        ticket = self.tickets.pop(request_id)
        result = ticket.take() if ticket is not None else None
        late = ticket is not None and result is None and not ticket.future.done()
        sources: dict[str, int] = {PAGED: matched} if matched else {}
        total = matched
        try:
            if result is not None:
                hashes, fingerprints = self.prompt_keys(prompt_ids)
                valid = _common_prefix(list(zip(ticket.block_hashes, ticket.fingerprints)),
                                       list(zip(hashes, fingerprints)))
                total = self._load_rest(request_id, prompt_ids, matched, result, valid, sources)
        except Exception:
            self.admissions.stats.errors += 1
            logger.exception("kvtier load into the paged cache failed for %s; computing instead", request_id)
            total = matched
            sources = {PAGED: matched} if matched else {}
        finally:
            if result is not None:
                result.lease.release()
        self.admissions.record(Admission(request_id, len(prompt_ids), sources, late))
        self.store.record_computed_tokens(len(prompt_ids) - total)
        return total

    def _load_rest(self, request_id: str, prompt_ids: list[int], matched: int, result: LoadResult, valid: int,
                   sources: dict[str, int]) -> int:
        """Load kvtier blocks ``matched // block_size ..`` into new paged blocks; returns the
        prefix now cached (transformers' part included)."""
        layout, bs = self._layout, self.block_size
        start = matched // bs
        end = min(len(result.block_ids), valid)
        if not layout.partial_blocks:
            end -= end % layout.ratio
        if end <= start:
            return matched
        table_before = len(layout.block_table(request_id) or ())
        got = layout.append(request_id, matched, (end - start) * bs)
        end = start + got // bs
        if not layout.partial_blocks:
            end -= end % layout.ratio
        if end <= start:
            layout.truncate(request_id, table_before)
            return matched
        try:
            self._copy_in(request_id, result.block_ids, start, end)
        except BaseException:
            layout.truncate(request_id, table_before)
            raise
        layout.truncate(request_id, -(-end * bs // layout.page_size))  # blocks append() gave beyond `end`
        layout.register(request_id, prompt_ids, end * bs // layout.page_size - matched // layout.page_size)
        for medium in result.sources[start:end]:
            sources[str(medium)] = sources.get(str(medium), 0) + bs
        return end * bs

    def _copy_in(self, request_id: str, pool_ids: list[int], start: int, end: int) -> None:
        """Copy kvtier blocks ``start..end-1`` of the request from the top pool into its paged blocks."""
        pool = self.store.top.tensor
        with torch.no_grad(), self._stream():
            for k, (src, dst) in self._by_offset(request_id, range(start, end), pool_ids).items():
                keys, values = self._layout.views(k)
                gather_blocks_to_paged(pool, _ids(src, pool), keys, values, _ids(dst, pool), check_ids=False)

    def _by_offset(self, request_id: str, blocks: Sequence[int], pool_ids: Sequence[int]) -> dict[int, tuple[list, list]]:
        """Request blocks grouped by their offset ``k`` in their paged block: ``k -> (pool
        ids, view ids)``; ``pool_ids`` is indexed by request block."""
        layout = self._layout
        table = layout.block_table(request_id)
        groups: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
        for j in blocks:
            k = j % layout.ratio
            groups[k][0].append(pool_ids[j])
            groups[k][1].append(layout.view_id(table[j // layout.ratio], k))
        return groups

    # -- 4: store what each forward computed -------------------------------------------------
    def _after_forward(self, original: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(state, *args, **kwargs)
        try:
            self._store_progress(state)
        except Exception:
            self.admissions.stats.errors += 1
            logger.exception("kvtier store from the paged cache failed for %s", state.request_id)
        return out

    def _store_progress(self, state: Any) -> None:
        layout = self._layout
        if layout is None:
            return
        table = layout.block_table(state.request_id)
        if not table:
            return
        # Tokens whose K/V are in the cache: in sync mode every processed token; with async
        # batching the next batch is already in flight, so only the paged blocks transformers
        # marked complete.
        computed = layout.complete_blocks(state.request_id) * layout.page_size if self._async else state.position_offset
        num_blocks = min(computed // self.block_size, len(table) * layout.ratio)
        progress = self._progress.setdefault(state.request_id, _Progress())
        if num_blocks <= progress.stored:
            return
        tokens = state.initial_tokens + state.generated_tokens
        num_blocks = min(num_blocks, len(tokens) // self.block_size)
        self._extend_hashes(progress, tokens, num_blocks)
        pool = self.store.top.tensor

        def write(indices: list[int], block_ids: list[int]) -> None:
            slot_of = dict(zip(indices, block_ids))
            with self._stream():
                for k, (dst, src) in self._by_offset(state.request_id, indices, slot_of).items():
                    keys, values = layout.views(k)
                    scatter_paged_to_blocks(keys, values, _ids(src, pool), pool, _ids(dst, pool), check_ids=False)

        with torch.no_grad():
            self.store.store_with(progress.hashes[:num_blocks], write, fingerprints=progress.fingerprints[:num_blocks])
        self.admissions.stats.stored_blocks += num_blocks - progress.stored
        progress.stored = num_blocks

    def _extend_hashes(self, progress: _Progress, tokens: list[int], num_blocks: int) -> None:
        parent = progress.hashes[-1] if progress.hashes else self.store.namespace
        parent_fp = progress.fingerprints[-1] if progress.fingerprints else self.store.namespace
        bs, hash_name = self.block_size, self.key_context.hash_name
        for i in range(len(progress.hashes), num_blocks):
            parent, parent_fp = key_block_tokens(parent, parent_fp, tokens[i * bs : (i + 1) * bs], b"", hash_name)
            progress.hashes.append(parent)
            progress.fingerprints.append(parent_fp)

    def _free(self, original: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        self._progress.pop(request_id, None)
        self.tickets.cancel(request_id)
        return original(request_id, *args, **kwargs)

    def _stream(self) -> Any:
        if self._compute_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._compute_stream)


def page_size_of(cb_config: Any) -> int:
    """Tokens per paged block of a (resolved) ``ContinuousBatchingConfig``: ``page_size``
    (transformers >= 5.18), ``block_size`` (5.17)."""
    size = getattr(cb_config, "page_size", None)
    return int(size if size is not None else cb_config.block_size)


def _ids(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _token_ids(input_ids: Any) -> list[int]:
    """``add_request``'s prompt as a list of ints (:func:`kvtier.connectors.hf.token_list`'s
    checks): one prompt, a sequence of ints or a 1-D tensor or array, as transformers'
    ``ContinuousBatchingManager.add_request`` takes (``list[int]``).

    Raises:
        ValueError: anything else, e.g. the ``[1, seq_len]`` batch that ``model.generate``
            takes (a newcomer's first try, 2026-12-03: it failed inside a list comprehension),
            or an empty prompt or a negative id.
    """
    shape = getattr(input_ids, "shape", None)
    if shape is not None and len(shape) != 1:
        raise ValueError(f"expected input_ids as one prompt's token ids (a list of ints or a 1-D tensor), got "
                         f"shape {list(shape)}: pass input_ids[0] for a [1, seq_len] batch")
    tokens = token_list(input_ids)
    if not tokens or min(tokens) < 0:  # (a prompt shorter than a block is never hashed, so checked here)
        raise ValueError("expected input_ids as a non-empty list of non-negative token ids")
    return tokens
