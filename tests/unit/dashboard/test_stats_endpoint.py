"""/v1/stats, /metrics and /dashboard from kvtier.dashboard.setup_observability."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.dashboard import OBSERVABILITY, setup_observability
from kvtier.dashboard.routes import STATIC_DIR
from tests.conftest import BLOCK_SIZE, chain, random_blocks, tiny_spec

B = BLOCK_SIZE


@pytest.fixture
async def client_for():
    clients: list[TestClient] = []

    async def make(app: web.Application) -> TestClient:
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


def two_stores(make_store, namespace):
    spec = tiny_spec()
    a = make_store(gpu_blocks=8)
    b = make_store(gpu_blocks=2, cpu_blocks=4)
    hashes = chain(6, spec, namespace)
    a.store(hashes[:4], random_blocks(spec, 4))
    a.lookup(hashes)  # 6 asked, 4 hit on GPU
    b.store(hashes[:4], random_blocks(spec, 4))  # 2 spill GPU -> CPU
    b.lookup(hashes)  # 6 asked, 4 hit: 2 GPU, 2 CPU
    return spec, a, b


async def test_stats_document_per_namespace_and_total(make_store, namespace, client_for):
    spec, a, b = two_stores(make_store, namespace)
    app = web.Application()
    setup_observability(app, {"a": a, "b": b}, interval_s=3600)
    client = await client_for(app)
    response = await client.get("/v1/stats")
    assert response.status == 200
    doc = await response.json()
    na, nb, total = doc["namespaces"]["a"], doc["namespaces"]["b"], doc["total"]
    assert na["lookup_tokens"] == 6 * B and na["hit_tokens"] == {"GPU": 4 * B}
    assert na["hit_rate"] == pytest.approx(4 / 6)
    assert na["computed_tokens"] == 2 * B
    assert na["stored_tokens"]["GPU"] == 4 * B
    assert na["moved_bytes"] == {"engine->GPU": 4 * spec.block_nbytes}
    nbytes = spec.block_nbytes
    assert na["tiers"]["GPU"] == {"blocks": 4, "used_bytes": 4 * nbytes, "capacity_bytes": 8 * nbytes}
    assert nb["hit_tokens"] == {"GPU": 2 * B, "CPU": 2 * B}
    assert nb["spilled_blocks"] == {"GPU->CPU": b.stats.spilled_blocks["CPU"]}
    assert nb["evicted_blocks"]["GPU"] == b.stats.evicted_blocks["GPU"]
    assert total["lookup_tokens"] == 12 * B
    assert total["hit_tokens"] == {"GPU": 6 * B, "CPU": 2 * B}
    assert total["hit_rate"] == pytest.approx(8 / 12)
    assert total["tiers"]["GPU"]["capacity_bytes"] == 10 * spec.block_nbytes
    assert total["ttft_saved_s"] is None  # only the connector could know it
    assert doc["series"]["t"] == []  # one sample so far (at start-up): no interval yet


async def test_series_is_per_interval_between_samples(make_store, namespace, client_for):
    spec, a, _ = two_stores(make_store, namespace)
    app = web.Application()
    obs = setup_observability(app, {"a": a}, interval_s=3600)  # the test takes the samples
    client = await client_for(app)
    hashes = chain(6, spec, namespace)
    obs.history.sample()
    a.lookup(hashes[:4])  # 4 asked, 4 hit
    a.lookup(chain(4, spec, namespace, start=777))  # 4 asked, 0 hit
    obs.history.sample()
    series = (await (await client.get("/v1/stats")).json())["series"]
    assert len(series["t"]) == 2  # start-up sample -> first manual one, and the interval above
    assert series["hit_rate"]["all"][-1] == pytest.approx(0.5)
    assert series["hit_rate"]["GPU"][-1] == pytest.approx(0.5)
    assert series["lookup_tokens_per_s"][-1] > 0
    assert series["computed_tokens_per_s"][-1] == pytest.approx(series["cached_tokens_per_s"][-1])
    assert series["used_bytes"]["GPU"][-1] == 4 * spec.block_nbytes
    obs.history.sample()  # an idle interval: no lookups, no hit rate
    series = (await (await client.get("/v1/stats")).json())["series"]
    assert series["hit_rate"]["all"][-1] is None
    assert series["lookup_tokens_per_s"][-1] == 0


async def test_sampler_task_samples_while_the_app_runs(make_store, namespace, client_for):
    _, a, _ = two_stores(make_store, namespace)
    app = web.Application()
    setup_observability(app, {"a": a}, interval_s=0.02)
    client = await client_for(app)
    for _ in range(500):
        series = (await (await client.get("/v1/stats")).json())["series"]
        if len(series["t"]) >= 3:
            break
        await asyncio.sleep(0.02)
    assert len(series["t"]) >= 3
    assert series["t"] == sorted(series["t"])


async def test_metrics_endpoint_matches_stats(make_store, namespace, client_for):
    _, a, b = two_stores(make_store, namespace)
    key = web.AppKey("stores", dict)
    app = web.Application()
    app[key] = {"a": a, "b": b}
    setup_observability(app, key)  # the daemon's way: the registry of namespaces under an AppKey
    client = await client_for(app)
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(await response.text()) for s in f.samples}
    doc = await (await client.get("/v1/stats")).json()
    for ns in ("a", "b"):
        assert samples[("kvtier_lookup_tokens_total", (("namespace", ns),))] == doc["namespaces"][ns]["lookup_tokens"]
        for tier, tokens in doc["namespaces"][ns]["hit_tokens"].items():
            assert samples[("kvtier_hit_tokens_total", (("namespace", ns), ("tier", tier)))] == tokens
    app[OBSERVABILITY].metrics.close()


async def test_dashboard_page_and_assets_are_served_locally(make_store, namespace, client_for):
    _, a, _ = two_stores(make_store, namespace)
    app = web.Application()
    setup_observability(app, {"a": a})
    client = await client_for(app)
    page = await client.get("/dashboard")
    assert page.status == 200 and page.content_type == "text/html"
    html = await page.text()
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert "dashboard/static/vendor/uPlot.iife.min.js" in refs
    for ref in refs:
        assert not re.match(r"^(https?:)?//", ref), f"the page must work offline, but it loads {ref}"
        if ref.startswith("dashboard/static/"):
            asset = await client.get("/" + ref)
            assert asset.status == 200, ref
    js = (STATIC_DIR / "dashboard.js").read_text()
    assert not re.search(r"https?://", js)
    assert (STATIC_DIR / "vendor" / "uPlot.LICENSE").read_text().startswith("The MIT License")
    for bad in ("/dashboard/static/../routes.py", "/dashboard/static/%2e%2e/routes.py",
                "/dashboard/static/vendor/../../stats.py", "/dashboard/static/nothing.js"):
        assert (await client.get(bad)).status == 404, bad
    css = await client.get("/dashboard/static/vendor/uPlot.min.css")
    assert css.status == 200 and css.content_type == "text/css"


def test_setup_refuses_a_bad_stores_argument():
    with pytest.raises(TypeError, match="mapping, a callable or a web.AppKey"):
        setup_observability(web.Application(), 42)


async def test_connector_counters_are_shown_when_the_store_has_them(make_store, namespace, client_for):
    """TTFT saved and the engine's prefilled tokens come from a connector's counts
    (``store.record_computed_tokens``, into ``stats.computed_tokens`` and
    ``stats.ttft_saved_s``); TTFT saved is null until one counts it."""
    _, a, b = two_stores(make_store, namespace)
    app = web.Application()
    obs = setup_observability(app, {"a": a, "b": b})
    client = await client_for(app)
    doc = await (await client.get("/v1/stats")).json()
    assert doc["total"]["ttft_saved_s"] is None and doc["namespaces"]["a"]["engine_computed_tokens"] == 0
    a.record_computed_tokens(96, ttft_saved_s=1.25)
    doc = await (await client.get("/v1/stats")).json()
    assert doc["namespaces"]["a"]["ttft_saved_s"] == 1.25 and doc["total"]["ttft_saved_s"] == 1.25
    assert doc["total"]["engine_computed_tokens"] == 96 and doc["namespaces"]["b"]["ttft_saved_s"] is None
    text = generate_latest(obs.metrics.registry).decode()
    assert 'kvtier_ttft_saved_seconds_total{namespace="a"} 1.25' in text
    assert 'kvtier_engine_computed_tokens_total{namespace="a"} 96.0' in text
    assert 'kvtier_ttft_saved_seconds_total{namespace="b"}' not in text
