"""What a tenant sees of the daemon's figures: ``/metrics`` and ``/v1/stats`` of its own
namespaces only, by label (``tenant/display name`` or ``tenant/ns-<opaque id>``: never a
namespace id, whose knowledge is all one needs to compute a tenant's block hashes). An admin
gets the whole daemon (kvtier.dashboard's handlers); everyone else these views
(``app[TENANT_VIEWS]``, kvtier.server.auth).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from kvtier.dashboard import OBSERVABILITY
from kvtier.dashboard.stats import StatsHistory
from kvtier.server.auth import CALLER
from kvtier.server.registry import Registry

logger = logging.getLogger(__name__)

MAX_TENANT_HISTORIES = 256


class TenantViews:
    """One :class:`~kvtier.dashboard.stats.StatsHistory` per tenant that asked for its stats
    (sampled with the daemon's own, every ``interval_s``)."""

    def __init__(self, registry: Registry, interval_s: float, max_samples: int) -> None:
        self.registry, self.interval_s, self.max_samples = registry, interval_s, max_samples
        self.histories: dict[str, StatsHistory] = {}

    def history(self, tenant: str) -> StatsHistory:
        history = self.histories.get(tenant)
        if history is None:
            if len(self.histories) >= MAX_TENANT_HISTORIES:
                self.histories.pop(next(iter(self.histories)))
            history = StatsHistory(lambda: {e.label: e.store for e in self.registry.of(tenant)},
                                   self.interval_s, self.max_samples)
            history.sample()
            self.histories[tenant] = history
        return history

    async def sampler(self, app: web.Application) -> AsyncIterator[None]:
        """Cleanup context: sample every tenant history every ``interval_s``."""
        async def run() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                for history in list(self.histories.values()):
                    try:
                        history.sample()
                    except Exception:  # a store closing under us: keep sampling
                        logger.debug("tenant stats sample failed", exc_info=True)

        task = asyncio.create_task(run(), name="kvtier-tenant-stats")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


VIEWS = web.AppKey("tenant_views", TenantViews)


class _Only:
    """A registry-like ``collect()`` of the samples whose ``namespace`` label starts with
    ``prefix`` (families with none are left out)."""

    def __init__(self, registry, prefix: str) -> None:
        self.registry, self.prefix = registry, prefix

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = [s for s in family.samples if s.labels.get("namespace", "").startswith(self.prefix)]
            if samples:
                out = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples = samples
                yield out


async def tenant_metrics(request: web.Request) -> web.Response:
    """``GET /metrics`` for a tenant: its namespaces' series only."""
    registry = request.app[OBSERVABILITY].metrics.registry
    body = generate_latest(_Only(registry, request[CALLER].tenant.name + "/"))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tenant_stats(request: web.Request) -> web.Response:
    """``GET /v1/stats`` for a tenant: the stats document of its namespaces only."""
    return web.json_response(request.app[VIEWS].history(request[CALLER].tenant.name).document())
