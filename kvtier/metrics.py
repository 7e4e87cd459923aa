"""Prometheus metrics of :class:`~kvtier.store.TieredStore`, read from its counters at scrape time.

Source of truth: ``store.stats`` (:class:`~kvtier.store.StoreStats`, event counters, each
event counted once: case M1) and ``store.usage()`` (occupancy). A custom collector copies them
when Prometheus (or the daemon's ``/metrics``, or ``/v1/stats``) asks, so counting costs the
inference loop nothing and nothing is counted twice. The only hot-path work is the latency
hook (``store.observe``), one histogram observation per ``lookup``, ``load`` and ``store``.

Usage from a library (an engine mounts the registry, or serves a port)::

    from kvtier import metrics
    metrics.register(store)                    # default registry; or registry=my_registry
    metrics.start_http_server(9400)            # or mount prometheus_client.make_asgi_app()

Names (Prometheus conventions: ``kvtier_`` prefix, unit in the name, ``_total`` for counters,
counters rather than rates); every series has a ``namespace`` label (the store's name: its
``store.name``, the model id a connector sets, else the first 16 hex digits of its 32-byte
namespace). Tokens are ``blocks * block_size`` (full blocks only: a partial tail block is
never cached), except ``kvtier_miss_tokens_total``'s ``partial_tail``.

==============================================  =================  ==============================
metric                                          labels             meaning
==============================================  =================  ==============================
kvtier_lookup_{blocks,tokens}_total                                queried (prefix lookups and
                                                                   prefetches; a retried request
                                                                   with a request_id counts once)
kvtier_remote_lookup_{blocks,tokens}_total                         asked of the REMOTE tier after
                                                                   the local tiers missed
kvtier_hit_{blocks,tokens}_total                tier               hits, by the tier that had them
kvtier_loaded_{blocks,tokens}_total             tier               loaded into the top pool, by
                                                                   source tier (served from cache)
kvtier_stored_{blocks,tokens}_total             tier               newly stored (top pool; REMOTE)
kvtier_evicted_blocks_total                     tier               copies dropped to make room
kvtier_spilled_blocks_total                     src, dst           copied one tier down (write-back
                                                                   victims, write-through copies)
kvtier_load_failures_total                      tier, reason       blocks whose load failed
                                                                   (missing, corrupt, timeout, ...)
kvtier_miss_tokens_total                        reason, tier       prompt tokens not served, by
                                                                   why (kvtier.store.misses; tier
                                                                   "" where none applies)
kvtier_store_failures_total                     reason             background writes that failed
kvtier_remote_errors_total                      reason             REMOTE backend errors
kvtier_moved_bytes_total                        src, dst           block bytes moved per path
kvtier_engine_computed_tokens_total,                               prompt tokens prefilled, TTFT
kvtier_ttft_saved_seconds_total,                                   saved and lost to loads slower
kvtier_ttft_lost_seconds_total                                     than a prefill (when a connector
                                                                   counts them: kvtier.connectors.ttft)
kvtier_used_blocks / _used_bytes / _capacity_bytes  tier           occupancy gauges
kvtier_block_size_tokens, kvtier_block_bytes                       the block's size
kvtier_operation_duration_seconds (histogram)   op                 lookup, load, store latency
==============================================  =================  ==============================

Paths of ``kvtier_moved_bytes_total`` (bytes = blocks * block bytes, record headers excluded):
``engine -> top`` (stores), ``top -> REMOTE`` (REMOTE puts), ``tier -> tier below`` (spills),
``source -> top`` (loads; a DISK block staged through the CPU slab on its way to the GPU is
counted once, as DISK -> GPU).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Mapping
from weakref import WeakKeyDictionary

from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.records import ReadStatus
from kvtier.store.misses import NEVER_STORED, OTHER_NAMESPACE, PARTIAL_TAIL

if TYPE_CHECKING:
    from kvtier.store import TieredStore

__all__ = [
    "ENGINE", "LATENCY_BUCKETS_S", "OPS", "KvtierMetrics", "StoreFigures", "figures", "register",
    "start_http_server", "store_name", "unregister",
]

ENGINE = "engine"
"""Source label of stores: the inference engine's own KV cache."""
OPS = ("lookup", "load", "store")
"""The operations ``store.observe`` reports."""
LATENCY_BUCKETS_S = (2.5e-5, 1e-4, 2.5e-4, 1e-3, 2.5e-3, 0.01, 0.025, 0.1, 0.25, 1.0, 2.5, 10.0)
"""Seconds: a lookup of a few blocks takes ~10 us, a load of a long prefix from DISK ~1 s.
Few buckets on purpose: every bucket is a series per namespace and operation, and rendering
series is most of a scrape's cost."""
LOAD_FAILURE_REASONS = tuple(s.value for s in ReadStatus if s is not ReadStatus.OK)
"""Reasons exported with 0 before the first failure, so that ``rate()`` works from the start."""


