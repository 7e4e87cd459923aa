"""The dashboard in headless Chromium (Debian's, driven by playwright): it loads while traffic
runs, draws its charts, shows exactly the figures of the /v1/stats document it fetched, and
after the traffic stops, the same figures as a fresh GET /v1/stats. Saves a screenshot
(``KVTIER_DASHBOARD_SCREENSHOT=docs/dashboard.png`` also copies it there).

Skipped when playwright or chromium is not installed (CI installs both: Debian's chromium,
PyPI's playwright; no ``playwright install``, the browser is Debian's)."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from kvtier.dashboard import setup_observability
from tests.unit.dashboard.traffic import Traffic, traffic_store

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
CHROMIUM = os.environ.get("KVTIER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
KPIS = {  # element id -> field of the stats document section (None: derived below)
    "kpi-hit-rate": "hit_rate", "kpi-lookup-tokens": "lookup_tokens", "kpi-hit-tokens": "hit_tokens_total",
    "kpi-computed-tokens": "computed_tokens", "kpi-evicted-blocks": None, "kpi-load-failures": None,
    "kpi-moved-bytes": None,
}


def expected(section: dict) -> dict[str, float | None]:
    out = {k: section[v] for k, v in KPIS.items() if v is not None}
    out["kpi-evicted-blocks"] = sum(section["evicted_blocks"].values())
    out["kpi-load-failures"] = sum(f["blocks"] for f in section["load_failures"])
    out["kpi-moved-bytes"] = sum(section["moved_bytes"].values())
    for tier, n in section["hit_tokens"].items():
        out[f"tier-{tier}-hit_tokens"] = n
    for tier, usage in section["tiers"].items():
        out[f"tier-{tier}-used_bytes"] = usage["used_bytes"]
        out[f"tier-{tier}-blocks"] = usage["blocks"]
    return out


def check_page_shows(page, section: dict) -> None:
    """Each figure's data-value equals the document's number; its text shows it (counts
    exactly with thousands separators, the hit rate to 0.1 %)."""
    for element_id, want in expected(section).items():
        el = page.locator(f"#{element_id}")
        raw, text = el.get_attribute("data-value"), el.inner_text()
        assert raw is not None and float(raw) == pytest.approx(want, rel=1e-12), (element_id, raw, want)
        if element_id == "kpi-hit-rate":
            assert abs(float(text.rstrip("%")) - want * 100) <= 0.05 + 1e-9, (text, want)
        elif "bytes" not in element_id:
            assert text == f"{int(want):,}", (element_id, text, want)


@pytest.mark.slow  # drives chromium against a live daemon
def test_dashboard_under_load_matches_the_stats_endpoint(tmp_path, live_server):
    store = traffic_store(tmp_path / "kvtier", gpu_blocks=64, cpu_blocks=192, disk_blocks=1024)

    def make_app() -> web.Application:
        app = web.Application()
        setup_observability(app, {"chat": store}, interval_s=0.25)
        return app

    server = live_server(make_app)
    traffic = Traffic(store, conversations=16).start()
    errors: list[str] = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
                page.goto(server.url + "/dashboard")
                # Polls once a second; the sampler ticks 4 times a second: 8 renders give charts
                # with ~30 points each.
                page.wait_for_function("Number(document.body.dataset.renders || 0) >= 8", timeout=45_000)
                assert traffic.requests > 0 and not traffic.errors
                for chart in ("chart-hit-rate", "chart-tokens", "chart-bytes", "chart-evictions"):
                    box = page.locator(f"#{chart} canvas").first.bounding_box()
                    assert box is not None and box["width"] > 200 and box["height"] > 100, chart
                    points = page.evaluate(f"charts['{chart}'].plot.data[0].length")
                    assert points >= 5, (chart, points)
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
                if os.environ.get("KVTIER_DASHBOARD_SCREENSHOT"):
                    shutil.copyfile(shot, os.environ["KVTIER_DASHBOARD_SCREENSHOT"])

                # Under load: the page shows exactly the document it fetched.
                page.evaluate("window.kvtierPaused = true")
                time.sleep(1.5)  # the poll already scheduled runs once more, then polling stops
                doc = page.evaluate(
                    "async () => { const r = await fetch('v1/stats'); const d = await r.json(); render(d); return d; }")
                assert doc["total"]["lookup_tokens"] > 0 and doc["series"]["t"]
                check_page_shows(page, doc["total"])

                # After the traffic stops: the page equals a fresh GET /v1/stats.
                traffic.stop()
                page.evaluate("window.kvtierPoll()")
                fresh = json.loads(urllib.request.urlopen(server.url + "/v1/stats", timeout=10).read())
                assert fresh["total"]["lookup_tokens"] >= doc["total"]["lookup_tokens"]
                check_page_shows(page, fresh["total"])
                check_page_shows(page, fresh["namespaces"]["chat"])  # one namespace: the same figures
                page.select_option("#namespace", "chat")
                check_page_shows(page, fresh["namespaces"]["chat"])
            finally:
                browser.close()
    finally:
        traffic.stop()
        store.close()
    assert not errors, errors
    assert fresh["total"]["hit_rate"] is not None and 0 < fresh["total"]["hit_rate"] < 1
    assert set(fresh["total"]["hit_tokens"]) == {"GPU", "CPU", "DISK"}
    assert all(fresh["total"]["hit_tokens"][t] > 0 for t in ("GPU", "CPU", "DISK")), fresh["total"]["hit_tokens"]
    assert Path(tmp_path / "dashboard.png").stat().st_size > 20_000
