"""bench/server.py end to end on a few blocks: it starts both servers, writes rows with
same-run Redis baselines and leaves no process or temp dir behind."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the benchmark against a daemon and redis-server

REPO = Path(__file__).resolve().parents[2]


def _run_bench(name: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``bench/<name>.py --json out *args`` against a redis-server of its own: (process, JSON)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH (apt-get install redis-server)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), *args, "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


def test_server_bench_writes_rows_with_redis_baselines(tmp_path):
    out = tmp_path / "server.json"
    proc, data = _run_bench(
        "server", out, "--total-bytes", "8MiB", "--batch-blocks", "2", "--repeats", "1", "--lookup-blocks", "4",
        "--lookup-calls", "20", "--clients", "2", "--client-procs", "0", "--latency-seconds", "0.2",
        "--latency-rounds", "1", "--lookup-rate", "20", "--mixed-blocks", "2", "--dir", str(tmp_path))
    assert data["bench"] == "server"
    rows = {row["metric"]: row for row in data["rows"]}
    who = "2 clients (threads)"
    mixed = "mixed 70/20/10 lookup/get/put (2 x 2 MiB), 2 clients"
    units = {
        "batch put (2 x 2 MiB a call)": "GB/s",
        "batch get (2 x 2 MiB a call, verified)": "GB/s",
        "lookup of 4 blocks, 1 client": "requests/s",
        f"lookup of 4 blocks, {who}, closed loop": "requests/s",
        f"lookup p50 latency, {who}, closed loop": "ms",
        f"lookup p99 latency, {who}, closed loop": "ms",
        f"lookup p50 latency, {who} x 20/s": "ms",
        f"lookup p99 latency, {who} x 20/s": "ms",
        f"{mixed}: calls/s": "calls/s",
        f"{mixed}: p50 latency": "ms",
        f"{mixed}: p99 latency": "ms",
        f"{mixed}: lookup p99 latency": "ms",
        "batch put: server CPU": "ms CPU/GB",
        "batch put: client CPU": "ms CPU/GB",
        "batch get: server CPU": "ms CPU/GB",
        "batch get: client CPU": "ms CPU/GB",
        "lookup of 4 blocks: server CPU": "us CPU/request",
        "lookup of 4 blocks: client CPU": "us CPU/request",
        "RedisTier put (records) vs raw redis-py SET": "GB/s",
        "RedisTier get (verified) vs raw redis-py GET": "GB/s",
    }
    assert {m: r["unit"] for m, r in rows.items()} == units
    for row in data["rows"]:
        if "server CPU" in row["metric"]:  # /proc's 10 ms clock ticks: a short run may see 0
            assert row["value"] >= 0 and row["baseline"] >= 0
            continue
        assert row["value"] > 0 and row["baseline"] > 0
        assert math.isclose(row["ratio"], row["value"] / row["baseline"], rel_tol=1e-9)
    for load in ("closed loop", "x 20/s"):
        assert rows[f"lookup p99 latency, {who}, {load}".replace(", x", " x")]["value"] >= \
            rows[f"lookup p50 latency, {who}, {load}".replace(", x", " x")]["value"]
    assert rows[f"{mixed}: p99 latency"]["value"] >= rows[f"{mixed}: p50 latency"]["value"]
    assert "Mixed workload: blocks gets missed, daemon" in " ".join(proc.stdout.split())  # footnote, wrapped
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the bench removed its temp dir


def test_redis_limits_bench_writes_guarded_rows_with_plain_baselines(tmp_path):
    _, data = _run_bench("redis_limits", tmp_path / "redis_limits.json", "--total-bytes", "4MiB",
                         "--batch-blocks", "2", "--repeats", "1", "--lookup-blocks", "4", "--lookup-calls", "10")
    assert data["bench"] == "redis_limits"
    assert {row["metric"]: row["unit"] for row in data["rows"]} == {
        "get, 2048 KiB values, 2 per pipeline": "GB/s",
        "put, 2048 KiB values, 2 per pipeline": "GB/s",
        "get, 16 KiB values, 256 per pipeline": "GB/s",
        "put, 16 KiB values, 256 per pipeline": "GB/s",
        "lookup, EXISTS x 4": "lookups/s",
    }
    for row in data["rows"]:
        assert row["value"] > 0 and row["baseline"] > 0
        assert math.isclose(row["ratio"], row["value"] / row["baseline"], rel_tol=1e-9)