# -- figures: one consistent copy of a store's counters -----------------------------------------
@dataclass
class StoreFigures:
    """A copy of one store's counters and occupancy, in blocks; tiers by name (``"GPU"``).

    Attributes:
        block_size: tokens per block.
        block_nbytes: bytes of one block (payload).
        tiers: the store's tiers, top first (``"GPU"``, ``"CPU"``, ``"DISK"``, ``"REMOTE"``).
        spilled_blocks: by ``(src, dst)``.
        load_failures: by ``(tier, reason)``; tier ``""`` where the store does not say.
        moved_blocks: by ``(src, dst)``: stores, REMOTE puts, spills and loads (see module doc).
        usage: ``store.usage()``: per tier ``blocks``, ``used_bytes``, ``capacity_bytes``.
        remote_errors: the REMOTE backend's ``errors`` by reason (empty without one).
        miss_tokens: tokens not served by ``(reason, tier)`` (kvtier.store.misses).
        engine_computed_tokens, ttft_saved_s: prompt tokens the engine prefilled itself and the
            prefill seconds the cache saved, when the store's stats carry them (fields
            ``computed_tokens`` and ``ttft_saved_s``, counted by a connector); else ``None``.
        ttft_lost_s: seconds loads took beyond what recomputing would have (0 until counted).
        name: the store's display name (``store.name``), or ``None``.
    """

    block_size: int
    block_nbytes: int
    tiers: list[str]
    lookup_blocks: int = 0
    remote_lookup_blocks: int = 0
    hit_blocks: dict[str, int] = field(default_factory=dict)
    loaded_blocks: dict[str, int] = field(default_factory=dict)
    stored_blocks: dict[str, int] = field(default_factory=dict)
    evicted_blocks: dict[str, int] = field(default_factory=dict)
    spilled_blocks: dict[tuple[str, str], int] = field(default_factory=dict)
    load_failures: dict[tuple[str, str], int] = field(default_factory=dict)
    store_failures: dict[str, int] = field(default_factory=dict)
    moved_blocks: dict[tuple[str, str], int] = field(default_factory=dict)
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    remote_errors: dict[str, int] = field(default_factory=dict)
    miss_tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    engine_computed_tokens: int | None = None
    ttft_saved_s: float | None = None
    ttft_lost_s: float = 0.0
    name: str | None = None


def _copy(counter: Mapping) -> dict:
    """``dict(counter)`` while another thread may add keys (the store's lock is not taken:
    a scrape must never wait behind a long DISK spill)."""
    for _ in range(8):
        try:
            return dict(counter)
        except RuntimeError:  # changed size during the copy: try again
            continue
    return dict(list(counter.items()))


def _by_tier(counter: Mapping) -> dict[str, int]:
    return {str(k): int(v) for k, v in _copy(counter).items()}


