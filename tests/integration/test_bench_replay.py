"""bench/replay.py end to end on a small ShareGPT trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # a subprocess that imports torch, reads ShareGPT and runs a real store
def test_replay_bench_writes_rows_and_agrees_with_its_real_run(tmp_path):
    """bench/replay.py end to end on a small ShareGPT trace: bench/common's JSON schema, speed
    rows against the same-run OrderedDict baseline, agreement rows within 1 point."""
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "replay_bench.json"
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(repo / "bench" / "replay.py"), "--users", "30", "--turns", "4", "--points", "3",
         "--min-block-requests", "1000", "--json", str(out), "--out-dir", str(tmp_path / "out")],
        cwd=repo, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["bench"] == "replay"
    rows = {row["metric"]: row for row in data["rows"]}
    speed = [r for r in data["rows"] if r["unit"] == "block req/s"]
    assert len(speed) == 3 and all(r["value"] > 0 and r["baseline"] > 0 for r in speed)
    agreement = [r for m, r in rows.items() if m.startswith("agreement")]
    assert len(agreement) == 4 and all(0 <= r["value"] <= 1.0 for r in agreement), agreement
    real = rows["real run: hit rate, all tiers"]["value"]
    assert 0 < real < 100
    assert abs(rows["replay at the run's capacities: hit rate, all tiers"]["value"] - real) <= 1.0
    doc = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert {r["tier"] for r in doc["rows"]} == {"GPU", "CPU", "DISK"}
    assert {r["policy"] for r in doc["rows"]} == {"kvtier", "lru"}
    assert abs(doc["real_run"]["hit_rate"] * 100 - real) < 1e-9
    assert (tmp_path / "out" / "replay.png").stat().st_size > 10_000
