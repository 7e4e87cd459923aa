"""bench/metrics_overhead.py runs (store loop only, tiny) and writes its rows and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the benchmark end to end

REPO = Path(__file__).resolve().parents[2]


def test_metrics_overhead_bench_writes_rows_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "overhead.json", tmp_path / "overhead.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "metrics_overhead.py"), "--skip-demo", "--repeats", "1",
         "--loop-requests", "5", "--hook-calls", "1000", "--threads", "1", "--json", str(out), "--plot", str(png)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["bench"] == "metrics_overhead"
    rows = {r["metric"].split(",")[0].split(":")[0]: r for r in doc["rows"]}
    assert set(rows) == {"store loop", "latency hook", "scrape"}
    loop = rows["store loop"]
    assert loop["value"] > 0 and loop["baseline"] > 0
    assert loop["ratio"] == pytest.approx(loop["value"] / loop["baseline"])
    assert rows["latency hook"]["value"] > 0 and rows["scrape"]["value"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
