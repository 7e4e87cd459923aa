"""bench/: the shared plumbing (rows, timing, JSON) and bench/tiers.py end to end on 16 MiB."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import Case, Row, measure, write_json

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"metric", "value", "unit", "baseline", "ratio"}


def test_row_ratio_is_value_over_baseline_and_null_without_one():
    assert Row("m", 3.0, "GB/s", 2.0).ratio == 1.5
    assert Row("m", 3.0, "GB/s").ratio is None
    assert Row("m", 3.0, "GB/s").to_json() == {
        "metric": "m", "value": 3.0, "unit": "GB/s", "baseline": None, "ratio": None,
    }


def test_write_json_schema(tmp_path):
    path = tmp_path / "sub" / "out.json"
    write_json(path, "demo", [Row("a", 4.0, "GB/s", 2.0, "copy"), Row("b", 1.0, "s")])
    data = json.loads(path.read_text())
    assert data == {
        "bench": "demo",
        "rows": [
            {"metric": "a", "value": 4.0, "unit": "GB/s", "baseline": 2.0, "ratio": 2.0},
            {"metric": "b", "value": 1.0, "unit": "s", "baseline": None, "ratio": None},
        ],
    }


def test_measure_interleaves_cases_after_warmup():
    calls: list[str] = []
    cases = [
        Case(lambda: calls.append("a"), before=lambda: calls.append("before-a")),
        Case(lambda: calls.append("b")),
    ]
    timings = measure(cases, repeats=2, warmup=1)
    assert calls == ["before-a", "a", "b"] * 3
    assert [len(t.samples_s) for t in timings] == [2, 2]  # the warm-up round is not kept
    assert all(t.best_s <= t.median_s for t in timings)
    with pytest.raises(ValueError):
        measure(cases, repeats=0)


@pytest.mark.slow  # runs bench/tiers.py end to end
def test_tiers_bench_writes_rows_with_same_run_baselines(tmp_path):
    out = tmp_path / "tiers.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "tiers.py"), "--total-bytes", "16MiB", "--repeats", "1",
         "--open-bytes", "16MiB", "--json", str(out), "--dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "LMCache 0.5.6 reference" in proc.stdout  # the footnote is printed as text
    data = json.loads(out.read_text())
    assert data["bench"] == "tiers"
    metrics = [row["metric"] for row in data["rows"]]
    for prefix in ("GPU put", "GPU get", "CPU put", "CPU get", "DISK put", "DISK put into a fresh tier", "DISK get",
                   "DISK open"):
        assert any(m.startswith(prefix) for m in metrics), f"no {prefix} row in {metrics}"
    floor = [m for m in metrics if "floor" in m]
    assert floor == ["  floor of that store: copy to a mapped file + copy in, hashed (numpy), 2 threads",
                     "  DISK spill: store() into full CPU slab, vs its floor"], floor
    by = {row["metric"]: row for row in data["rows"]}
    spill = by["DISK spill: store() into full CPU slab"]
    assert by[floor[0]]["baseline"] == spill["baseline"]  # the floor against the same raw write
    assert by[floor[1]]["value"] == spill["value"] and by[floor[1]]["baseline"] == by[floor[0]]["value"]
    opened = {row["unit"]: row for row in data["rows"] if row["metric"].startswith("DISK open")}
    assert set(opened) == {"ms", "MB"} and 0 < opened["MB"]["baseline"] and opened["ms"]["value"] > 0
    assert opened["MB"]["ratio"] < 0.5  # the index, not the records, is read on open
    for row in data["rows"]:
        assert set(row) == ROW_KEYS
        if row["metric"].startswith("DISK open"):
            continue
        assert row["value"] > 0 and row["unit"] == "GB/s"
        assert row["baseline"] is not None and row["baseline"] > 0  # every tier row has one here
        assert math.isclose(row["ratio"], row["value"] / row["baseline"], rel_tol=1e-9)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the bench removed its temp dir


@pytest.mark.slow  # runs bench/transfers.py's throughput rows end to end
def test_transfers_bench_writes_the_spill_rows_beside_their_floors(tmp_path):
    """The spill and the store into a full slab, each beside the same run's raw write and the
    floor of the same work without kvtier (bench.tiers.StoreFloor, checked by the bench)."""
    out = tmp_path / "transfers.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "transfers.py"), "--total-bytes", "16MiB", "--repeats", "1",
         "--skip-overlap", "--json", str(out), "--dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {row["metric"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows)[1:] == [
        "CPU -> DISK spill: evict a full CPU slab", "  floor of that spill: copy to a mapped file (numpy), 2 threads",
        "  CPU -> DISK spill vs its floor", "store() into a full CPU slab (copy in + spill)",
        "  floor of that store: copy to a mapped file + copy in, hashed (numpy), 2 threads", "  store() into a full CPU slab vs its floor",
    ], list(rows)
    for row in rows.values():
        assert set(row) == ROW_KEYS and row["unit"] == "GB/s" and row["value"] > 0 and row["baseline"] > 0
        assert math.isclose(row["ratio"], row["value"] / row["baseline"], rel_tol=1e-9)
    raw = rows["CPU -> DISK spill: evict a full CPU slab"]["baseline"]
    for kind in ("spill", "store"):  # the floor's row is against the raw write, kvtier's against the floor
        floor = next(r for m, r in rows.items() if m.startswith(f"  floor of that {kind}"))
        against = next(r for m, r in rows.items() if m.endswith("vs its floor") and (kind in m.lower()))
        assert floor["baseline"] == raw and against["baseline"] == floor["value"]
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the bench removed its temp dir


def test_floor_rows_compare_the_floor_to_the_raw_write_and_kvtier_to_the_floor_and_warn_when_kvtier_beats_it():
    from bench.tiers import floor_rows

    rows, warning = floor_rows("  floor", "  kvtier vs its floor", 2.0, 2.5, 5.0)
    assert [(r.metric, r.value, r.baseline) for r in rows] == [("  floor", 2.5, 5.0), ("  kvtier vs its floor", 2.0, 2.5)]
    assert [r.ratio for r in rows] == [0.5, 0.8] and warning == ""
    _, warning = floor_rows("  floor", "  kvtier vs its floor", 3.0, 2.5, 5.0)
    assert warning.startswith("warning: kvtier vs its floor: kvtier ran faster than its floor (3.00 vs 2.50 GB/s)")


def test_disk_warmup_rounds_cover_the_data_file_once_and_refuse_empty_rounds(tmp_path):
    from bench.common import disk_warmup_rounds

    (tmp_path / "data.mdb").write_bytes(b"x" * 1000)
    disk = type("Disk", (), {"path": tmp_path})()
    assert disk_warmup_rounds(disk, 100) == 11  # ten rounds to cover it, one more
    assert disk_warmup_rounds(disk, 300) == 5 and disk_warmup_rounds(disk, 5000) == 2
    for bad in (0, -1):  # 0 meant 1 byte a round: 151 million rounds on a 144 MiB map (review, 2026-12-03)
        with pytest.raises(ValueError, match="round_nbytes > 0"):
            disk_warmup_rounds(disk, bad)


def test_mapped_file_is_sparse_or_holds_its_content_and_is_deleted_on_close(tmp_path):
    from bench.common import MappedFile

    sparse = MappedFile(tmp_path / "a.bin", 1 << 20)
    assert sparse.array.shape == (1 << 20,) and not sparse.array.any()
    sparse.array[:3] = [1, 2, 3]
    sparse.close()
    held = MappedFile(tmp_path / "b.bin", 4, b"kvtr", read_only=True)
    assert bytes(held.array) == b"kvtr" and not held.array.flags.writeable
    held.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("copy_in", [True, False])
def test_store_floor_does_the_whole_work_on_each_thread_count(tmp_path, threads, copy_in):
    """Every block hashed, copied out and (with copy_in) replaced, whatever the split; a part
    left undone fails the floor's own check."""
    import torch

    from bench.tiers import StoreFloor

    src = torch.arange(7 * 4096, dtype=torch.int32).view(7, 4096)
    floor = StoreFloor(tmp_path / "floor.bin", src, copy_in=copy_in, threads=threads)
    try:
        assert floor.what.endswith(f"{threads} thread" + "s" * (threads > 1))
        floor.run()
        floor.check()
        assert (floor.out == src.view(torch.uint8).numpy()[::-1]).all()  # the victims, spilled
        floor._parts = floor._parts[:-1] if threads > 1 else [(0, 6)]  # a part left undone
        floor.out[6] = 0xA5
        floor.slab[:] = floor.src[::-1]
        floor.run()
        with pytest.raises(AssertionError):
            floor.check()
    finally:
        floor.close()
    assert list(tmp_path.iterdir()) == []


