"""The ``/v1/stats`` document: each store's figures in tokens, their sum, and a time series.

Figures come from :func:`kvtier.metrics.figures` (the same copy of ``store.stats`` the
Prometheus collector exports, so the dashboard, ``kvtier stats`` and ``/metrics`` agree).
Per namespace (and summed in ``total``)::

    name                         the store's display name (the model id a connector sets), or null
    lookup_tokens                tokens queried (full blocks)
    hit_tokens {tier}            tokens found, by the tier holding them; hit_tokens_total
    hit_blocks {tier}, served_blocks {tier}, stored_blocks {tier}   the same events in blocks
                                 (tokens = blocks * block_size, per namespace)
    miss_tokens [{reason, tier, tokens}]   tokens not served, by why (kvtier.store.misses),
                                 most first
    hit_rate                     hit_tokens_total / lookup_tokens (null before any lookup)
    computed_tokens              lookup_tokens - hit_tokens_total: not cached, so computed
    served_tokens {tier}         tokens loaded into the top pool, by source tier
    stored_tokens {tier}         tokens newly stored
    evicted_blocks {tier}, spilled_blocks {"GPU->CPU"}, moved_bytes {"CPU->GPU"}
    load_failures [{tier, reason, blocks}], store_failures {reason}, remote_errors {reason}
    tiers {tier: {blocks, used_bytes, capacity_bytes}}
    ttft_saved_s, engine_computed_tokens   prefill seconds saved and prompt tokens prefilled, as
                                 counted by a connector into store.stats; null when none does
    ttft_lost_s                  seconds loads took beyond recomputing (connector-counted)

``series`` is sampled every ``interval_s`` by :class:`StatsHistory` (a ring buffer) and gives,
per interval between two samples: the hit rate overall and per tier, tokens/s from cache and
computed, missed tokens/s by reason, bytes/s per path, evictions/s per tier, and the bytes
used per tier at each sample. The last interval ends at the request (live figures), so a
chart has a point as soon as one sample was taken.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Mapping

from kvtier.metrics import StoreFigures, figures

if TYPE_CHECKING:
    from kvtier.store import TieredStore

SCHEMA_VERSION = 1
TIER_ORDER = ("GPU", "CPU", "DISK", "REMOTE")


def _tier_key(tier: str) -> tuple[int, str]:
    return (TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER), tier)


def path(src: str, dst: str) -> str:
    """``"CPU->GPU"``: how a (source, destination) pair is written in the document."""
    return f"{src}->{dst}"


def namespace_section(f: StoreFigures) -> dict[str, Any]:
    """One store's figures as the document's ``namespaces[name]`` entry."""
    bs = f.block_size
    lookup = f.lookup_blocks * bs
    hit = {t: f.hit_blocks.get(t, 0) * bs for t in f.tiers}
    hit_total = sum(f.hit_blocks.values()) * bs
    return {
        "name": f.name,
        "block_size": bs,
        "block_bytes": f.block_nbytes,
        "tier_names": list(f.tiers),
        "lookup_tokens": lookup,
        "remote_lookup_tokens": f.remote_lookup_blocks * bs,
        "hit_tokens": hit,
        "hit_tokens_total": hit_total,
        "hit_rate": hit_total / lookup if lookup else None,
        "computed_tokens": lookup - hit_total,
        "served_tokens": {t: f.loaded_blocks.get(t, 0) * bs for t in f.tiers},
        "stored_tokens": {t: f.stored_blocks.get(t, 0) * bs for t in f.tiers},
        "hit_blocks": {t: f.hit_blocks.get(t, 0) for t in f.tiers},
        "served_blocks": {t: f.loaded_blocks.get(t, 0) for t in f.tiers},
        "stored_blocks": {t: f.stored_blocks.get(t, 0) for t in f.tiers},
        "miss_tokens": _miss_list(f.miss_tokens.items()),
        "evicted_blocks": {t: f.evicted_blocks.get(t, 0) for t in f.tiers},
        "spilled_blocks": {path(*k): n for k, n in f.spilled_blocks.items()},
        "moved_bytes": {path(*k): n * f.block_nbytes for k, n in f.moved_blocks.items()},
        "load_failures": [
            {"tier": tier, "reason": reason, "blocks": n} for (tier, reason), n in sorted(f.load_failures.items())
        ],
        "store_failures": dict(f.store_failures),
        "remote_errors": dict(f.remote_errors),
        "tiers": {t: dict(u) for t, u in f.usage.items()},
        "ttft_saved_s": f.ttft_saved_s,
        "ttft_lost_s": f.ttft_lost_s,
        "engine_computed_tokens": f.engine_computed_tokens,
    }


def _miss_list(items: Any) -> list[dict[str, Any]]:
    """``[{reason, tier, tokens}]``, most tokens first (zeros left out)."""
    rows = [{"reason": r, "tier": t, "tokens": n} for (r, t), n in items if n]
    return sorted(rows, key=lambda row: (-row["tokens"], row["reason"], row["tier"]))


def _add_counts(into: dict[str, int], more: Mapping[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def total_section(sections: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Sum of namespace sections (tokens and bytes add up across block sizes)."""
    total: dict[str, Any] = {
        "lookup_tokens": 0, "remote_lookup_tokens": 0, "hit_tokens_total": 0, "computed_tokens": 0,
        "hit_tokens": {}, "served_tokens": {}, "stored_tokens": {}, "evicted_blocks": {}, "spilled_blocks": {},
        "moved_bytes": {}, "store_failures": {}, "remote_errors": {}, "tiers": {}, "load_failures": [],
        "ttft_saved_s": None, "engine_computed_tokens": None, "ttft_lost_s": 0.0, "name": None,
        "hit_blocks": {}, "served_blocks": {}, "stored_blocks": {}, "miss_tokens": [],
    }
    failures: Counter = Counter()
    missed: Counter = Counter()
    for s in sections.values():
        for key in ("ttft_saved_s", "engine_computed_tokens"):  # null unless some store counts it
            if s[key] is not None:
                total[key] = (total[key] or 0) + s[key]
        for key in ("lookup_tokens", "remote_lookup_tokens", "hit_tokens_total", "computed_tokens"):
            total[key] += s[key]
        for key in ("hit_tokens", "served_tokens", "stored_tokens", "evicted_blocks", "spilled_blocks",
                    "moved_bytes", "store_failures", "remote_errors", "hit_blocks", "served_blocks", "stored_blocks"):
            _add_counts(total[key], s.get(key, {}))
        total["ttft_lost_s"] += s.get("ttft_lost_s") or 0.0
        for m in s.get("miss_tokens", []):
            missed[(m["reason"], m["tier"])] += m["tokens"]
        for tier, usage in s["tiers"].items():
            _add_counts(total["tiers"].setdefault(tier, {}), usage)
        for f in s["load_failures"]:
            failures[(f["tier"], f["reason"])] += f["blocks"]
    for key in ("hit_tokens", "served_tokens", "stored_tokens", "evicted_blocks", "tiers"):
        total[key] = dict(sorted(total[key].items(), key=lambda kv: _tier_key(kv[0])))
    total["tier_names"] = list(total["tiers"]) or sorted(total["hit_tokens"], key=_tier_key)
    total["load_failures"] = [{"tier": t, "reason": r, "blocks": n} for (t, r), n in sorted(failures.items())]
    total["miss_tokens"] = _miss_list(missed.items())
    total["hit_rate"] = total["hit_tokens_total"] / total["lookup_tokens"] if total["lookup_tokens"] else None
    return total


