"""bench/sglang_backend.py end to end on 8 MiB: both backends, same pages, rows with baselines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from tests.unit.server.conftest import REPO  # noqa: E402

pytestmark = pytest.mark.sglang


def test_sglang_backend_bench_writes_rows_against_hicache_file(tmp_path) -> None:
    out = tmp_path / "sglang_backend.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "sglang_backend.py"), "--total-bytes", "8MiB", "--repeats", "1",
         "--cpu-bytes", "4MiB", "--json", str(out), "--dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == "sglang_backend"
    assert [r["metric"] for r in data["rows"]] == ["put (backup to disk)", "get from disk (into the host pool)",
                                                   "batch_exists"]
    for row in data["rows"]:
        assert row["value"] > 0 and row["baseline"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["baseline"])
    assert "SGLang HiCacheFile" in done.stdout and "from its DISK tier" in done.stdout
    assert not list(tmp_path.glob("kvtier-sglang-bench-*")), "the bench left its work directory behind"