def test_kv_bytes_rows_follow_from_the_layout(tmp_path):
    """Gemma-3-27B: 62 layers (every 6th full), 16 K/V heads of 128, window 1024, bfloat16."""
    from bench.kv_bytes import rows_for

    rows = {row.metric: row for row in rows_for(16)}
    per_layer = 2 * 16 * 128 * 2  # bytes per token and layer: K and V
    every = rows["Gemma-3-27B (5:1, window 1024): kvtier, every position"]
    assert every.value * 1024 == 62 * per_layer
    windowed = rows["Gemma-3-27B (5:1, window 1024) @32k: window-only"]
    sliding_tokens = (1023 // 16 + 1 + 1) * 16  # blocks covering the last 1024 positions
    expected = (10 * per_layer * 32768 + 52 * per_layer * sliding_tokens) / 32768
    assert windowed.value * 1024 == pytest.approx(expected)
    assert windowed.baseline == every.value and windowed.ratio == pytest.approx(expected / (62 * per_layer))
    assert rows["Mistral-7B-v0.1 (sliding 4096) @4k: window-only"].ratio == 1.0  # the window holds the whole cut


@pytest.mark.slow
def test_hit_path_bench_checks_the_hit_and_writes_rows_with_same_run_baselines(tmp_path):
    """tiny-llama (2 layers), one 64-token prefix: before_prefill from CPU, from DISK and from
    CPU without a kept host buffer, each beside one copy_ of the same bytes; the bench itself
    asserts the hit is bit-exact."""
    out = tmp_path / "hit.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "hit_path.py"), "--model", "tiny-llama", "--lengths", "64",
         "--repeats", "1", "--threads", "1", "--json", str(out), "--dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    metrics = [row["metric"] for row in rows]
    assert any(m.startswith("before_prefill: CPU hit, 64 tokens") for m in metrics), metrics
    assert any(m.startswith("before_prefill: DISK hit, 64 tokens") for m in metrics), metrics
    assert any("DiskTier.read_into" in m for m in metrics), metrics
    floor = [row for row in rows if row["metric"].startswith("  floor of a verified read")]
    disk = [row for row in rows if row["metric"].startswith("before_prefill: DISK hit, 64 tokens")]
    assert len(floor) == 1 and floor[0]["metric"].endswith("64 tokens") and len(disk) == 1, metrics
    assert floor[0]["baseline"] == disk[0]["baseline"]  # timed in the same rounds, against the same copy
    assert any(m.startswith("before_prefill: CPU hit, 64 tokens") and m.endswith("no kept buffer") for m in metrics)
    for row in rows:
        assert set(row) == ROW_KEYS and row["unit"] == "ms" and row["value"] > 0 and row["baseline"] > 0
        assert math.isclose(row["ratio"], row["value"] / row["baseline"], rel_tol=1e-9)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the bench removed its temp dir


@pytest.mark.slow
def test_prefix_attention_bench_checks_the_logits_and_writes_rows_with_same_run_baselines(tmp_path):
    """tiny-llama, a 16-token hit on a 256-token prompt: TTFT with the prefix attention beside
    the masked prefill and no cache, and SDPA's kernel time; the bench asserts the logits."""
    out = tmp_path / "prefix.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "prefix_attention.py"), "--model", "tiny-llama", "--lengths", "256",
         "--hits", "16", "--repeats", "1", "--threads", "1", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "prefix_attention"
    metrics = [row["metric"] for row in doc["rows"]]
    assert metrics == ["TTFT after a 16-token hit, 256-token prompt",
                       "TTFT after a 16-token hit, 256-token prompt, vs no cache",
                       "  TTFT with the masked SDPA vs no cache: 16-token hit, 256-token prompt",
                       "  SDPA kernel time, 16-token hit, 256-token prompt"], metrics
    for row in doc["rows"]:
        assert set(row) == ROW_KEYS and row["unit"] == "ms" and row["value"] > 0 and row["baseline"] > 0
        assert math.isclose(row["ratio"], row["value"] / row["baseline"], rel_tol=1e-9)
