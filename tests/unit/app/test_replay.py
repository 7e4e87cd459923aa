"""``kvtier replay``: traces (a store's own, Mooncake's, ShareGPT users), kvtier's policy
against a real run of the store, LRU's one-pass curves against a plain OrderedDict LRU."""

from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner

from kvtier.app.cli import main
from kvtier.app.replay import (
    KvtierReplay, replay_kvtier, replay_ordered_dict_lru, run_store, stack_distances,
)
from kvtier.app.replay_cli import WITHIN, recommend
from kvtier.app.traces import Trace, read_trace, sharegpt_trace, write_trace
from kvtier.config import StoreConfig
from kvtier.store import TieredStore
from kvtier.store.trace import hash_id
from kvtier.tiers.disk import record_footprint
from kvtier.types import KVSpec

SPEC = KVSpec(1, 1, 1, 16, torch.float16)


def fake_conversations(n: int, seed: int = 0) -> list[list[tuple[str, str]]]:
    """Multi-turn chats of random words (long enough to span many blocks)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(3000)]

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    return [[(text(rng.randrange(20, 120)), text(rng.randrange(20, 160))) for _ in range(rng.randrange(2, 7))]
            for _ in range(n)]


@pytest.fixture(scope="module")
def trace() -> Trace:
    return sharegpt_trace(num_users=60, max_turns=6, conversations=fake_conversations(80), mean_think_s=5.0)


def test_sharegpt_trace_is_multi_turn_users_in_arrival_order(trace):
    loads = [ids for op, ids, _ in trace.requests if op == "load"]
    stores = [ids for op, ids, _ in trace.requests if op == "store"]
    assert len(loads) == len(stores) and [op for op, _, _ in trace.requests[:4]] == ["load", "store"] * 2
    # a later turn's prompt starts with the blocks the same user stored before: prefix reuse
    reused = sum(1 for i, ids in enumerate(loads) if ids and any(ids[0] == s[0] for s in stores[:i] if s))
    assert reused > len(loads) / 2
    assert trace.block_requests == sum(len(ids) for ids in loads) and trace.unique_blocks > 1000


def real_run(tmp_path, trace: Trace, gpu: int, cpu: int, disk: int) -> tuple:
    config = StoreConfig(
        gpu_bytes=gpu * SPEC.block_nbytes, cpu_bytes=cpu * SPEC.block_nbytes,
        disk_bytes=disk * record_footprint(SPEC.block_nbytes), block_size=16,
        data_dir=tmp_path / "run", flush_on_close=False, trace_path=tmp_path / "run" / "trace.jsonl",
    )
    store = TieredStore(SPEC, config, bytes(32), device="cpu", emulate_gpu=True)
    measured = run_store(trace, store)
    store.close()
    return measured, read_trace(tmp_path / "run" / "trace.jsonl")


def test_replay_equals_the_real_runs_hit_rate_within_one_point(tmp_path, trace):
    """The store records its own trace; replaying it at the run's capacities with kvtier's
    policy gives the run's measured hit rate (all tiers and each) within 1 percentage point."""
    unique = trace.unique_blocks
    measured, recorded = real_run(tmp_path, trace, unique // 20, unique // 8, unique // 3)
    assert recorded.tiers == {"GPU": unique // 20, "CPU": unique // 8, "DISK": unique // 3}
    assert recorded.block_requests == trace.block_requests == measured.lookups
    replayed = replay_kvtier(recorded, recorded.tiers)
    assert 0.2 < measured.hit_rate() < 0.95 and all(measured.hits.get(t, 0) > 0 for t in ("GPU", "CPU", "DISK"))
    assert abs(replayed.hit_rate() - measured.hit_rate()) <= 0.01
    for tier in ("GPU", "CPU", "DISK"):
        assert abs(replayed.hit_rate([tier]) - measured.hit_rate([tier])) <= 0.01, tier


def test_store_trace_holds_hash_ids_only(tmp_path, trace):
    _, recorded = real_run(tmp_path, Trace(16, trace.requests[:6]), 64, 64, 64)
    lines = (tmp_path / "run" / "trace.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    assert head["kvtier_trace"] == 1 and head["block_size"] == 16 and head["write_policy"] == "write_back"
    entries = [json.loads(line) for line in lines[1:]]
    assert [e["op"] for e in entries] == [op for op, _, _ in trace.requests[:6]]
    assert set().union(*(e.keys() for e in entries)) <= {"t", "op", "hash_ids", "num_tokens"}
    first = trace.requests[0]
    assert entries[0]["hash_ids"] == first[1] and entries[0]["num_tokens"] == first[2]
    assert hash_id(bytes(range(32))) == int.from_bytes(bytes(range(8)), "little")


@pytest.mark.parametrize("capacity", [1, 50, 400, 3000])
def test_lru_stack_distances_equal_an_ordered_dict_lru(trace, capacity):
    distances = stack_distances(trace)
    assert sum(distances.hits({"GPU": capacity}).values()) == replay_ordered_dict_lru(trace, capacity).hits["LRU"]
    split = distances.hits({"GPU": capacity // 3 or 1, "CPU": capacity - capacity // 3})
    assert sum(split.values()) == replay_ordered_dict_lru(trace, (capacity // 3 or 1) + capacity - capacity // 3).hits["LRU"]


def test_mooncake_trace(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
            {"timestamp": 5, "input_length": 1600, "output_length": 10, "hash_ids": [1, 2, 4, 5]},
            {"timestamp": 9, "input_length": 900, "output_length": 10, "hash_ids": [1, 6]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = read_trace(path)
    assert trace.block_size == 512 and trace.tiers is None and trace.block_requests == 9
    assert trace.requests[:2] == [("load", [1, 2, 3], 1500), ("store", [1, 2, 3], None)]
    assert replay_ordered_dict_lru(trace, 100).hits["LRU"] == 2 + 1
    assert replay_kvtier(trace, {"GPU": 100}).hits == {"GPU": 3}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1, "x"]}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_trace(bad)


def test_recommendation_is_the_smallest_capacity_within_one_percent_of_the_best():
    rows = [{"tier": "CPU", "policy": "kvtier", "capacity_blocks": c, "cumulative_hit_rate": h}
            for c, h in [(10, 0.30), (20, 0.55), (40, 0.596), (80, 0.60), (160, 0.601)]]
    (rec,) = recommend(rows)
    assert rec["capacity_blocks"] == 40 and rec["best_cumulative_hit_rate"] == 0.601
    assert rec["cumulative_hit_rate"] >= (1 - WITHIN) * 0.601


@pytest.mark.slow  # a real run, a grid of replays and a plot: several seconds
def test_replay_cli_table_json_and_plot(tmp_path, trace):
    pytest.importorskip("matplotlib")
    unique = trace.unique_blocks
    measured, recorded = real_run(tmp_path, trace, unique // 20, unique // 8, unique // 3)
    out, png = tmp_path / "rows.json", tmp_path / "curves.png"
    result = CliRunner().invoke(main, ["replay", str(tmp_path / "run" / "trace.jsonl"), "--points", "3", "--jobs", "1",
                                       "--refine", "2", "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    table = [line for line in result.output.splitlines() if " written to " not in line]  # paths are the user's
    assert all(len(line) <= 80 for line in table), result.output
    assert "recommended" in result.output and png.stat().st_size > 10_000
    doc = json.loads(out.read_text())
    keys = {"tier", "policy", "capacity_blocks", "hit_rate", "cumulative_hit_rate", "total_hit_rate", "configured"}
    assert doc["rows"] and all(set(r) == keys for r in doc["rows"])
    at_run = [r for r in doc["rows"] if r["policy"] == "kvtier" and r["configured"]]
    assert {r["tier"] for r in at_run} == {"GPU", "CPU", "DISK"}
    for r in at_run:  # the run's own capacities: the measured hit rate, within a point
        assert abs(r["total_hit_rate"] - measured.hit_rate()) <= 0.01
        assert abs(r["hit_rate"] - measured.hit_rate([r["tier"]])) <= 0.01
    assert {(r["tier"], r["policy"]) for r in doc["recommendations"]} == {
        (t, p) for t in ("GPU", "CPU", "DISK") for p in ("kvtier", "lru")}


def test_a_replay_without_a_tier_of_memory_is_refused():
    with pytest.raises(ValueError, match="GPU or CPU"):
        KvtierReplay({"DISK": 10})


def test_written_trace_reads_back(tmp_path, trace):
    write_trace(trace, tmp_path / "t.jsonl")
    again = read_trace(tmp_path / "t.jsonl")
    assert again.requests == trace.requests and again.block_size == trace.block_size

