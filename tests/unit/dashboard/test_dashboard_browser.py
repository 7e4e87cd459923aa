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
    "kpi-ttft-saved": "ttft_saved_s",
    "kpi-computed-tokens": "computed_tokens", "kpi-evicted-blocks": None, "kpi-load-failures": None,
    "kpi-moved-bytes": None,
}


def expected(section: dict) -> dict[str, float | None]:
    out = {k: section[v] for k, v in KPIS.items() if v is not None}
    out["kpi-miss-tokens"] = sum(m["tokens"] for m in section["miss_tokens"])
    for m in section["miss_tokens"]:
        out[f"miss-{m['reason']}-{m['tier'] or 'none'}"] = m["tokens"]
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
        elif element_id == "kpi-ttft-saved":
            assert text == f"{want:.1f} s", (text, want)  # filled: a connector reports it
        elif "bytes" not in element_id:
            assert text == f"{int(want):,}", (element_id, text, want)


def check_lines_drawn(page) -> None:
    """Every chart shows data: its main series has points and its color is on the canvas
    (a line, not two dots); the hit-rate series that can coincide (all hits from one tier)
    differ in color and dash pattern."""
    stats = {c["id"]: c for c in page.evaluate("window.kvtierChartStats()")}
    for chart_id, c in stats.items():
        assert not c["empty"] and not page.locator(f"#{chart_id} + .empty").is_visible(), chart_id
        drawn = [s for s in c["series"] if s["points"] >= 2 and s["pixels"] >= 150]
        assert drawn, (chart_id, c["series"])
    hit = stats["chart-hit-rate"]["series"]
    assert {s["label"] for s in hit} >= {"all", "GPU", "CPU", "DISK"}
    assert all(s["points"] >= 2 and s["pixels"] >= 100 for s in hit), hit
    styles = page.evaluate("charts['chart-hit-rate'].plot.series.slice(1).map((s, i) => "
                           "[charts['chart-hit-rate'].colors[i], JSON.stringify(s.dash), s.width])")
    assert len({tuple(x) for x in styles}) == len(styles) and len({x[1] for x in styles}) == len(styles), styles


def check_cards_fit(page) -> None:
    """At 1280 px no card and no figure in it overflows."""
    overflow = page.evaluate("""Array.from(document.querySelectorAll('.kpi')).filter((k) => {
        const v = k.querySelector('.value');
        return k.scrollWidth > k.clientWidth + 1 || v.scrollWidth > v.clientWidth + 1
          || k.getBoundingClientRect().right > document.documentElement.clientWidth;
      }).map((k) => k.querySelector('h2').textContent)""")
    assert overflow == [], overflow


@pytest.mark.slow  # drives chromium against a live daemon
def test_dashboard_under_load_matches_the_stats_endpoint(tmp_path, live_server):
    store = traffic_store(tmp_path / "kvtier", gpu_blocks=64, cpu_blocks=192, disk_blocks=1024)

    def make_app() -> web.Application:
        app = web.Application()
        setup_observability(app, {"chat": store}, interval_s=0.25)
        return app

    server = live_server(make_app)
    traffic = Traffic(store, conversations=16)
    errors: list[str] = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1100})
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
                page.goto(server.url + "/dashboard")
                page.wait_for_function("Number(document.body.dataset.renders || 0) >= 1", timeout=45_000)
                # Before any traffic: the hit rate has no value yet, and the chart says so.
                assert page.locator("#chart-hit-rate + .empty").is_visible()
                assert page.locator("#chart-hit-rate + .empty").inner_text() == "no data yet"
                traffic.start()
                # Polls once a second; the sampler ticks 4 times a second: 8 renders give charts
                # with ~30 points each.
                page.wait_for_function("Number(document.body.dataset.renders || 0) >= 9", timeout=45_000)
                assert traffic.requests > 0 and not traffic.errors
                for chart in ("chart-hit-rate", "chart-tokens", "chart-misses", "chart-bytes", "chart-evictions"):
                    box = page.locator(f"#{chart} canvas").first.bounding_box()
                    assert box is not None and box["width"] > 200 and box["height"] > 100, chart
                    points = page.evaluate(f"charts['{chart}'].plot.data[0].length")
                    assert points >= 5, (chart, points)
                check_lines_drawn(page)
                check_cards_fit(page)
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
