"""The prefill after a hit with the HF connector: causal prefix attention vs transformers' mask.

    flock -x /tmp/kvtier-cpu.lock env OMP_NUM_THREADS=1 \\
        .venv/bin/python bench/prefix_attention.py --threads 1 [--lengths 1024,2048] [--hits 16,256] [--json PATH]

SmolLM2-135M (the demo's default model, fp32, SDPA). For each prompt length N and hit of k
tokens, a prompt's first k tokens are stored through ``HFConnector.after_request``; then the
request's TTFT (``before_prefill``, then the prefill of the other N - k tokens on the cache it
returns, to the first token's logits) is timed three ways, interleaved in one process:

- prefix attention: as the connector runs it (``kvtier.connectors.hf_attention``: causal SDPA
  with zero rows in front of the queries, no mask);
- masked (baseline): the same prefill with the connector's prefix attention disarmed, i.e.
  transformers' SDPA with its ``[1, 1, N - k, N]`` mask;
- no cache: the full prefill of all N tokens (what a miss costs).

Rows: the TTFT against the masked one (ratio < 1: faster) and against no
cache; and the self time of SDPA's kernel over all layers (``torch.profiler``, one more run
each) against the masked one, which is the quantity the change acts on. Exactness is asserted
on every run: the logits of the last prompt token within 1e-4 of the full prefill's (the
suffix's matmuls have other shapes; the K/V of the prefix are the same bytes) and the same
next token.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import Case, Row, apply_threads, arg_parser, measure, print_table, write_outputs  # noqa: E402
from kvtier.config import StoreConfig  # noqa: E402

NAME = "prefix_attention"


def _attention_ms(run) -> float:
    """Self CPU time of SDPA's kernels during ``run()``, ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(e.self_cpu_time_total for e in prof.key_averages()
               if "scaled_dot_product" in e.key or "flash_attention" in e.key) / 1e3


def rows_for(model, connector, length: int, hit: int, repeats: int, seed: int) -> list[Row]:
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        full = model(ids, use_cache=True)
    expected = full.logits[0, -1]
    cache = getattr(full, "cache", None) or full.past_key_values  # transformers 5.24+ names it cache
    assert connector.after_request(ids[0, : hit + 1], cache) == hit // connector.block_size
    del full, cache
    results = []

    def suffix(armed: bool) -> None:
        plan = connector.before_prefill(ids)
        assert plan.num_cached_tokens == hit, plan.num_cached_tokens
        if not armed:
            connector._prefix_attention.disarm()
        with torch.inference_mode():
            out = model(ids[:, hit:], use_cache=True, logits_to_keep=1, **plan.generate_kwargs())
        diff = float((out.logits[0, -1] - expected).abs().max())
        assert diff <= 1e-4 and int(out.logits[0, -1].argmax()) == int(expected.argmax()), (armed, diff)
        results.append(out)

    def no_cache() -> None:
        with torch.inference_mode():
            model(ids, use_cache=True, logits_to_keep=1)

    cases = [Case(lambda: suffix(True), before=results.clear), Case(lambda: suffix(False), before=results.clear),
             Case(no_cache, before=results.clear)]
    prefix, masked, cold = measure(cases, repeats)
    att_prefix, att_masked = _attention_ms(lambda: suffix(True)), _attention_ms(lambda: suffix(False))
    name = f"{hit}-token hit, {length}-token prompt"
    return [
        Row(f"TTFT after a {name}", prefix.best_s * 1e3, "ms", masked.best_s * 1e3, "transformers' masked SDPA"),
        Row(f"TTFT after a {name}, vs no cache", prefix.best_s * 1e3, "ms", cold.best_s * 1e3,
            "full prefill, no cache"),
        Row(f"  TTFT with the masked SDPA vs no cache: {name}", masked.best_s * 1e3, "ms", cold.best_s * 1e3,
            "full prefill, no cache"),
        Row(f"  SDPA kernel time, {name}", att_prefix, "ms", att_masked, "transformers' masked SDPA"),
    ]


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens (default 1024,2048)")
    parser.add_argument("--hits", default="16,256", help="cached prefix lengths, multiples of 16 (default 16,256)")
    parser.add_argument("--model", default="smollm2", help="a kvtier.app.models name (default smollm2)")
    args = parser.parse_args()
    threads = apply_threads(args.threads)
    from kvtier.app.models import load_model
    from kvtier.connectors.hf import HFConnector

    model, _, _ = load_model(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    hits = [int(x) for x in args.hits.split(",")]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as root:
        for n, length in enumerate(lengths):
            for i, hit in enumerate(hits):
                config = StoreConfig(gpu_bytes=0, cpu_bytes=256 << 20, disk_bytes=0, block_size=16,
                                     data_dir=Path(root) / f"{length}-{hit}")
                connector = HFConnector.from_model(model, config, model_id="bench", model_revision="bench")
                try:
                    rows += rows_for(model, connector, length, hit, args.repeats, seed=100 * n + i)
                finally:
                    connector.close()
    print_table(f"{NAME}: {args.model}, {threads} thread(s), best of {args.repeats}", rows,
                "ratio < 1: the prefill after the hit is faster than the baseline")
    write_outputs(args, NAME, rows)


if __name__ == "__main__":
    main()
