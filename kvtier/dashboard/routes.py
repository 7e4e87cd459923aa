"""aiohttp routes: ``/metrics`` (Prometheus), ``/v1/stats`` (JSON) and ``/dashboard`` (a page).

:func:`setup_observability` adds them to an application (the daemon's, or any aiohttp app an
engine runs) over a mapping of stores; a background task samples the stats every
``interval_s`` for the dashboard's charts. The page and its charting library (uPlot, MIT,
vendored from npm under ``static/vendor/``) are served by kvtier itself: no CDN, works offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtier.dashboard.stats import StatsHistory
from kvtier.metrics import KvtierMetrics

if TYPE_CHECKING:
    from kvtier.store import TieredStore

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"

StoresSource = Callable[[], Mapping[Any, "TieredStore"]]


class Observability:
    """What :func:`setup_observability` keeps under ``app[OBSERVABILITY]``.

    Attributes:
        metrics: the app's :class:`~kvtier.metrics.KvtierMetrics` (its own registry).
        history: the stats sampler behind ``/v1/stats``.
    """

    def __init__(self, metrics: KvtierMetrics, history: StatsHistory) -> None:
        self.metrics, self.history = metrics, history


OBSERVABILITY = web.AppKey("kvtier_observability", Observability)


def setup_observability(
    app: web.Application,
    stores: StoresSource | Mapping[Any, "TieredStore"] | web.AppKey,
    *,
    registry: CollectorRegistry | None = None,
    interval_s: float = 1.0,
    max_samples: int = 300,
    public_paths: set[str] | None = None,
    openapi_paths: dict | None = None,
) -> Observability:
    """Add ``GET /metrics``, ``GET /v1/stats``, ``GET /dashboard`` and its static files.

    Args:
        app: a not yet started application.
        stores: the stores to show, by name: a mapping, a ``stores()`` callable, or an
            ``AppKey`` under which ``app`` holds the mapping (read at every request).
        registry: Prometheus registry of ``/metrics``; default a new one for this app
            (so that two apps in one process never share series).
        interval_s: seconds between samples of the time series.
        max_samples: samples kept (the charts' window is ``interval_s * max_samples``).
        public_paths: the app's set of paths served without a token, if it has one: the
            page and its static files join it (they hold no data); ``/metrics`` and
            ``/v1/stats`` do not.
        openapi_paths: the app's OpenAPI ``paths`` being collected, if any: these routes
            join it (:func:`openapi_entries`).

    Returns:
        the :class:`Observability` also stored under ``app[OBSERVABILITY]``.
    """
    source = _source(app, stores)
    metrics = KvtierMetrics(CollectorRegistry() if registry is None else registry, stores=source)
    obs = Observability(metrics, StatsHistory(metrics.stores, interval_s, max_samples))
    app[OBSERVABILITY] = obs
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/stats", _stats)
    app.router.add_get("/dashboard", _dashboard)
    app.router.add_get("/dashboard/static/{name:.+}", _static)
    app.cleanup_ctx.append(_sampler)
    if public_paths is not None:
        public_paths.update(page_paths())
    if openapi_paths is not None:
        openapi_paths.update(openapi_entries())
    return obs


def page_paths() -> set[str]:
    """``/dashboard`` and the path of every static file of the page."""
    return {"/dashboard", *("/dashboard/static/" + p.relative_to(STATIC_DIR).as_posix()
                            for p in STATIC_DIR.rglob("*") if p.is_file())}


def _source(app: web.Application, stores: Any) -> StoresSource:
    if isinstance(stores, web.AppKey):
        return lambda: app[stores]
    if callable(stores):
        return stores
    if isinstance(stores, Mapping):
        return lambda: stores
    raise TypeError(f"expected a mapping, a callable or a web.AppKey of stores, got {type(stores).__name__}")


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[OBSERVABILITY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[OBSERVABILITY].history.document())


async def _dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


_CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".md": "text/markdown"}


async def _static(request: web.Request) -> web.FileResponse:
    """A file of ``static/`` (the page's script, styles, the vendored library); 404 for
    anything else, ``..`` included."""
    path = (STATIC_DIR / request.match_info["name"]).resolve()
    if not path.is_relative_to(STATIC_DIR.resolve()) or not path.is_file():
        raise web.HTTPNotFound(text="no such dashboard file")
    content_type = _CONTENT_TYPES.get(path.suffix, "text/plain")
    return web.FileResponse(path, headers={"Content-Type": f"{content_type}; charset=utf-8"})


def openapi_entries() -> dict:
    """OpenAPI 3 ``paths`` entries of these routes (for the daemon's ``/openapi.json``)."""
    def get(summary: str, media: str, security: bool = True) -> dict:
        op = {"summary": summary, "responses": {"200": {"description": summary, "content": {media: {"schema": {
            "type": "object" if media == "application/json" else "string"}}}}}}
        if not security:
            op["security"] = []
        else:
            op["responses"]["401"] = {"description": "missing or wrong bearer token"}
        return {"get": op}

    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"},
            "description": "a file of the page: dashboard.js, dashboard.css, vendor/uPlot.iife.min.js, ..."}
    return {
        "/metrics": get("Prometheus metrics of every namespace (kvtier.metrics)", "text/plain"),
        "/v1/stats": get("Figures per namespace and in total, and a time series (kvtier.dashboard.stats)",
                         "application/json"),
        "/dashboard": get("The live dashboard page (polls /v1/stats; open /dashboard#token=... when the "
                          "daemon has a token)", "text/html", security=False),
        "/dashboard/static/{name}": {"parameters": [name], **get("A static file of the dashboard page", "text/plain",
                                                                 security=False)},
    }


async def _sampler(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: sample every ``interval_s`` while the app runs."""
    history = app[OBSERVABILITY].history

    async def run() -> None:
        while True:
            await asyncio.sleep(history.interval_s)
            try:
                history.sample()
            except Exception:  # a store closing under us: log, keep sampling
                logger.exception("stats sample failed")

    history.sample()  # the first one at start-up, so the first interval ends one tick later
    task = asyncio.create_task(run(), name="kvtier-stats-sampler")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    app[OBSERVABILITY].metrics.close()
