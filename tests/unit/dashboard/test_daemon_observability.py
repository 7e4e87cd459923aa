"""``kvtier serve`` exposes /metrics, /v1/stats and /dashboard over its namespaces' stores;
with a token, the figures need it and the page (no data in it) does not."""

from __future__ import annotations

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from kvtier.server.app import make_app
from kvtier.wire import pack
from tests.conftest import random_blocks
from tests.unit.server.conftest import NAMESPACE, SPEC, frames, hashes, ns_url, register, serve_settings

B = SPEC.block_size


@pytest.fixture
async def daemon(tmp_path):
    clients: list[TestClient] = []

    async def start(**kwargs) -> TestClient:
        client = TestClient(TestServer(make_app(serve_settings(tmp_path / "data", **kwargs))))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


async def traffic(client: TestClient, headers: dict | None = None) -> None:
    """Register, put 4 blocks, look up 6 of which 4 are there."""
    if headers:
        response = await client.put(ns_url(), data=pack({"block_shape": list(SPEC.block_shape), "dtype": "float32"}),
                                    headers=headers)
        assert response.status in (200, 201), await response.text()
    else:
        await register(client)
    # A new namespace's latency is hooked at the next sample (<= 1 s) or request for figures.
    assert (await client.get("/v1/stats", headers=headers)).status == 200
    hs = hashes(6)
    response = await client.post(ns_url(op="put"), data=frames(NAMESPACE, hs[:4], random_blocks(SPEC, 4)),
                                 headers=headers)
    assert response.status == 200 and msgpack.unpackb(await response.read())["stored"] == [True] * 4
    response = await client.post(ns_url(op="lookup"), data=pack({"block_hashes": hs}), headers=headers)
    assert msgpack.unpackb(await response.read())["num_blocks"] == 4


async def test_daemon_serves_stats_metrics_and_dashboard(daemon):
    client = await daemon()
    await traffic(client)
    doc = await (await client.get("/v1/stats")).json()
    ns = doc["namespaces"][NAMESPACE.hex()]
    assert ns["lookup_tokens"] == 6 * B
    assert ns["hit_tokens_total"] == 4 * B
    assert ns["stored_tokens"]["CPU"] == 4 * B
    assert ns["tiers"]["CPU"]["blocks"] == 4
    text = await (await client.get("/metrics")).text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("kvtier_lookup_tokens_total", (("namespace", NAMESPACE.hex()),))] == 6 * B
    assert samples[("kvtier_operation_duration_seconds_count", (("namespace", NAMESPACE.hex()), ("op", "lookup")))] == 1
    page = await client.get("/dashboard")
    assert page.status == 200 and "uPlot.iife.min.js" in await page.text()
    paths = (await (await client.get("/openapi.json")).json())["paths"]
    assert paths["/v1/stats"]["get"]["summary"].startswith("Figures per namespace")
    assert paths["/dashboard"]["get"]["security"] == []
    assert "/dashboard/static/{name}" in paths and "/metrics" in paths


async def test_with_a_token_figures_need_it_and_the_page_does_not(daemon):
    client = await daemon(token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    await traffic(client, headers=auth)
    for path in ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/static/vendor/uPlot.iife.min.js"):
        assert (await client.get(path)).status == 200, path
    for path in ("/v1/stats", "/metrics"):
        assert (await client.get(path)).status == 401, path
        assert (await client.get(path, headers=auth)).status == 200, path
    doc = await (await client.get("/v1/stats", headers=auth)).json()
    assert doc["total"]["lookup_tokens"] == 6 * B
