"""``kvtier explain``: block by block, where a prompt would hit and why the rest would miss.

The prompt is token ids (``--tokens 1,2,3``) or text (``--text``, tokenized by ``--model``'s
tokenizer; ``--chat`` renders it as one user message with the chat template, as the demo's
turns are). Its blocks are hashed here, with the key of the engine that stored them:

- ``--model NAME`` (``smollm2``, ``tiny-llama``): the key the transformers connector uses
  for that model (model id, weights fingerprint, dtype, block size, hash);
- ``--namespace HEX`` (with ``--block-size`` and ``--hash-name``): a chain root given as is.

and explained by the store that holds them (nothing is counted, pinned or moved):

- ``--url http://host:port``: a ``kvtier serve`` daemon (``POST /v1/namespaces/{ns}/explain``),
  or, with ``--store NAME``, an engine's app serving its store (``POST /v1/explain``);
- ``--data-dir DIR`` (with ``--model``; default ``~/.cache/kvtier``, the demo's): the DISK tier
  a stopped engine left there (a new process: what it evicted before is not remembered).

As with the connectors, the prompt's last token is always computed, so the blocks explained
are the first ``(num_tokens - 1) // block_size``; the tokens after them are the partial tail.
``--json`` prints :meth:`kvtier.store.misses.Explanation.to_dict` with the prompt's length.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from kvtier.app.models import MODEL_NAMES
from kvtier.app.stats_cli import TOKEN_ENV, StatsUnavailable
from kvtier.config import HASH_NAMES


def parse_token_ids(text: str) -> list[int]:
    """``"1, 2,3"`` or ``"[1, 2, 3]"`` -> ``[1, 2, 3]``. Raises ``click.BadParameter``."""
    parts = [p for p in text.replace("[", " ").replace("]", " ").replace(",", " ").split() if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise click.BadParameter(f"expected token ids like 1,2,3, got {text[:60]!r}")
    return [int(p) for p in parts]


# -- rendering -------------------------------------------------------------------------------------
def _where(reason: str | None, tier: str, detail: str) -> str:
    from kvtier.store import misses

    if reason is None:
        return f"hit {tier}"
    text = {
        misses.EVICTED: f"evicted from {tier}",
        misses.TOKEN_MISMATCH: f"in {tier}, but computed from other tokens",
        misses.FAILED_VERIFICATION: f"failed verification on {tier}" + (f" ({detail})" if detail else ""),
        misses.LOAD_FAILED: f"load from {tier} failed" + (f" ({detail})" if detail else ""),
        misses.AFTER_GAP: f"in {tier}, but after an earlier miss",
        misses.BEYOND_TOP_CAPACITY: f"in {tier}, but beyond the top pool's capacity",
        misses.NO_FREE_SLOT: f"in {tier}, but no free top-pool slot",
        misses.OTHER_NAMESPACE: "stored under another namespace" + (f": {detail}" if detail else ""),
    }.get(reason, misses.REASONS.get(reason, reason))
    return f"miss: {text}"


def render_text(explanation: Any, num_tokens: int, source: str, width: int = 80) -> list[str]:
    """The explanation as lines of at most ``width`` columns: one per run of blocks that
    read alike, the tail, and a summary of hits and misses by reason."""
    import textwrap

    bs = explanation.block_size
    lines = [f"kvtier explain: {num_tokens:,} prompt tokens, block_size {bs}"]
    lines += textwrap.wrap(f"from {source}", width, subsequent_indent="  ")
    lines.append(f"{'blocks':<11}{'tokens':<14}where")

    def row(blocks: str, tokens: str, text: str) -> None:
        head = f"{blocks:<11}{tokens:<14}"
        lines.extend(textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * len(head)))

    for first, last, b in explanation.runs():
        row(f"{first}" if first == last else f"{first}-{last}", f"{first * bs}-{(last + 1) * bs - 1}",
            _where(b.reason, b.tier, b.detail))
    if explanation.tail_tokens:
        start = len(explanation.blocks) * bs
        row("tail", f"{start}-{num_tokens - 1}", "miss: partial tail (the last token is always computed)")
    hit = explanation.hit_tokens
    lines.append(f"hit {hit:,} of {num_tokens:,} prompt tokens ({hit / num_tokens:.1%})" if num_tokens else "empty prompt")
    missed = sorted(explanation.miss_tokens.items(), key=lambda kv: -kv[1])
    if missed:
        parts = [f"{reason}{'@' + tier if tier else ''} {n:,}" for (reason, tier), n in missed]
        lines += textwrap.wrap("missed tokens: " + ", ".join(parts), width, subsequent_indent="  ")
    return lines


# -- where the explanation comes from -----------------------------------------------------------------
def post_explain(url: str, body: dict[str, Any], token: str | None, timeout_s: float = 30.0) -> dict[str, Any]:
    """POST a msgpack ``body`` to ``url``; the JSON reply. Raises :class:`StatsUnavailable`."""
    import msgpack

    request = urllib.request.Request(url, data=msgpack.packb(body, use_bin_type=True), method="POST",
                                     headers={"Content-Type": "application/msgpack", "Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        raise StatsUnavailable(f"{url} answered HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StatsUnavailable(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    except ValueError as exc:
        raise StatsUnavailable(f"{url} did not return JSON: {exc}") from None


def _key_from_model(model_name: str, data_dir: Path | None) -> tuple[Any, Any, Any]:
    """``(connector, tokenizer, model_id)`` for ``--model``: the HF connector's key; its
    store opens ``data_dir``'s DISK tier (without one: a one-block pool, nothing on disk)."""
    from kvtier.app.models import load_model
    from kvtier.config import StoreConfig
    from kvtier.connectors.hf import HFConnector, kv_spec_for

    if data_dir is not None and not (Path(data_dir).expanduser() / "disk" / "data.mdb").exists():
        raise StatsUnavailable(f"no DISK tier at {Path(data_dir).expanduser() / 'disk'} (nothing stored there yet?)")
    model, tokenizer, model_id = load_model(model_name)
    block_nbytes = kv_spec_for(model, StoreConfig().block_size).block_nbytes
    config = StoreConfig.from_env(gpu_bytes=0, cpu_bytes=64 * block_nbytes, flush_on_close=False)
    config = config.with_(remote_url=None, trace_path=None)  # read only what is local; trace nothing
    config = config.with_(data_dir=data_dir) if data_dir is not None else config.with_(disk_bytes=0)
    try:
        return HFConnector.from_model(model, config, model_id=model_id), tokenizer, model_id
    except RuntimeError as exc:  # the DISK tier is open in a running engine
        raise StatsUnavailable(f"{exc}; ask that process instead (--url)") from None