def figures(store: "TieredStore") -> StoreFigures:
    """Copy ``store.stats`` and ``store.usage()`` and derive the per-path figures."""
    stats = store.stats
    pools = [str(p.medium) for p in store.pools]
    local = pools + (["DISK"] if store.disk is not None else [])
    remote = getattr(store, "remote", None)
    tiers = local + (["REMOTE"] if remote is not None else [])
    top = pools[0]
    f = StoreFigures(store.spec.block_size, store.spec.block_nbytes, tiers)
    f.lookup_blocks = int(stats.lookup_blocks)
    f.remote_lookup_blocks = int(getattr(stats, "remote_lookup_blocks", 0))
    f.hit_blocks = _by_tier(stats.hit_blocks)
    f.loaded_blocks = _by_tier(stats.loaded_blocks)
    f.stored_blocks = _by_tier(stats.stored_blocks)
    f.evicted_blocks = _by_tier(stats.evicted_blocks)
    f.store_failures = _by_tier(stats.store_failures)
    f.miss_tokens = {(str(r), str(t)): int(n) for (r, t), n in _copy(getattr(stats, "miss_tokens", {})).items()}
    by_tier = getattr(stats, "load_failures_by_tier", None)
    for key, n in _copy(by_tier or stats.load_failures).items():
        tier, reason = (str(key[0]), str(key[1])) if isinstance(key, tuple) else ("", str(key))
        f.load_failures[(tier, reason)] = f.load_failures.get((tier, reason), 0) + int(n)
    # Every path this store can take, at 0 until used (so that rate() works from the start).
    f.spilled_blocks = {(src, dst): 0 for src, dst in zip(local, local[1:])}
    for dst, n in _by_tier(stats.spilled_blocks).items():
        # A block goes one local tier down; REMOTE copies come from the top pool.
        src = top if dst == "REMOTE" or dst not in local else local[max(local.index(dst) - 1, 0)]
        f.spilled_blocks[(src, dst)] = n
    moved: Counter = Counter({(ENGINE, top): 0, **{(t, top): 0 for t in tiers[1:]}})
    if remote is not None:
        moved[(top, "REMOTE")] = 0
    for tier, n in f.stored_blocks.items():
        moved[(ENGINE, tier) if tier == top else (top, tier)] += n
    moved.update(f.spilled_blocks)
    for src, n in f.loaded_blocks.items():
        if src != top:
            moved[(src, top)] += n
    f.moved_blocks = dict(moved)
    f.usage = store.usage()
    computed, saved = getattr(stats, "computed_tokens", None), getattr(stats, "ttft_saved_s", None)
    f.engine_computed_tokens = None if computed is None else int(computed)
    f.ttft_saved_s = None if saved is None else float(saved)
    f.ttft_lost_s = float(getattr(stats, "ttft_lost_s", 0.0))
    f.name = getattr(store, "name", None)
    if remote is not None:
        f.remote_errors = _by_tier(getattr(remote, "errors", {}))
    return f


def store_name(store: "TieredStore") -> str:
    """Default ``namespace`` label: ``store.name`` (a connector sets the model id) when set,
    else the first 16 hex digits of the store's namespace."""
    return getattr(store, "name", None) or store.namespace.hex()[:16]


