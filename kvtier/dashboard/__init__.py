"""Observability over HTTP: ``/metrics``, ``/v1/stats``, the live ``/dashboard`` page, KV events
and explanations.

``setup_observability(app, stores)`` adds the first three to an aiohttp application
(:mod:`kvtier.dashboard.routes`; ``kvtier serve`` passes its public paths and OpenAPI
paths too, so the page is served without a token and listed in ``/openapi.json``);
:mod:`kvtier.dashboard.stats` builds the JSON document. ``setup_events(app, stores_for)``
adds ``GET /v1/events`` (server-sent KV events with a resume cursor,
:mod:`kvtier.dashboard.events`) and ``setup_explain(app, stores_for)`` adds
``POST /v1/explain`` (:mod:`kvtier.dashboard.explain`): an engine serving its own store gets
what the daemon serves.
"""

from kvtier.dashboard.events import setup_events
from kvtier.dashboard.explain import setup_explain
from kvtier.dashboard.routes import OBSERVABILITY, Observability, setup_observability
from kvtier.dashboard.stats import StatsHistory

__all__ = ["OBSERVABILITY", "Observability", "StatsHistory", "setup_events", "setup_explain", "setup_observability"]
