"""Cost of kvtier's metrics: the demo's TTFT and a store-level request loop, metrics on vs off.

    python bench/metrics_overhead.py [--model smollm2] [--conversations 6] [--turns 4]
                                     [--scrape-interval-s 1] [--json PATH] [--plot PATH]

*On* = the store exported through :func:`kvtier.metrics.register` (collector, latency
histogram on ``store.observe``) plus the dashboard's sampler (:class:`StatsHistory`) and a
scraper thread that renders ``/metrics`` every ``--scrape-interval-s`` (default 1 s, as the
dashboard samples; Prometheus scrapes every 15 s by default) while the *on* case runs.
*Off* = a second store, same config, no hook, no scraper. Both measured in the same run:

- demo TTFT: the demo's turns (ShareGPT chats, the model's own replies as history) through
  :func:`kvtier.app.demo.run_with` on two connectors over one model, alternating which goes first
  per turn (both see the same cache state); the rows report the median TTFT of each and the
  median of per-turn on/off ratios. Goal: on/off within 2 %.
- store loop: ``lookup`` + ``load`` + ``release`` + ``store`` of a 32-block request on a warm
  CPU store (microseconds of work, where a per-operation cost shows most), interleaved by
  :func:`bench.common.measure`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from bench.common import Case, Row, apply_threads, arg_parser, measure, print_table, write_outputs  # noqa: E402
from kvtier import metrics  # noqa: E402
from kvtier.config import StoreConfig  # noqa: E402
from kvtier.dashboard.stats import StatsHistory  # noqa: E402
from kvtier.hashing import KeyContext, block_hashes_for  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.types import KVSpec  # noqa: E402

NAME = "metrics_overhead"
GOAL_MAX_RATIO = 1.02


class Scraper:
    """Renders the registry and samples the stats history every ``interval_s`` while enabled."""

    def __init__(self, registry: CollectorRegistry, history: StatsHistory, interval_s: float) -> None:
        self.registry, self.history, self.interval_s = registry, history, interval_s
        self.enabled, self._stop = threading.Event(), threading.Event()
        self.scrapes = 0
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.enabled.is_set():
                generate_latest(self.registry)
                self.history.sample()
                self.scrapes += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def instrument(store: TieredStore, interval_s: float) -> Scraper:
    registry = CollectorRegistry()
    m = metrics.register(store, registry, namespace_label="on")
    return Scraper(registry, StatsHistory(m.stores, interval_s), interval_s)


# -- demo TTFT -----------------------------------------------------------------------------------
def demo_rows(args, root: Path) -> tuple[list[Row], str]:
    from kvtier.connectors.hf import HFConnector, weights_fingerprint
    from kvtier.app.demo import run_with, warm_up
    from kvtier.app.models import load_model, render_chat
    from kvtier.app.sharegpt import select_conversations

    model, tokenizer, model_id = load_model(args.model)
    conversations, _ = select_conversations(
        tokenizer, args.conversations, args.turns, seed=args.seed, max_message_tokens=256, max_prompt_tokens=1500,
        model_reply_tokens=args.max_new_tokens,
    )
    revision = weights_fingerprint(model)
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    with torch.inference_mode():
        connectors = {
            case: HFConnector.from_model(model, StoreConfig(gpu_bytes="256MiB", cpu_bytes="512MiB", disk_bytes=0,
                                                            data_dir=root / case), model_id=model_id,
                                         model_revision=revision)
            for case in ("on", "off")
        }
        scraper = instrument(connectors["on"].store, args.scrape_interval_s)
        try:
            warm_up(model)
            eos = tokenizer.eos_token_id
            for turns in conversations:
                messages: list[dict[str, str]] = []
                for user, _ in turns:
                    messages.append({"role": "user", "content": user})
                    prompt = torch.tensor([render_chat(tokenizer, messages)], dtype=torch.int64, device=model.device)
                    order = ("on", "off") if len(ttft["on"]) % 2 == 0 else ("off", "on")
                    outputs = {}
                    for case in order:
                        if case == "on":
                            scraper.enabled.set()
                        result = run_with(connectors[case], prompt, args.max_new_tokens, eos)
                        scraper.enabled.clear()
                        ttft[case].append(result.ttft_s)
                        outputs[case] = result.token_ids
                    assert outputs["on"] == outputs["off"], "metrics changed the model's output"
                    reply = tokenizer.decode([i for i in outputs["on"] if i != eos], skip_special_tokens=True)
                    messages.append({"role": "assistant", "content": reply})
        finally:
            scraper.close()
            for connector in connectors.values():
                connector.close()
    on, off = statistics.median(ttft["on"]), statistics.median(ttft["off"])
    ratios = [a / b for a, b in zip(ttft["on"], ttft["off"], strict=True)]
    n = len(ratios)
    rows = [
        Row(f"demo TTFT with kvtier, median of {n} turns", on * 1e3, "ms", off * 1e3, "metrics off"),
        Row(f"demo TTFT, median of {n} per-turn on/off ratios", statistics.median(ratios), "x", 1.0, "equal TTFT"),
    ]
    note = (f"demo: {model_id}, {len(conversations)} conversations x {args.turns} turns, "
            f"{scraper.scrapes} scrapes while 'on' ran; TTFT sum on/off {sum(ttft['on']) / sum(ttft['off']):.4f}")
    return rows, note


# -- store loop ----------------------------------------------------------------------------------
def store_rows(args, root: Path) -> tuple[list[Row], str]:
    spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)  # SmolLM2's block
    namespace = KeyContext(model_id="metrics-overhead", block_size=spec.block_size).namespace()
    request_blocks = 32
    stores, scraper = {}, None
    try:
        for case in ("on", "off"):
            config = StoreConfig(gpu_bytes=0, cpu_bytes=(4 * request_blocks + 8) * spec.block_nbytes, disk_bytes=0,
                                 block_size=spec.block_size, data_dir=root / f"loop-{case}")
            stores[case] = TieredStore(spec, config, namespace, device="cpu")
        scraper = instrument(stores["on"], args.scrape_interval_s)
        blocks = torch.randn((request_blocks + 2, *spec.block_shape))
        prefix = block_hashes_for(list(range(request_blocks * spec.block_size)), namespace, spec.block_size)
        for store in stores.values():
            store.store(prefix, blocks[:request_blocks])
        counter = {"on": 0, "off": 0}

        def requests(case: str) -> None:
            store = stores[case]
            for _ in range(args.loop_requests):
                counter[case] += 1
                tail = block_hashes_for([counter[case]] * (2 * spec.block_size), prefix[-1], spec.block_size)
                hashes = prefix + tail
                store.lookup(hashes)
                store.load(hashes).lease.release()
                store.store(hashes, blocks)

        def on() -> None:
            scraper.enabled.set()
            try:
                requests("on")
            finally:
                scraper.enabled.clear()

        timings = measure([Case(on), Case(lambda: requests("off"))], repeats=args.repeats)
        per_request = [t.seconds(args.stat) / args.loop_requests * 1e6 for t in timings]
        rows = [Row(f"store loop: lookup+load+store of {request_blocks}+2 blocks", per_request[0], "us/request",
                    per_request[1], "metrics off")]
        rows += unit_costs(stores["on"], scraper, args.hook_calls)
    finally:
        if scraper is not None:
            scraper.close()
        for store in stores.values():
            store.close()
    return rows, f"store loop: {args.loop_requests} requests per run, {args.stat} of {args.repeats}"


def unit_costs(store: TieredStore, scraper: Scraper, calls: int) -> list[Row]:
    """The two costs metrics add, each timed alone: one latency observation (the hook on
    ``store.observe``, beside a call of a no-op function) and one scrape (render /metrics and
    take a stats sample), which runs on another thread once per scrape interval."""
    hook, noop = store.observe, (lambda op, seconds: None)
    assert hook is not None

    def observe_many(fn) -> None:
        for _ in range(calls):
            fn("lookup", 1e-4)

    hook_t, noop_t = measure([Case(lambda: observe_many(hook)), Case(lambda: observe_many(noop))], repeats=5)

    def scrape() -> None:
        generate_latest(scraper.registry)
        scraper.history.sample()

    (scrape_t,) = measure([Case(scrape)], repeats=20)
    return [
        Row("latency hook, per store operation", hook_t.best_s / calls * 1e6, "us", noop_t.best_s / calls * 1e6,
            "no-op hook call"),
        Row("scrape: /metrics render + stats sample, one store", scrape_t.median_s * 1e3, "ms"),
    ]


def bound_rows(rows: list[Row], scrape_interval_s: float) -> list[Row]:
    """What metrics can add to one TTFT at most, from the unit costs: the latency hook runs
    twice per turn (the prefix load, the store after the request; a lookup adds one), and the
    scraper thread holds the GIL for one scrape per interval."""
    by_name = {r.metric.split(",")[0].split(":")[0]: r for r in rows}
    ttft = next((r for r in rows if r.metric.startswith("demo TTFT with")), None)
    if ttft is None or "latency hook" not in by_name or "scrape" not in by_name:
        return []
    ttft_s = ttft.baseline / 1e3
    hook_s = 3 * by_name["latency hook"].value / 1e6
    scrape_s = by_name["scrape"].value / 1e3 * max(1.0, ttft_s / scrape_interval_s)
    return [Row("bound: (3 hook calls + scrapes during one TTFT) / TTFT", (hook_s + scrape_s) / ttft_s * 100, "%")]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny-llama"), default=None,
                        help="default smollm2 when installed, else tiny-llama")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scrape-interval-s", type=float, default=1.0,
                        help="seconds between scrapes while 'on' runs (default 1: the dashboard's sampling rate; "
                             "Prometheus scrapes every 15 s by default)")
    parser.add_argument("--loop-requests", type=int, default=200, help="store-loop requests per timed run")
    parser.add_argument("--hook-calls", type=int, default=100_000, help="calls per timing of the latency hook")
    parser.add_argument("--skip-demo", action="store_true", help="only the store loop")
    args = parser.parse_args(argv)
    if args.model is None:
        from kvtier.app.models import smollm2_installed

        args.model = "smollm2" if smollm2_installed() else "tiny-llama"
    threads = apply_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="kvtier-metrics-bench-"))
    try:
        rows, notes = [], []
        for section in ((store_rows,) if args.skip_demo else (store_rows, demo_rows)):
            more, note = section(args, root)
            rows += more
            notes.append(note)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows += bound_rows(rows, args.scrape_interval_s)
    paired = next((r for r in rows if r.metric.startswith("demo TTFT, median of")), None)
    if paired is not None:
        verdict = "met" if paired.value <= GOAL_MAX_RATIO else "NOT met"
        notes.append(f"goal: demo TTFT with metrics on / off <= {GOAL_MAX_RATIO} (median of per-turn pairs): "
                     f"{paired.value:.4f}, {verdict}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    notes.append(f"host load average {load:.1f} on {os.cpu_count()} cores at the end (other work skews timings; "
                 "the unit-cost bound above does not depend on it)")
    print_table(f"kvtier metrics overhead (on vs off, same run; scrape every {args.scrape_interval_s} s; "
                f"{threads} torch threads)", rows, footnote="\n".join(notes))
    write_outputs(args, NAME, rows)
    return rows


if __name__ == "__main__":
    main()