# -- the collector --------------------------------------------------------------------------------
class _Families:
    """Builds each metric family once per scrape, adding one sample per store."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}

    def counter(self, name: str, doc: str, labels: tuple[str, ...], values: tuple[str, ...], value: float) -> None:
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = CounterMetricFamily(name, doc, labels=["namespace", *labels])
        family.add_metric(list(values), value)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...], values: tuple[str, ...], value: float) -> None:
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = GaugeMetricFamily(name, doc, labels=["namespace", *labels])
        family.add_metric(list(values), value)


def _add_store(out: _Families, name: str, f: StoreFigures) -> None:
    """One store's samples (``name`` is its ``namespace`` label)."""
    bs, c, g = f.block_size, out.counter, out.gauge
    c("kvtier_lookup_blocks", "Blocks queried by lookups and prefetches.", (), (name,), f.lookup_blocks)
    c("kvtier_lookup_tokens", "Tokens queried (blocks * block_size).", (), (name,), f.lookup_blocks * bs)
    c("kvtier_remote_lookup_blocks", "Blocks asked of the REMOTE tier after the local tiers missed.", (), (name,),
      f.remote_lookup_blocks)
    c("kvtier_remote_lookup_tokens", "Tokens asked of the REMOTE tier.", (), (name,), f.remote_lookup_blocks * bs)
    for tier in f.tiers:
        hit, loaded, stored = f.hit_blocks.get(tier, 0), f.loaded_blocks.get(tier, 0), f.stored_blocks.get(tier, 0)
        c("kvtier_hit_blocks", "Blocks found by lookups, by the tier holding them.", ("tier",), (name, tier), hit)
        c("kvtier_hit_tokens", "Tokens found by lookups, by tier.", ("tier",), (name, tier), hit * bs)
        c("kvtier_loaded_blocks", "Blocks loaded into the top pool, by source tier.", ("tier",), (name, tier), loaded)
        c("kvtier_loaded_tokens", "Tokens served from the cache, by source tier.", ("tier",), (name, tier), loaded * bs)
        c("kvtier_stored_blocks", "Blocks newly stored, by tier.", ("tier",), (name, tier), stored)
        c("kvtier_stored_tokens", "Tokens newly stored, by tier.", ("tier",), (name, tier), stored * bs)
        c("kvtier_evicted_blocks", "Copies of blocks dropped to make room, by tier.", ("tier",), (name, tier),
          f.evicted_blocks.get(tier, 0))
    for (src, dst), n in f.spilled_blocks.items():
        c("kvtier_spilled_blocks", "Blocks copied one tier down.", ("src", "dst"), (name, src, dst), n)
    # Zeros for the usual reasons, so that rate() works before the first failure.
    if any(tier for tier, _ in f.load_failures):
        failures = {(t, r): 0 for t in f.tiers[1:] for r in LOAD_FAILURE_REASONS}
    else:  # a store that counts failures by reason only
        failures = {("", r): 0 for r in LOAD_FAILURE_REASONS}
    failures.update(f.load_failures)
    for (tier, reason), n in failures.items():
        c("kvtier_load_failures", "Blocks whose load failed (a miss, recomputed), by tier and reason.",
          ("tier", "reason"), (name, tier, reason), n)
    for (reason, tier), n in {**{(r, ""): 0 for r in (NEVER_STORED, OTHER_NAMESPACE, PARTIAL_TAIL)},
                              **f.miss_tokens}.items():
        c("kvtier_miss_tokens", "Prompt tokens not served from the cache, by reason and tier.", ("reason", "tier"),
          (name, reason, tier), n)
    for reason, n in f.store_failures.items():
        c("kvtier_store_failures", "Blocks whose background write failed, by reason.", ("reason",), (name, reason), n)
    for reason, n in f.remote_errors.items():
        c("kvtier_remote_errors", "REMOTE backend errors, by reason.", ("reason",), (name, reason), n)
    for (src, dst), n in f.moved_blocks.items():
        c("kvtier_moved_bytes", "Block bytes moved, by source and destination.", ("src", "dst"), (name, src, dst),
          n * f.block_nbytes)
    for tier, u in f.usage.items():
        g("kvtier_used_blocks", "Blocks held, by tier.", ("tier",), (name, tier), u["blocks"])
        g("kvtier_used_bytes", "Bytes used, by tier (DISK: page-rounded records).", ("tier",), (name, tier),
          u["used_bytes"])
        g("kvtier_capacity_bytes", "Capacity, by tier.", ("tier",), (name, tier), u["capacity_bytes"])
    if f.engine_computed_tokens is not None:
        c("kvtier_engine_computed_tokens", "Prompt tokens the engine prefilled itself (cache misses, counted by "
          "the connector).", (), (name,), f.engine_computed_tokens)
    if f.ttft_saved_s is not None:
        c("kvtier_ttft_saved_seconds", "Prefill time the cache saved (estimated by the connector).", (), (name,),
          f.ttft_saved_s)
        c("kvtier_ttft_lost_seconds", "Load time beyond what recomputing would have taken (by the connector).", (),
          (name,), f.ttft_lost_s)
    g("kvtier_block_size_tokens", "Tokens per block.", (), (name,), f.block_size)
    g("kvtier_block_bytes", "Bytes of one block.", (), (name,), f.block_nbytes)


