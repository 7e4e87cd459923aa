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
