"""Observability over HTTP: ``/metrics``, ``/v1/stats`` and the live ``/dashboard`` page.

``setup_observability(app, stores)`` adds all three to an aiohttp application
(:mod:`kvtier.dashboard.routes`; ``kvtier serve`` passes its public paths and OpenAPI
paths too, so the page is served without a token and listed in ``/openapi.json``);
:mod:`kvtier.dashboard.stats` builds the JSON document.
"""

from kvtier.dashboard.routes import OBSERVABILITY, Observability, setup_observability
from kvtier.dashboard.stats import StatsHistory

__all__ = ["OBSERVABILITY", "Observability", "StatsHistory", "setup_observability"]