_DESCRIBED = (
    [(n, CounterMetricFamily) for n in (
        "kvtier_lookup_blocks", "kvtier_lookup_tokens", "kvtier_remote_lookup_blocks", "kvtier_remote_lookup_tokens",
        "kvtier_hit_blocks", "kvtier_hit_tokens", "kvtier_loaded_blocks", "kvtier_loaded_tokens",
        "kvtier_stored_blocks", "kvtier_stored_tokens", "kvtier_evicted_blocks", "kvtier_spilled_blocks",
        "kvtier_load_failures", "kvtier_store_failures", "kvtier_remote_errors", "kvtier_moved_bytes",
        "kvtier_engine_computed_tokens", "kvtier_ttft_saved_seconds", "kvtier_ttft_lost_seconds",
        "kvtier_miss_tokens")]
    + [(n, GaugeMetricFamily) for n in (
        "kvtier_used_blocks", "kvtier_used_bytes", "kvtier_capacity_bytes", "kvtier_block_size_tokens",
        "kvtier_block_bytes")]
)


class _StoreCollector(Collector):
    def __init__(self, metrics: "KvtierMetrics") -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        """Names only (lets the registry refuse a second kvtier collector, not scrape)."""
        for name, kind in _DESCRIBED:
            yield kind(name, "", labels=[])

    def collect(self) -> Iterator[Metric]:
        out = _Families()
        for name, store in sorted(self._metrics.stores().items()):
            _add_store(out, name, figures(store))
        yield from out.families.values()


# -- latency ------------------------------------------------------------------------------------
class _LatencyHook:
    """``store.observe``: one histogram observation per operation (children resolved once)."""

    __slots__ = ("owner", "name", "children", "previous")

    def __init__(
        self, owner: "KvtierMetrics", name: str, previous: Callable[[str, float], None] | None
    ) -> None:
        self.owner, self.name = owner, name
        self.children = {op: owner.latency.labels(name, op) for op in OPS}
        self.previous = previous

    def __call__(self, op: str, seconds: float) -> None:
        child = self.children.get(op)
        if child is not None:
            child.observe(seconds)
        if self.previous is not None:
            self.previous(op, seconds)