@click.command("explain")
@click.option("--tokens", "token_text", default=None, help="The prompt as token ids, e.g. 1,2,3.")
@click.option("--text", default=None, help="The prompt as text (tokenized by --model's tokenizer).")
@click.option("--chat", is_flag=True, help="Render --text as one user message with the chat template.")
@click.option("--model", "model_name", type=click.Choice(MODEL_NAMES), default=None,
              help="Key (and tokenizer) of the transformers connector for this model.")
@click.option("--namespace", "namespace_hex", default=None, help="The chain root (64 hex digits) instead of --model.")
@click.option("--block-size", type=click.IntRange(1), default=16, show_default=True, help="With --namespace.")
@click.option("--hash-name", type=click.Choice(HASH_NAMES), default="sha256", show_default=True,
              help="With --namespace.")
@click.option("--url", default=None, help="A daemon (or, with --store, an engine's app) to ask.")
@click.option("--store", "store_name", default=None, help="The store's name on an engine's app (POST /v1/explain).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Local data dir whose DISK tier to read (with --model; default the demo's).")
@click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Bearer token of the daemon (env {TOKEN_ENV}).")
@click.option("--json", "as_json", is_flag=True, help="Print the explanation as JSON.")
def explain(token_text: str | None, text: str | None, chat: bool, model_name: str | None, namespace_hex: str | None,
            block_size: int, hash_name: str, url: str | None, store_name: str | None, data_dir: Path | None,
            token: str | None, as_json: bool) -> None:
    """Where each block of a prompt would hit, and why the rest would miss."""
    if (token_text is None) == (text is None):
        raise click.UsageError("give the prompt as --tokens or --text (one of them)")
    if (model_name is None) == (namespace_hex is None):
        raise click.UsageError("give the key as --model or --namespace (one of them)")
    if url is None and model_name is None:
        raise click.UsageError("--namespace needs --url (a local data dir is read with --model)")
    if text is not None and model_name is None:
        raise click.UsageError("--text needs --model (its tokenizer)")
    connector = tokenizer = None
    if model_name is not None:
        from kvtier.config import default_data_dir

        local = None if url is not None else (data_dir or default_data_dir())
        connector, tokenizer, source = _key_from_model(model_name, local)
        source = f"{source} ({'DISK at ' + str(local) if local else url})"
    else:
        source = url
    try:
        tokens = parse_token_ids(token_text) if token_text is not None else _tokenize(tokenizer, text, chat)
        explanation = _explain(tokens, connector, namespace_hex, block_size, hash_name, url, store_name, token)
    finally:
        if connector is not None:
            connector.close()
    if as_json:
        click.echo(json.dumps({"num_tokens": len(tokens), **explanation.to_dict()}, indent=2))
        return
    for line in render_text(explanation, len(tokens), source):
        click.echo(line)


def _tokenize(tokenizer: Any, text: str, chat: bool) -> list[int]:
    if chat:
        from kvtier.app.models import render_chat

        return render_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _explain(tokens: list[int], connector: Any, namespace_hex: str | None, block_size: int, hash_name: str,
             url: str | None, store_name: str | None, token: str | None) -> Any:
    from kvtier.checks import parse_namespace
    from kvtier.hashing import block_hashes_for, content_keys
    from kvtier.store.misses import Explanation

    if not tokens:
        raise click.UsageError("expected a non-empty prompt")
    if url is None:
        return connector.explain(tokens)
    if connector is not None:
        namespace, block_size, hash_name = connector.namespace, connector.block_size, connector.key_context.hash_name
    else:
        try:
            namespace = parse_namespace(namespace_hex)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--namespace") from None
    max_blocks = (len(tokens) - 1) // block_size
    body: dict[str, Any] = {
        "block_hashes": block_hashes_for(tokens, namespace, block_size, hash_name)[:max_blocks],
        "num_tokens": len(tokens), "content_keys": content_keys(tokens, block_size)[:max_blocks],
    }
    if store_name is not None:
        body["namespace"] = store_name
        endpoint = url.rstrip("/") + "/v1/explain"
    else:
        endpoint = f"{url.rstrip('/')}/v1/namespaces/{namespace.hex()}/explain"
    try:
        return Explanation.from_dict(post_explain(endpoint, body, token))
    except ValueError as exc:
        raise StatsUnavailable(f"{endpoint}: {exc}") from None
