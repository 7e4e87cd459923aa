"""``kvtier stats``: the cache's figures as terminal tables, from a daemon or a local data dir.

- ``--url http://host:port``: ``GET /v1/stats`` of a running ``kvtier serve`` (the document of
  :mod:`kvtier.dashboard.stats`: lookups, hits per tier, hit rate, evictions, failures,
  occupancy, bytes moved per path).
- ``--data-dir DIR`` (default: the demo's ``~/.cache/kvtier``): the DISK tier's LMDB
  environment, read directly: blocks and bytes per namespace. Event counters live in the
  process that owns the store, so they are only available through ``--url``. A data dir that a
  running process has open is refused with a message (the DISK tier allows one owner: see
  ``kvtier.tiers.disk``); the scan itself holds a shared lock for its few milliseconds.

The output fits 80 columns whatever the terminal's width. A namespace is named by its
store's display name (``name``: the model id a connector sets) when the document has one;
per tier, hits and tokens served come in tokens and in blocks side by side (tokens = blocks x
block_size), with the tokens missed by reason (kvtier.store.misses).

``--watch`` redraws every ``--interval`` seconds until Ctrl-C; ``--json`` prints the document.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from kvtier.config import default_data_dir

TOKEN_ENV = "KVTIER_TOKEN"


class StatsUnavailable(click.ClickException):
    """The figures could not be read (daemon unreachable, data dir missing or in use)."""


# -- sources ---------------------------------------------------------------------------------------
def fetch_stats(url: str, token: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """``GET {url}/v1/stats`` as a dict.

    Raises:
        StatsUnavailable: unreachable, refused (401/403: a token is needed), or not JSON.
    """
    request = urllib.request.Request(url.rstrip("/") + "/v1/stats", headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        hint = f" (pass --token or set {TOKEN_ENV})" if exc.code in (401, 403) else ""
        raise StatsUnavailable(f"{url}/v1/stats answered HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatsUnavailable(f"cannot reach {url}: {reason}") from None
    except ValueError as exc:
        raise StatsUnavailable(f"{url}/v1/stats did not return JSON: {exc}") from None


def read_data_dir(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Blocks and bytes per namespace in ``data_dir/disk`` (LMDB opened read-only).

    Returns:
        ``{"source": "data-dir", "path", "namespaces": {hex: {"tiers": {"DISK": {...}},
        "block_bytes"}}, "total": {"tiers": {"DISK": {"blocks", "used_bytes",
        "capacity_bytes": None}}}, "map_size_bytes", "unreadable_records"}``; ``used_bytes``
        is the page-rounded footprint, as the DISK tier counts it.

    Raises:
        StatsUnavailable: no DISK tier there, or a running process has it open.
    """
    import fcntl

    import lmdb

    from kvtier.records import HEADER_NBYTES, parse_header
    from kvtier.tiers.disk import record_footprint

    path = Path(data_dir).expanduser() / "disk"
    if not (path / "data.mdb").exists():
        raise StatsUnavailable(f"no DISK tier at {path} (nothing stored there yet?)")
    try:
        lock_file = open(path / "kvtier.lock", "rb")
    except OSError as exc:
        raise StatsUnavailable(f"cannot open {path / 'kvtier.lock'}: {exc}") from None
    with lock_file:
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StatsUnavailable(
                f"{path} is in use by a running kvtier process (it owns the DISK tier); ask that process "
                "instead: `kvtier stats --url http://HOST:PORT` for a `kvtier serve` daemon"
            ) from None
        env = lmdb.open(str(path), readonly=True, lock=False, subdir=True, max_readers=1)
        try:
            page = env.stat()["psize"]
            namespaces: dict[str, dict[str, Any]] = {}
            bad = 0
            with env.begin(buffers=True) as txn:
                for _, value in txn.cursor():
                    header = parse_header(value)
                    if header is None or len(value) != HEADER_NBYTES + header.payload_nbytes:
                        bad += 1
                        continue
                    payload_nbytes, ns = header.payload_nbytes, header.namespace.hex()
                    entry = namespaces.setdefault(ns, {"tiers": {"DISK": {"blocks": 0, "used_bytes": 0,
                                                                           "capacity_bytes": None}},
                                                       "block_bytes": payload_nbytes})
                    entry["tiers"]["DISK"]["blocks"] += 1
                    entry["tiers"]["DISK"]["used_bytes"] += record_footprint(payload_nbytes, page)
            map_size = env.info()["map_size"]
        finally:
            env.close()
    total = {"blocks": sum(n["tiers"]["DISK"]["blocks"] for n in namespaces.values()),
             "used_bytes": sum(n["tiers"]["DISK"]["used_bytes"] for n in namespaces.values()), "capacity_bytes": None}
    return {"source": "data-dir", "path": str(path), "time": time.time(), "namespaces": namespaces,
            "total": {"tiers": {"DISK": total}}, "map_size_bytes": map_size, "unreadable_records": bad}


