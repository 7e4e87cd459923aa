"""bench/gpu.py's report logic and bench/gpu_run.sh's wrapper, without a GPU.

The steps themselves run in the CPU dry run (``bash bench/gpu_run.sh --dry-run``); here: the
issue-18 target verdicts, the vLLM step's rows from its passes' results, the JUnit counts, and
the shell wrapper's arguments, environment file and exit codes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.common import Row
from bench.gpu import TARGETS, _junit_counts, target_lines
from bench.gpu_vllm import vllm_rows

REPO = Path(__file__).resolve().parents[2]


def _line(lines: list[str], prefix: str) -> str:
    return next(line for line in lines if line.startswith(f"target {prefix}"))


def test_target_lines_judge_ratios_and_values_on_cuda_only():
    rows = [
        Row("H2D: store.load(), CPU-slab hits, requests of 32", 45.0, "GB/s", 50.0, "raw pinned copy_ H2D"),  # 0.90x
        Row("gather: Triton gather_blocks_to_contiguous, 512 blocks", 1.0, "GB/s", 2.0, "D2D"),  # 0.50x
        Row("overlap: share of load time hidden, 2048-token layers", 95.0, "%"),
        Row("TTFT 32k cached + 256 new: kvtier, GPU-pool hit", 6.0, "ms", 100.0, "full prefill"),  # 0.06x
        Row("TTFT 32k cached + 256 new: kvtier, CPU-slab hit (H2D)", 4.0, "ms", 100.0, "full prefill"),  # 0.04x
        Row("tests: failed or errors", 0.0, "tests"),
    ]
    lines = target_lines(rows, cuda=True)
    assert _line(lines, "H2D: store.load()").endswith("0.900x of raw pinned copy_ H2D PASS")
    assert _line(lines, "gather: Triton").endswith("FAIL")
    assert _line(lines, "overlap:").endswith("95.0 % PASS")
    assert _line(lines, "TTFT 32k cached + 256 new: kvtier, GPU-pool hit").endswith("0.060x of full prefill FAIL")
    assert _line(lines, "TTFT 32k cached + 256 new: kvtier, CPU-slab hit").endswith("PASS")
    assert _line(lines, "vLLM TTFT").endswith("not measured")
    assert lines[-1] == "tests: PASS (0 failed or errors)"
    assert len(lines) == len(TARGETS) + 1
    dry = target_lines(rows, cuda=False)
    assert all("PASS" not in line and "FAIL" not in line for line in dry[:-1])
    assert _line(dry, "H2D: store.load()").endswith("n/a (CPU dry run)")


def _turn(ttft_s: float, token: int, loaded: dict | None = None) -> dict:
    return {"ttft_s": ttft_s, "token": token, "num_cached_tokens": 0,
            "kvtier": None if loaded is None else {"loaded_tokens": loaded}}


def test_vllm_rows_compare_each_kvtier_case_with_the_full_prefill():
    results = {
        "kvtier": {"turns": {"32768": [_turn(0.5, 7, {"DISK": 32768}), _turn(0.2, 7, {"CPU": 32768}),
                                       _turn(0.4, 9, {"CPU": 32768})]}},
        "vllm": {"turns": {"32768": [_turn(10.0, 7), _turn(12.0, 7), _turn(8.0, 9),
                                     dict(_turn(0.1, 3), own_hit=True)]}},
    }
    rows = {row.metric: row for row in vllm_rows(results, 256)}
    label = "vLLM TTFT 32k cached + 256 new"
    disk = rows[f"{label}: kvtier after a restart (DISK)"]
    assert (disk.value, disk.baseline) == (500.0, 10_000.0)  # ms; the baseline is the median full prefill
    assert rows[f"{label}: kvtier CPU-pool hit"].value == pytest.approx(300.0)  # median of the later turns
    assert rows[f"{label}: vLLM's own prefix cache hit"].value == pytest.approx(100.0)
    loaded = rows[f"{label}: tokens kvtier loaded, first turn"]
    assert (loaded.value, loaded.baseline) == (32768.0, 32768.0)
    same = rows["vLLM: first tokens equal to vLLM alone's (random weights: ties may flip)"]
    assert (same.value, same.baseline) == (3.0, 3.0)


def test_junit_counts_sum_suites_and_refuse_a_broken_file(tmp_path):
    path = tmp_path / "pytest.xml"
    path.write_text('<testsuites><testsuite tests="5" failures="1" errors="1" skipped="2"/>'
                    '<testsuite tests="3" failures="0" errors="0" skipped="1"/></testsuites>')
    assert _junit_counts(path) == (8, 2, 3)
    path.write_text("<testsuites")
    assert _junit_counts(path) is None
    assert _junit_counts(tmp_path / "absent.xml") is None


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the wrapper would start the real run")
def test_gpu_run_sh_writes_env_and_exits_2_without_cuda_or_on_a_bad_step(tmp_path):
    """The wrapper on this (CPU) machine: no CUDA -> 2; --dry-run passes --device cpu through
    (an unknown step then stops it with 2 before any work); env.txt names the versions."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), KVTIER_WHEEL_SITE=str(tmp_path / "site"), PYTHON=sys.executable)
    script = REPO / "bench" / "gpu_run.sh"
    no_cuda = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert no_cuda.returncode == 2, no_cuda.stderr[-2000:]
    assert "no CUDA device" in no_cuda.stderr
    text = (tmp_path / "out" / "env.txt").read_text()
    assert "torch " in text and "device: no CUDA" in text and "carried wheels:" in text
    bad = subprocess.run(["bash", str(script), "--dry-run", "--steps", "nosuchstep"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "unknown steps ['nosuchstep']" in bad.stderr, bad.stderr[-2000:]
