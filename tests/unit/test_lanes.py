"""The fast-lane plugin (kvtier.testing.lanes): two xdist workers for `-m "not slow"` only."""

from __future__ import annotations

import pytest

from kvtier.testing import lanes


class _Plugins:
    def __init__(self, xdist: bool) -> None:
        self.xdist = xdist

    def hasplugin(self, name: str) -> bool:
        return self.xdist and name == "xdist"


class _EarlyConfig:
    def __init__(self, xdist: bool = True) -> None:
        self.pluginmanager = _Plugins(xdist)


def _rewritten(args: list[str], xdist: bool = True) -> list[str]:
    args = list(args)
    lanes.pytest_load_initial_conftests(_EarlyConfig(xdist), None, args)
    return args


@pytest.fixture(autouse=True)
def _not_a_worker(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


@pytest.mark.parametrize("args", [["-m", "not slow"], ["-q", "-m", "not slow", "tests/unit"], ["-mnot slow"]])
def test_the_fast_lane_gets_two_workers(args, monkeypatch):
    monkeypatch.setattr(lanes.os, "cpu_count", lambda: 8)
    assert _rewritten(args) == ["-n", "2", *args]


@pytest.mark.parametrize("args", [[], ["-q"], ["-m", "slow"], ["-m", "not slow and not vllm"], ["tests/unit"],
                                  ["-m", "not slow", "-n", "0"], ["-m", "not slow", "-n4"],
                                  ["-m", "not slow", "--numprocesses=3"], ["-m", "not slow", "-p", "no:xdist"]])
def test_everything_else_is_left_as_typed(args):
    assert _rewritten(args) == args


def test_without_xdist_or_inside_a_worker_nothing_changes(monkeypatch):
    assert _rewritten(["-m", "not slow"], xdist=False) == ["-m", "not slow"]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert _rewritten(["-m", "not slow"]) == ["-m", "not slow"]


def test_one_core_gets_one_worker(monkeypatch):
    monkeypatch.setattr(lanes.os, "cpu_count", lambda: 1)
    assert _rewritten(["-m", "not slow"]) == ["-n", "1", "-m", "not slow"]


def test_bytecode_is_kept_between_runs_even_where_the_environment_turned_it_off(monkeypatch):
    monkeypatch.setattr(lanes.sys, "dont_write_bytecode", True)
    _rewritten(["-q"])
    assert lanes.sys.dont_write_bytecode is False