# -- tables ----------------------------------------------------------------------------------------
def _int(n: Any) -> str:
    return "–" if n is None else f"{n:,}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{x * 100:.1f}%"


def _bytes(n: Any) -> str:
    if n is None:
        return "–"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _short(name: str) -> str:
    return name if len(name) <= 20 else name[:16] + "…"


WIDTH = 80
"""Every line fits this many columns (whatever the terminal's width)."""


def _wrap(text: str, indent: str = "  ") -> list[str]:
    import textwrap

    return textwrap.wrap(text, WIDTH, subsequent_indent=indent) or [""]


def namespace_lines(name: str, s: dict[str, Any]) -> list[str]:
    """One namespace (or the total): its figures, then a row per tier in tokens and in blocks
    (tokens = blocks x block_size: the two always agree)."""
    bs = s.get("block_size")
    title = f"{s.get('name') or _short(name)}: {_int(s['lookup_tokens'])} tokens looked up, hit rate {_pct(s['hit_rate'])}"
    lines = _wrap(title + (f", block_size {bs}" if bs else ""))
    ttft, lost = s.get("ttft_saved_s"), s.get("ttft_lost_s") or 0.0
    engine = s.get("engine_computed_tokens")
    facts = [f"not cached {_int(s['computed_tokens'])} tokens"]
    if engine is not None:
        facts.append(f"engine prefilled {_int(engine)}")
    facts.append("TTFT saved n/a (no connector reports it)" if ttft is None else
                 f"TTFT saved {ttft:.1f} s" + (f" (loads cost {lost:.1f} s more than recomputing)" if lost >= 0.05 else ""))
    lines += _wrap("  " + "; ".join(facts), "    ")
    missed = s.get("miss_tokens") or []
    if missed:
        parts = [f"{m['reason']}{'@' + m['tier'] if m['tier'] else ''} {_int(m['tokens'])}" for m in missed]
        lines += _wrap("  missed tokens: " + ", ".join(parts), "    ")
    lines.append(f"  {'tier':<5}{'hit tok':>11}{'blocks':>9}{'served tok':>12}{'blocks':>9}{'stored tok':>12}"
                 f"{'evicted blk':>12}")
    for t in s.get("tier_names") or list(s["tiers"]):
        blocks = {k: s.get(k, {}).get(t) for k in ("hit_blocks", "served_blocks")}
        if bs:  # an older document without block counts: derive them (exact per namespace)
            blocks = {k: v if v is not None else s[k.replace("blocks", "tokens")].get(t, 0) // bs
                      for k, v in blocks.items()}
        lines.append(f"  {t:<5}{_int(s['hit_tokens'].get(t, 0)):>11}{_int(blocks['hit_blocks']):>9}"
                     f"{_int(s['served_tokens'].get(t, 0)):>12}{_int(blocks['served_blocks']):>9}"
                     f"{_int(s['stored_tokens'].get(t, 0)):>12}{_int(s['evicted_blocks'].get(t, 0)):>12}")
    return lines


