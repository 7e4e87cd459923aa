"""Observability over HTTP: ``/metrics``, ``/v1/stats`` and the live ``/dashboard`` page.

``setup_observability(app, stores)`` adds all three to an aiohttp application
(:mod:`kvtier.dashboard.routes`; ``setup_daemon(app)`` for ``kvtier serve``);
:mod:`kvtier.dashboard.stats` builds the JSON document.
"""

from kvtier.dashboard.routes import OBSERVABILITY, Observability, setup_daemon, setup_observability
from kvtier.dashboard.stats import StatsHistory

__all__ = ["OBSERVABILITY", "Observability", "StatsHistory", "setup_daemon", "setup_observability"]
