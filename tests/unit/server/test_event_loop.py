"""The daemon's event loop (kvtier.server.loop): uvloop when installed, asyncio's otherwise,
chosen by ``KVTIER_EVENT_LOOP``; the daemon serves the same bytes on either."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.records import ReadStatus
from kvtier.server.loop import loop_factory, run
from kvtier.server.settings import ServeConfig
from kvtier.tiers.remote import RemoteTier
from tests.conftest import random_blocks
from tests.unit.server.conftest import NAMESPACE, SPEC, hashes


def test_asyncio_is_always_there_and_unknown_loops_are_refused():
    factory, name = loop_factory("asyncio")
    assert factory is asyncio.new_event_loop and name == "asyncio"
    with pytest.raises(ValueError, match="event loop"):
        loop_factory("trio")


def test_auto_takes_uvloop_when_installed_and_asyncio_without(monkeypatch):
    uvloop = pytest.importorskip("uvloop")
    factory, name = loop_factory("auto")
    assert factory is uvloop.new_event_loop and name == f"uvloop {uvloop.__version__}"
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop_factory("auto") == (asyncio.new_event_loop, "asyncio")
    with pytest.raises(ValueError, match="kvtier\\[fast\\]"):
        loop_factory("uvloop")


@pytest.mark.parametrize("choice", ["asyncio", "uvloop"])
def test_run_runs_on_the_chosen_loop(choice):
    if choice == "uvloop":
        pytest.importorskip("uvloop")

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(which(), choice).startswith(choice)


def test_the_setting_comes_from_the_environment_and_is_checked(tmp_path):
    store = StoreConfig(data_dir=tmp_path)
    assert ServeConfig.from_options(store, {}, {}).event_loop == "auto"
    assert ServeConfig.from_options(store, {}, {"KVTIER_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(ValueError, match="event_loop"):
        ServeConfig.from_options(store, {}, {"KVTIER_EVENT_LOOP": "gevent"})


@pytest.mark.slow  # two daemon processes (torch imports): the fast lane covers both loops in-process
@pytest.mark.parametrize("choice", ["asyncio", "uvloop"])
def test_the_daemon_says_its_loop_and_serves_the_same_bytes_on_it(spawn, choice):
    if choice == "uvloop":
        pytest.importorskip("uvloop")
    daemon = spawn(env={"KVTIER_EVENT_LOOP": choice})
    assert f"event loop {choice}" in daemon.announce
    tier = RemoteTier(daemon.url, timeout_s=10.0)
    try:
        tier.register(NAMESPACE, SPEC)
        hs, blocks = hashes(6), random_blocks(SPEC, 6, seed=3)
        assert tier.put(NAMESPACE, hs[:5], blocks[:5]) == [True] * 5
        assert tier.lookup(NAMESPACE, hs) == 5
        outs = [torch.empty_like(b) for b in blocks]
        assert tier.get_into(NAMESPACE, hs, outs) == [ReadStatus.OK] * 5 + [ReadStatus.MISSING]
        assert all(torch.equal(o.view(torch.uint8), b.view(torch.uint8)) for o, b in zip(outs[:5], blocks[:5]))
        assert not tier.errors
    finally:
        tier.close()
