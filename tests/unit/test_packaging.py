"""Install metadata: triton is a dependency on Linux x86_64 only (its only wheels), so
``pip install .`` resolves on macOS, Windows and Linux aarch64 without it; kvtier imports
triton only for CUDA tensors (tests/unit/app/test_app_layer.py checks the CPU path never does).

pip cannot check this with ``--dry-run --platform``: it evaluates markers against the running
interpreter, not the target platform, so the marker is evaluated here for each platform.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _requirements():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(spec) for spec in project["dependencies"]]


@pytest.mark.parametrize(
    "system, machine, wanted",
    [("Linux", "x86_64", True), ("Linux", "aarch64", False), ("Darwin", "arm64", False),
     ("Darwin", "x86_64", False), ("Windows", "AMD64", False)],
)
def test_triton_is_required_only_where_it_has_wheels(system: str, machine: str, wanted: bool) -> None:
    triton = [r for r in _requirements() if r.name == "triton"]
    assert len(triton) == 1 and triton[0].marker is not None
    assert triton[0].marker.evaluate({"platform_system": system, "platform_machine": machine}) is wanted


def test_every_other_dependency_applies_everywhere() -> None:
    assert [r.name for r in _requirements() if r.marker is not None] == ["triton"]


def test_the_host_copy_kernels_source_ships_in_the_package() -> None:
    # kvtier.kernels.host_copy compiles host_copy.c on first use: a wheel must carry it
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.c" in data["kvtier.kernels"]
    assert (REPO_ROOT / "kernels" / "host_copy.c").is_file()


def test_the_source_tree_does_not_shadow_the_top_level_kernels_package() -> None:
    # transformers >= 5.25 requires PyPI's `kernels` and imports it when its metadata is
    # installed: with the repo root on sys.path (pytest's rootdir, `python -m` from the root),
    # a kernels/__init__.py here won that import and every model load failed with
    # "cannot import name 'CUDAProperties' from 'kernels'" (2026-12-03, a fresh clone)
    import subprocess
    import sys

    assert not (REPO_ROOT / "kernels" / "__init__.py").exists()
    code = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec is not None and spec.origin else '-')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert not out.stdout.strip().startswith(str(REPO_ROOT / "kernels")), out.stdout  # PyPI's, or none at all
    import kvtier.kernels as kernels

    assert kernels.__name__ == "kvtier.kernels" and callable(kernels.gather_blocks_to_paged)


def test_the_package_links_every_kernel_source() -> None:
    # kvtier/kernels holds __init__.py and one symlink per file of kernels/ (what a wheel ships)
    sources = {p.name for p in (REPO_ROOT / "kernels").iterdir() if p.suffix in (".py", ".c")}
    package = REPO_ROOT / "kvtier" / "kernels"
    linked = {p.name for p in package.iterdir() if p.is_symlink()}
    assert sources and linked == sources
    for name in sources:
        assert (package / name).resolve() == (REPO_ROOT / "kernels" / name).resolve()
    assert (package / "__init__.py").is_file() and not (package / "__init__.py").is_symlink()
