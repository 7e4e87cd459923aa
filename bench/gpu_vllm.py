"""``bench/gpu.py`` step ``vllm``: TTFT of a turn whose history kvtier holds, after an engine
restart, against vLLM alone (vLLM's own prefix cache is empty after a restart).

Model: the run's architecture (``bench.gpu.LLAMA_3_1_8B``, bf16 on CUDA; the tiny Llama on the
CPU dry run, float32) with random weights made at start-up (``load_format="dummy"``: vLLM
seeds them, so every engine has the same weights; nothing to download: the directory holds
only ``config.json``), token ids in, no tokenizer. Each pass is a new engine in a new process
(a restart: nothing survives in memory):

1. ``fill``: kvtier's connector on an empty data directory; one request per history length
   (``cached`` tokens) stores its blocks (write-through to DISK), then a flush.
2. ``kvtier``: kvtier's connector on that directory. Per history length, ``repeats`` turns
   ``history + suffix_r`` (new tokens each), vLLM's prefix cache reset before each
   (``reset_prefix_cache``), so the history comes from kvtier every time: the first from
   DISK, the next from kvtier's CPU pool.
3. ``vllm``: no connector, the same turns: vLLM's prefix cache reset before each (what a
   restarted engine has: a full prefill), then the last turn again without a reset (vLLM's own
   GPU prefix cache hit: the floor).

TTFT: the wall time of ``LLM.generate`` for one output token (greedy) of a prompt of token
ids. The rows compare each kvtier case and vLLM's own hit with the full prefill of the same
history length; one row counts turns whose first token equals vLLM's (information: with
random weights the logits are nearly flat, so a different reduction order may flip a tie).

Skipped, with a note, when vLLM or lmdb (the DISK tier) cannot be imported.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Row  # noqa: E402

if TYPE_CHECKING:
    from bench.gpu import Run

log = logging.getLogger("bench.gpu")

ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
MODEL_ID = "llama-3.1-8b-architecture-dummy"


def missing() -> str | None:
    """Why the vLLM case cannot run here, or ``None``."""
    for name, why in (("vllm", "vLLM is not installed"), ("lmdb", "lmdb (kvtier's DISK tier) is not installed")):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken install, or an import hook refusing it
            found = False
        if not found:
            return why
    return None


def write_model(directory: Path, config: dict[str, Any], dtype: str) -> Path:
    """A model directory holding only a Llama ``config.json`` (weights: vLLM's dummy loader)."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = dict(config, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=dtype,
                  bos_token_id=1, eos_token_id=2, hidden_act="silu")
    (directory / "config.json").write_text(json.dumps(fields, indent=1))
    return directory


def prompts(vocab_size: int, cached_tokens: tuple[int, ...], suffix_tokens: int, repeats: int) -> dict[str, Any]:
    """Per history length, the history and ``repeats`` suffixes (seeded token ids)."""
    import torch

    out: dict[str, Any] = {}
    for cached in cached_tokens:
        g = torch.Generator().manual_seed(cached)
        history = torch.randint(10, vocab_size, (cached,), generator=g).tolist()
        suffixes = [torch.randint(10, vocab_size, (suffix_tokens,), generator=g).tolist() for _ in range(repeats)]
        out[str(cached)] = {"history": history, "suffixes": suffixes}
    return out