def _flat(total: Mapping[str, Any]) -> dict[str, float]:
    """The counters and gauges the time series is made of, flattened to ``"kind/key"``."""
    flat: dict[str, float] = {"lookup_tokens": total["lookup_tokens"], "hit_tokens_total": total["hit_tokens_total"],
                              "computed_tokens": total["computed_tokens"]}
    for kind in ("hit_tokens", "served_tokens", "moved_bytes", "evicted_blocks"):
        for key, value in total[kind].items():
            flat[f"{kind}/{key}"] = value
    for m in total["miss_tokens"]:
        key = f"miss_tokens/{m['reason']}"
        flat[key] = flat.get(key, 0) + m["tokens"]
    for tier, usage in total["tiers"].items():
        flat[f"used_bytes/{tier}"] = usage["used_bytes"]
    return flat


def _name(name: Any) -> str:
    return name.hex() if isinstance(name, (bytes, bytearray)) else str(name)


def _delta(a: Mapping[str, float], b: Mapping[str, float], key: str) -> float:
    """``b[key] - a[key]``; 0 for a sum that went down (a store went away)."""
    return max(b.get(key, 0) - a.get(key, 0), 0)


class StatsHistory:
    """The stats document's source: live figures on request, plus a ring buffer of samples.

    Args:
        stores: ``stores() -> {name: TieredStore}``, read at every sample and request.
        interval_s: seconds between samples (the background task calls :meth:`sample`).
        max_samples: samples kept (default 300: five minutes at 1 s).
    """

    def __init__(
        self, stores: Callable[[], Mapping[Any, "TieredStore"]], interval_s: float = 1.0, max_samples: int = 300
    ) -> None:
        if not interval_s > 0 or max_samples < 2:
            raise ValueError(f"expected interval_s > 0 and max_samples >= 2, got {interval_s}, {max_samples}")
        self.stores, self.interval_s = stores, interval_s
        self._samples: deque[tuple[float, float, dict[str, float]]] = deque(maxlen=max_samples)

    def sections(self) -> dict[str, dict[str, Any]]:
        stores = sorted((_name(k), s) for k, s in self.stores().items())
        return {name: namespace_section(figures(store)) for name, store in stores}

    def sample(self) -> dict[str, float]:
        """Take one sample now (wall time, monotonic time, flat totals) and return it."""
        flat = _flat(total_section(self.sections()))
        self._samples.append((time.time(), time.monotonic(), flat))
        return flat

    def document(self) -> dict[str, Any]:
        """The ``/v1/stats`` JSON document (live figures; series from the samples)."""
        sections = self.sections()
        total = total_section(sections)
        return {
            "version": SCHEMA_VERSION,
            "time": time.time(),
            "interval_s": self.interval_s,
            "namespaces": sections,
            "total": total,
            "series": self.series(_flat(total)),
        }

    def series(self, live: Mapping[str, float] | None = None) -> dict[str, Any]:
        """Rates per interval between consecutive samples (``t`` = the interval's end); with
        ``live`` (the flat totals now), a last interval from the latest sample to now, when
        that sample is at least a tenth of an interval old."""
        samples = list(self._samples)
        if live is not None and samples and time.monotonic() - samples[-1][1] >= self.interval_s / 10:
            samples.append((time.time(), time.monotonic(), dict(live)))
        out: dict[str, Any] = {
            "t": [], "hit_rate": {"all": []}, "lookup_tokens_per_s": [], "cached_tokens_per_s": [],
            "computed_tokens_per_s": [], "miss_tokens_per_s": {}, "bytes_per_s": {}, "evicted_blocks_per_s": {},
            "used_bytes": {},
        }
        keys = sorted({k for _, _, flat in samples for k in flat})
        tiers = sorted({k.split("/", 1)[1] for k in keys if k.startswith("hit_tokens/")}, key=_tier_key)
        paths = [k.split("/", 1)[1] for k in keys if k.startswith("moved_bytes/")]
        evict_tiers = sorted({k.split("/", 1)[1] for k in keys if k.startswith("evicted_blocks/")}, key=_tier_key)
        used_tiers = sorted({k.split("/", 1)[1] for k in keys if k.startswith("used_bytes/")}, key=_tier_key)
        reasons = sorted(k.split("/", 1)[1] for k in keys if k.startswith("miss_tokens/"))
        for tier in tiers:
            out["hit_rate"][tier] = []
        for (_, m0, a), (t1, m1, b) in zip(samples, samples[1:], strict=False):
            dt = max(m1 - m0, 1e-9)
            delta = partial(_delta, a, b)

            lookups = delta("lookup_tokens")
            out["t"].append(t1)
            out["hit_rate"]["all"].append(delta("hit_tokens_total") / lookups if lookups else None)
            for tier in tiers:
                out["hit_rate"][tier].append(delta(f"hit_tokens/{tier}") / lookups if lookups else None)
            out["lookup_tokens_per_s"].append(lookups / dt)
            out["cached_tokens_per_s"].append(delta("hit_tokens_total") / dt)
            out["computed_tokens_per_s"].append(delta("computed_tokens") / dt)
            for reason in reasons:
                out["miss_tokens_per_s"].setdefault(reason, []).append(delta(f"miss_tokens/{reason}") / dt)
            for p in paths:
                out["bytes_per_s"].setdefault(p, []).append(delta(f"moved_bytes/{p}") / dt)
            for tier in evict_tiers:
                out["evicted_blocks_per_s"].setdefault(tier, []).append(delta(f"evicted_blocks/{tier}") / dt)
            for tier in used_tiers:
                out["used_bytes"].setdefault(tier, []).append(b.get(f"used_bytes/{tier}"))
        return out
