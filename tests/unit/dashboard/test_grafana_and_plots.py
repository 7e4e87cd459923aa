"""examples/grafana/kvtier.json uses the metric names kvtier exports; plots write PNGs."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import metrics
from tests.conftest import MemoryRemote, chain, tiny_spec

GRAFANA = Path(__file__).resolve().parents[3] / "examples" / "grafana" / "kvtier.json"


def exported_names(make_store, namespace) -> set[str]:
    """Every sample name kvtier exports, from a store with every tier (REMOTE included)."""
    store = make_store(gpu_blocks=2, cpu_blocks=2, disk_blocks=4, remote=MemoryRemote())
    store.lookup(chain(1, tiny_spec(), namespace))
    store.stats.store_failures["disk_full"] += 1  # so that the family has a sample to show
    store.remote.errors["timeout"] += 1
    registry = CollectorRegistry()
    metrics.register(store, registry)
    text = generate_latest(registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_grafana_dashboard_queries_only_exported_metrics(make_store, namespace):
    doc = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bkvtier_[a-z_]+", e)}
    names = exported_names(make_store, namespace)
    assert used, "the dashboard queries no kvtier metric"
    assert used <= names, f"not exported: {sorted(used - names)}"
    for family in ("kvtier_hit_tokens_total", "kvtier_lookup_tokens_total", "kvtier_moved_bytes_total",
                   "kvtier_used_bytes", "kvtier_operation_duration_seconds_bucket", "kvtier_evicted_blocks_total",
                   "kvtier_load_failures_total"):
        assert family in used, f"the dashboard does not show {family}"
    for e in exprs:  # counters are read through rate(), never as raw totals
        for counter in re.findall(r"\bkvtier_[a-z_]+_total\b|\bkvtier_[a-z_]+_bucket\b", e):
            assert re.search(rf"rate\({counter}\{{", e), (counter, e)
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "namespace"]
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow  # draws every plot with matplotlib
def test_demo_and_bench_plots(tmp_path):
    plots = pytest.importorskip("kvtier.app.plots")
    pytest.importorskip("matplotlib")
    turns = [{"conversation": c, "turn": t, "prompt_tokens": 100 * t, "cached_tokens": 90 * (t - 1),
              "ttft_without_s": 0.1 * t, "ttft_with_s": 0.05} for c in (1, 2) for t in (1, 2, 3)]
    demo = plots.plot_demo({"turns": turns, "model_id": "tiny"}, tmp_path / "demo" / "ttft.png")
    width, height = png_size(demo)
    assert width > 500 and height > 300
    rows = [{"metric": "CPU put", "value": 6.5, "unit": "GB/s", "baseline": 6.8, "ratio": 6.5 / 6.8},
            {"metric": "TTFT", "value": 120.0, "unit": "ms", "baseline": None, "ratio": None}]
    bench = plots.plot_bench({"bench": "tiers", "rows": rows}, tmp_path / "tiers.png")
    assert png_size(bench)[0] > 500
    (tmp_path / "tiers.json").write_text(json.dumps({"bench": "tiers", "rows": rows}))
    assert png_size(plots.plot_file(tmp_path / "tiers.json", tmp_path / "again.png")) == png_size(bench)
    with pytest.raises(ValueError, match="at least one turn"):
        plots.plot_demo({"turns": []}, tmp_path / "empty.png")
    with pytest.raises(ValueError, match="benchmark rows"):
        plots.plot_bench({"bench": "x", "rows": []}, tmp_path / "empty.png")


def test_demo_and_benchmarks_take_a_plot_path():
    from click.testing import CliRunner

    from bench.common import arg_parser
    from kvtier.app.cli import main

    assert "--plot" in CliRunner().invoke(main, ["demo", "--help"]).output
    assert arg_parser("x").parse_args(["--plot", "out.png"]).plot == Path("out.png")
