"""examples/router.py end to end: engine processes publish KV events, the router follows them
and routes each request to the engine holding its longest cached prefix; that beats round robin."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kvtier.app.traces import sharegpt_requests
from tests.unit.app.test_replay import fake_conversations

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
router = pytest.importorskip("router")

pytestmark = pytest.mark.slow  # spawns engine processes (each imports torch)


def test_prefix_routing_from_events_beats_round_robin(tmp_path):
    requests = sharegpt_requests(24, 5, conversations=fake_conversations(30, seed=3), mean_think_s=5.0)
    results = {}
    for policy in ("round_robin", "prefix"):
        procs, urls = router.start_engines(2, gpu_blocks=128, cpu_blocks=256, data_dir=str(tmp_path / policy))
        try:
            results[policy] = asyncio.run(router.route_all(urls, requests, policy))
        finally:
            router.stop_engines(procs)
    rr, prefix = results["round_robin"], results["prefix"]
    assert rr["prompt_tokens"] == prefix["prompt_tokens"] == sum(len(r.prompt) for r in requests)
    assert prefix["hit_rate"] > rr["hit_rate"] + 0.15, results
    assert min(prefix["requests_per_engine"]) > 0.25 * len(requests)  # users spread, not all on one engine
