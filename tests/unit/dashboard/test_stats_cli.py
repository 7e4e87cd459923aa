"""``kvtier stats``: tables from a daemon's /v1/stats and from a local data dir."""

from __future__ import annotations

import json

from aiohttp import web
from click.testing import CliRunner

from kvtier.app.cli import main
from kvtier.dashboard import setup_observability
from tests.conftest import BLOCK_SIZE, chain, random_blocks, tiny_spec

B = BLOCK_SIZE


def served_store(make_store, namespace, live_server, token: str | None = None):
    spec = tiny_spec()
    store = make_store(gpu_blocks=8, cpu_blocks=8)
    hashes = chain(6, spec, namespace)
    store.store(hashes[:5], random_blocks(spec, 5))
    store.lookup(hashes)  # 6 asked, 5 hit

    @web.middleware
    async def auth(request, handler):
        if token and request.headers.get("Authorization") != f"Bearer {token}":
            raise web.HTTPUnauthorized()
        return await handler(request)

    def make_app() -> web.Application:
        app = web.Application(middlewares=[auth])
        setup_observability(app, {"chat": store})
        return app

    return store, live_server(make_app)


def test_stats_from_a_daemon_url(make_store, namespace, live_server):
    store, server = served_store(make_store, namespace, live_server)
    store.name = "SmolLM2-135M-Instruct"  # a connector names its store by the model id
    result = CliRunner().invoke(main, ["stats", "--url", server.url], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), result.output  # whatever the terminal's width
    assert f"SmolLM2-135M-Instruct: {6 * B} tokens looked up, hit rate 83.3%, block_size {B}" in lines
    assert not any(namespace.hex()[:16] in line for line in lines)  # named by model id, not a cut hash
    assert any("TTFT saved n/a" in line for line in lines)
    assert any("missed tokens: never_stored" in line for line in lines)
    # tokens and blocks per tier, side by side: tokens = blocks x block_size
    gpu = next(line.split() for line in lines if line.split()[:1] == ["GPU"] and len(line.split()) == 7)
    hit_tok, hit_blk, served_tok, served_blk = (int(x.replace(",", "")) for x in gpu[1:5])
    assert (hit_tok, hit_blk) == (5 * B, 5) and served_tok == served_blk * B
    assert any(line.split()[:1] == ["engine->GPU"] for line in lines)


def test_stats_counts_agree_across_tiers_and_namespaces(make_store, namespace, live_server):
    """Two namespaces: each tier row's tokens are its blocks times the namespace's block size,
    and the total's rows are the sums."""
    from kvtier.app.stats_cli import render_lines
    from kvtier.dashboard.stats import StatsHistory

    spec = tiny_spec()
    a, b = make_store(gpu_blocks=4, cpu_blocks=8), make_store(gpu_blocks=4, cpu_blocks=8)
    for store, n in ((a, 10), (b, 3)):
        hashes = chain(n, spec, namespace)
        store.store(hashes, random_blocks(spec, n))
        store.load(hashes).lease.release()
    doc = StatsHistory(lambda: {"a": a, "b": b}).document()
    lines = render_lines(doc, "test")
    assert all(len(line) <= 80 for line in lines)
    for name, section in doc["namespaces"].items():
        for tier in section["tier_names"]:
            assert section["hit_tokens"][tier] == section["hit_blocks"][tier] * B
            assert section["served_tokens"][tier] == section["served_blocks"][tier] * B
    total = doc["total"]
    assert total["hit_blocks"]["CPU"] == sum(s["hit_blocks"]["CPU"] for s in doc["namespaces"].values())
    assert f"all namespaces: {13 * B} tokens looked up, hit rate 100.0%" in lines


def test_stats_json_is_the_stats_document(make_store, namespace, live_server):
    _, server = served_store(make_store, namespace, live_server, token="s3cret")
    denied = CliRunner().invoke(main, ["stats", "--url", server.url, "--json"])
    assert denied.exit_code == 1 and "HTTP 401" in denied.output and "--token" in denied.output
    result = CliRunner().invoke(main, ["stats", "--url", server.url, "--json"], env={"KVTIER_TOKEN": "s3cret"})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["namespaces"]["chat"]["hit_tokens"]["GPU"] == 5 * B


def test_stats_unreachable_daemon_is_a_clear_error():
    result = CliRunner().invoke(main, ["stats", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "cannot reach http://127.0.0.1:9" in result.output


def test_stats_from_a_data_dir_and_one_in_use(make_store, namespace, tmp_path):
    spec = tiny_spec()
    data_dir = tmp_path / "data"
    store = make_store(gpu_blocks=2, disk_blocks=16, data_dir=data_dir)
    store.store(chain(6, spec, namespace), random_blocks(spec, 6))
    busy = CliRunner().invoke(main, ["stats", "--data-dir", str(data_dir)])
    assert busy.exit_code == 1
    assert "in use by a running kvtier process" in busy.output and "--url" in busy.output
    store.close()  # flushes the memory tiers: all 6 blocks on DISK
    result = CliRunner().invoke(main, ["stats", "--data-dir", str(data_dir), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    disk = doc["namespaces"][namespace.hex()]["tiers"]["DISK"]
    assert disk["blocks"] == 6
    assert disk["used_bytes"] == store.usage()["DISK"]["used_bytes"]
    table = CliRunner().invoke(main, ["stats", "--data-dir", str(data_dir)], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "total" in table.output
    assert all(len(line) <= 80 for line in table.output.splitlines())
    missing = CliRunner().invoke(main, ["stats", "--data-dir", str(tmp_path / "nothing")])
    assert missing.exit_code == 1 and "no DISK tier" in missing.output


def test_stats_refuses_url_and_data_dir_together(tmp_path):
    result = CliRunner().invoke(main, ["stats", "--url", "http://x", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "not both" in result.output