def render_lines(doc: dict[str, Any], source: str) -> list[str]:
    """The stats of a daemon (or engine) document, or of a data-dir document, as lines of at
    most :data:`WIDTH` columns."""
    when = time.strftime("%H:%M:%S", time.localtime(doc.get("time", time.time())))
    if doc.get("source") == "data-dir":
        lines = _wrap(f"kvtier DISK tier at {doc['path']} (as of {when})")
        lines.append(f"  {'namespace':<20}{'blocks':>10}{'used':>12}{'block bytes':>14}")
        for ns, entry in doc["namespaces"].items():
            disk = entry["tiers"]["DISK"]
            lines.append(f"  {_short(ns):<20}{_int(disk['blocks']):>10}{_bytes(disk['used_bytes']):>12}"
                         f"{_bytes(entry['block_bytes']):>14}")
        total = doc["total"]["tiers"]["DISK"]
        lines.append(f"  {'total':<20}{_int(total['blocks']):>10}{_bytes(total['used_bytes']):>12}")
        return lines + _wrap(f"LMDB map {_bytes(doc['map_size_bytes'])}; {doc['unreadable_records']} unreadable "
                             "records. Hit and eviction counters live in the process that owns a store: use --url "
                             "for a daemon.", "")
    lines = _wrap(f"kvtier stats: {source} (as of {when})")
    for name, section in doc["namespaces"].items():
        lines += [""] + namespace_lines(name, section)
    total = doc["total"]
    if len(doc["namespaces"]) != 1:
        lines += [""] + namespace_lines("all namespaces", {**total, "name": "all namespaces", "block_size": None})
    lines += ["", "occupancy (all namespaces)",
              f"  {'tier':<5}{'held blk':>11}{'used':>12}{'capacity':>12}{'occupancy':>11}"]
    for t, u in total["tiers"].items():
        cap = u.get("capacity_bytes")
        lines.append(f"  {t:<5}{_int(u.get('blocks')):>11}{_bytes(u.get('used_bytes')):>12}{_bytes(cap):>12}"
                     f"{_pct(u['used_bytes'] / cap if cap else None):>11}")
    lines += ["bytes moved (all namespaces)", f"  {'path':<16}{'bytes':>12}{'bytes/s, last interval':>26}"]
    rates = doc.get("series", {}).get("bytes_per_s", {})
    for p, n in total["moved_bytes"].items():
        last = (rates.get(p) or [None])[-1]
        lines.append(f"  {p:<16}{_bytes(n):>12}{'–' if last is None else _bytes(last) + '/s':>26}")
    failures = [f for f in total["load_failures"] if f["blocks"]]
    if failures:
        lines += _wrap("load failures: " + ", ".join(
            f"{f['tier'] + ' ' if f['tier'] else ''}{f['reason']} {f['blocks']}" for f in failures))
    return lines


def render(doc: dict[str, Any], source: str) -> Any:
    """The rich renderable of :func:`render_lines` (for ``--watch``'s live view)."""
    from rich.text import Text

    return Text("\n".join(render_lines(doc, source)), no_wrap=True, overflow="crop")


# -- the command -----------------------------------------------------------------------------------
@click.command("stats")
@click.option("--url", default=None, help="Base URL of a `kvtier serve` daemon, e.g. http://127.0.0.1:8765.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Local data dir whose DISK tier to read (default ~/.cache/kvtier, the demo's) when --url "
                   "is not given.")
@click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Bearer token of the daemon (env {TOKEN_ENV}).")
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between redraws with --watch.")
@click.option("--json", "as_json", is_flag=True, help="Print the stats document as JSON instead of tables.")
def stats(url: str | None, data_dir: Path | None, token: str | None, watch: bool, interval: float,
          as_json: bool) -> None:
    """Hit rate, hits per tier, evictions, failures, occupancy and bytes moved, as tables."""
    from rich.console import Console

    if url is not None and data_dir is not None:
        raise click.UsageError("give --url or --data-dir, not both")
    source = url if url is not None else str(Path(data_dir or default_data_dir()).expanduser())

    def read() -> dict[str, Any]:
        return fetch_stats(url, token) if url is not None else read_data_dir(data_dir or default_data_dir())

    console = Console(highlight=False)
    if as_json:
        click.echo(json.dumps(read(), indent=2))
        return
    if not watch:
        console.print(render(read(), source))
        return
    from rich.live import Live
    from rich.text import Text

    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                try:
                    view = render(read(), source)
                except StatsUnavailable as exc:  # keep watching: a daemon may come back
                    view = Text(f"{exc.message} (retrying every {interval:g} s)", style="red")
                live.update(view, refresh=True)
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