# -- one pass, in its own process --------------------------------------------------------------
def run_pass(spec: dict) -> dict:
    """One engine over the spec's turns; returns TTFTs and first tokens per history length."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec["connector"] is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    if spec["device"] == "cuda":
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    else:
        kwargs["kv_cache_memory_bytes"] = spec["kv_cache_bytes"]
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype=spec["dtype"],
        enforce_eager=True, enable_prefix_caching=True, block_size=spec["block_size"],
        max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_model_len"], max_num_seqs=2,
        seed=0, **kwargs,
    )
    out: dict[str, Any] = {"startup_s": time.perf_counter() - started, "turns": {}}
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)

    def turn(tokens: list[int], reset: bool) -> dict[str, Any]:
        if reset:
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        t0 = time.perf_counter()
        result = llm.generate(TokensPrompt(prompt_token_ids=tokens), params, use_tqdm=False)[0]
        return {"ttft_s": time.perf_counter() - t0, "token": result.outputs[0].token_ids[0],
                "num_cached_tokens": result.num_cached_tokens, "kvtier": (result.kv_transfer_params or {}).get("kvtier")}

    try:
        for cached, p in spec["prompts"].items():
            history, suffixes = p["history"], p["suffixes"]
            if spec["mode"] == "fill":
                out["turns"][cached] = [turn(history + suffixes[0][:1], reset=True)]
                continue
            turns = [turn(history + suffix, reset=True) for suffix in suffixes]
            if spec["mode"] == "vllm":
                turns.append(dict(turn(history + suffixes[-1][::-1], reset=False), own_hit=True))
            out["turns"][cached] = turns
        if spec["connector"] is not None:
            from kvtier.connectors.vllm import worker_flush, worker_stats

            llm.collective_rpc(worker_flush)
            out["stats"] = llm.collective_rpc(worker_stats)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def run_in_process(spec: dict, work: Path, name: str, timeout_s: float) -> dict:
    """Run one pass in a new Python process; its output is appended to ``<out>/vllm.log``."""
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pass-spec", str(spec_path), str(out_path)]
    with open(Path(spec["log_dir"]) / "vllm.log", "a") as log_file:
        log_file.write(f"==== pass {name} ====\n")
        log_file.flush()
        subprocess.run(cmd, check=True, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s)
    return json.loads(out_path.read_text())


# -- the step ----------------------------------------------------------------------------------
def step_vllm(run: Run) -> list[Row]:
    why = missing()
    if why is not None:
        run.note(f"vllm: skipped: {why} (bench/results/README.md: why the device cannot carry vLLM)")
        return []
    p = run.plan
    cuda = run.cuda
    dtype = "bfloat16" if cuda else "float32"
    model = write_model(run.work_dir / "vllm-model", p.model, dtype)
    block_size = 16 if cuda else 32  # CPU_ATTN takes multiples of 32
    max_len = max(p.cached_tokens) + p.suffix_tokens + block_size
    token_bytes = 2 * p.model["num_hidden_layers"] * p.model["num_key_value_heads"] * (
        p.model["hidden_size"] // p.model["num_attention_heads"]) * (2 if cuda else 4)
    block_bytes = token_bytes * block_size
    blocks = sum(c // block_size + 1 for c in p.cached_tokens) * 2
    connector = {
        "cpu_bytes": blocks * block_bytes, "disk_bytes": 2 * blocks * block_bytes + (64 << 20),
        "data_dir": str(run.work_dir / "vllm-kvtier"), "model_id": MODEL_ID, "model_revision": "dummy-seed-1234",
        "match_wait_s": 1.0,
    }
    base = {
        "model": str(model), "dtype": dtype, "device": run.device.type, "block_size": block_size,
        "max_model_len": max_len, "gpu_memory_utilization": 0.5, "kv_cache_bytes": 4 * max_len * token_bytes,
        "prompts": prompts(p.model["vocab_size"], p.cached_tokens, p.suffix_tokens, p.vllm_repeats),
        "log_dir": str(run.out),
    }
    results = {}
    for name, conn in (("fill", connector), ("kvtier", connector), ("vllm", None)):
        left_s = run.budget_s - run.elapsed_s()
        if left_s < 30:
            run.note(f"vllm: pass {name} and later skipped: past the {run.budget_s:.0f} s budget")
            return []
        started = time.perf_counter()
        results[name] = run_in_process(dict(base, mode=name, connector=conn), run.work_dir, name, left_s)
        log.info("vllm pass %s: %.0f s (engine start %.0f s)", name, time.perf_counter() - started,
                 results[name]["startup_s"])
    return vllm_rows(results, p.suffix_tokens)


def vllm_rows(results: dict[str, dict], suffix_tokens: int) -> list[Row]:
    """Rows from the passes' results (see the module docstring)."""
    rows: list[Row] = []
    same = total = 0
    for cached, kvtier_turns in results["kvtier"]["turns"].items():
        vllm_turns = results["vllm"]["turns"][cached]
        full = [t for t in vllm_turns if not t.get("own_hit")]
        own = [t for t in vllm_turns if t.get("own_hit")]
        base_ms = statistics.median(t["ttft_s"] for t in full) * 1e3
        label = f"vLLM TTFT {int(cached) // 1024}k cached + {suffix_tokens} new" if int(cached) >= 1024 else (
            f"vLLM TTFT {cached} cached + {suffix_tokens} new")
        name = "vLLM alone after a restart (full prefill)"
        first, later = kvtier_turns[0], kvtier_turns[1:]
        rows.append(Row(f"{label}: kvtier after a restart (DISK)", first["ttft_s"] * 1e3, "ms", base_ms, name))
        if later:
            rows.append(Row(f"{label}: kvtier CPU-pool hit", statistics.median(t["ttft_s"] for t in later) * 1e3, "ms",
                            base_ms, name))
        if own:
            rows.append(Row(f"{label}: vLLM's own prefix cache hit", own[0]["ttft_s"] * 1e3, "ms", base_ms, name))
        rows.append(Row(f"{label}: tokens kvtier loaded, first turn", float(_loaded(first)), "tokens", float(cached),
                        "history tokens"))
        for a, b in zip(kvtier_turns, full):
            same += a["token"] == b["token"]
            total += 1
    rows.append(Row("vLLM: first tokens equal to vLLM alone's (random weights: ties may flip)", float(same), "turns",
                    float(total), "turns"))
    return rows


def _loaded(turn: dict) -> int:
    loaded = (turn.get("kvtier") or {}).get("loaded_tokens") or {}
    return sum(loaded.values())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pass-spec"]:
        spec_path, out_path = sys.argv[2:4]
        Path(out_path).write_text(json.dumps(run_pass(json.loads(Path(spec_path).read_text()))))
    else:
        sys.exit("run through bench/gpu.py (step vllm), or: gpu_vllm.py --pass-spec SPEC OUT")