# -- the public object ----------------------------------------------------------------------------
class KvtierMetrics:
    """Every kvtier metric of one Prometheus registry: the counters and gauges of a set of
    stores (read at scrape time) and their latency histogram.

    Args:
        registry: where the metrics go; default ``prometheus_client.REGISTRY``.
        stores: optional ``stores() -> {name: TieredStore}`` read at every scrape (the
            daemon's namespace registry), in addition to stores added with :meth:`add`.
            Stores it returns get the latency hook at their first scrape (or
            :meth:`instrument`).

    Raises:
        ValueError: the registry already holds kvtier metrics (use :func:`register`, which
            reuses them).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        stores: Callable[[], Mapping[str, "TieredStore"]] | None = None,
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self._added: dict[str, "TieredStore"] = {}
        self._source = stores
        self._source_names: set[str] = set()
        self._lock = threading.Lock()
        self.latency = Histogram(
            "kvtier_operation_duration_seconds",
            "Wall time of store operations: lookup, load (prefetch submit to wait done), store.",
            ["namespace", "op"], registry=None, buckets=LATENCY_BUCKETS_S,
        )
        self._collector = _StoreCollector(self)
        self.registry.register(self._collector)
        try:
            self.registry.register(self.latency)
        except ValueError:
            self.registry.unregister(self._collector)
            raise

    def add(self, store: "TieredStore", name: str | None = None) -> str:
        """Export ``store`` under ``namespace=name`` (default :func:`store_name`) and
        hook its latency. Returns the name. Raises ``ValueError`` if the name is taken by
        another store."""
        chosen = name is None
        name = store_name(store) if name is None else name
        with self._lock:
            other = self._added.get(name)
            if chosen and other is not None and other is not store:  # two stores of one model id
                name = f"{name}@{store.namespace.hex()[:8]}"
                other = self._added.get(name)
            if other is not None and other is not store:
                raise ValueError(f"expected a new namespace label, got {name!r} (already another store's)")
            self._added[name] = store
        self.instrument(store, name)
        return name

    def remove(self, name: str) -> None:
        """Stop exporting the store added under ``name`` and unhook it (missing: no-op)."""
        with self._lock:
            store = self._added.pop(name, None)
        if store is not None:
            self.uninstrument(store)

    def instrument(self, store: "TieredStore", name: str) -> None:
        """Feed ``store``'s latency into the histogram under ``namespace=name`` (idempotent)."""
        if self._hook_of(store) is None:
            store.observe = _LatencyHook(self, name, store.observe)

    def _hook_of(self, store: "TieredStore") -> "_LatencyHook | None":
        hook = store.observe
        while isinstance(hook, _LatencyHook):
            if hook.owner is self:
                return hook
            hook = hook.previous
        return None

    def uninstrument(self, store: "TieredStore") -> None:
        """Remove this object's latency hook from ``store`` (keeping any other hook) and
        its histogram series."""
        mine = self._hook_of(store)
        if mine is None:
            return
        if store.observe is mine:
            store.observe = mine.previous
        else:
            hook = store.observe
            while hook.previous is not mine:
                hook = hook.previous
            hook.previous = mine.previous
        self._remove_latency(mine.name)

    def stores(self) -> dict[str, "TieredStore"]:
        """Every exported store by name: added ones, then the ``stores()`` source."""
        with self._lock:
            out = dict(self._added)
        if self._source is not None:
            names = set()
            for name, store in list(self._source().items()):
                name = name.hex() if isinstance(name, (bytes, bytearray)) else str(name)
                names.add(name)
                out.setdefault(name, store)
                self.instrument(store, name)
            for gone in self._source_names - names - set(out):  # a namespace the daemon dropped
                self._remove_latency(gone)
            self._source_names = names
        return out

    def _remove_latency(self, name: str) -> None:
        for op in OPS:
            try:
                self.latency.remove(name, op)
            except KeyError:
                pass

    def close(self) -> None:
        """Unregister from the registry and unhook every store."""
        for name in list(self._added):
            self.remove(name)
        if self._source is not None:
            for store in list(self._source().values()):
                self.uninstrument(store)
        for collector in (self._collector, self.latency):
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass
        _BY_REGISTRY.pop(self.registry, None)


_BY_REGISTRY: "WeakKeyDictionary[CollectorRegistry, KvtierMetrics]" = WeakKeyDictionary()
_BY_REGISTRY_LOCK = threading.Lock()


def register(
    store: "TieredStore", registry: CollectorRegistry | None = None, namespace_label: str | None = None
) -> KvtierMetrics:
    """Export ``store``'s metrics in ``registry`` (default: prometheus_client's global one).

    One :class:`KvtierMetrics` per registry holds every store registered there, each under
    its own ``namespace`` label (default :func:`store_name`). Sets ``store.observe`` (the
    latency hook; a hook already there is still called).

    Returns:
        the registry's :class:`KvtierMetrics`.

    Raises:
        ValueError: ``namespace_label`` is already used by another store in that registry.
    """
    registry = REGISTRY if registry is None else registry
    with _BY_REGISTRY_LOCK:
        metrics = _BY_REGISTRY.get(registry)
        if metrics is None:
            metrics = _BY_REGISTRY[registry] = KvtierMetrics(registry)
    metrics.add(store, namespace_label)
    return metrics


def unregister(store: "TieredStore", registry: CollectorRegistry | None = None) -> None:
    """Stop exporting ``store`` from ``registry`` (no-op when it is not there)."""
    metrics = _BY_REGISTRY.get(REGISTRY if registry is None else registry)
    if metrics is not None:
        for name, s in list(metrics.stores().items()):
            if s is store:
                metrics.remove(name)


def start_http_server(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None):
    """Serve ``registry`` (default: the global one) on ``http://addr:port/metrics`` from a
    daemon thread (``prometheus_client.start_http_server``). Returns ``(server, thread)``.
    Binds to loopback by default: pass ``addr="0.0.0.0"`` to expose it."""
    return _start_http_server(port, addr=addr, registry=REGISTRY if registry is None else registry)
