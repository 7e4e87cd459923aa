"""``kvtier stats``: the cache's figures as terminal tables, from a daemon or a local data dir.

- ``--url http://host:port``: ``GET /v1/stats`` of a running ``kvtier serve`` (the document of
  :mod:`kvtier.dashboard.stats`: lookups, hits per tier, hit rate, evictions, failures,
  occupancy, bytes moved per path).
- ``--data-dir DIR`` (default: the demo's ``~/.cache/kvtier``): the DISK tier's LMDB
  environment, read directly: blocks and bytes per namespace. Event counters live in the
  process that owns the store, so they are only available through ``--url``. A data dir that a
  running process has open is refused with a message (the DISK tier allows one owner: see
  ``kvtier.tiers.disk``); the scan itself holds a shared lock for its few milliseconds.

``--watch`` redraws every ``--interval`` seconds until Ctrl-C; ``--json`` prints the document.
"""

from __future__ import annotations

import json
import os
import time
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
    import urllib.error  # here, not at the top: `kvtier --help` should not pay for http.client
    import urllib.request

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


def fit_table(title: str, heads: list[str], rows: list[list[str]], width: int, bold_last: bool = False) -> Any:
    """A table of ``rows`` under ``heads`` when it fits ``width`` columns, else its transpose
    (one row per heading, one column per row: "tier | GPU | CPU | DISK"), so that no heading is
    cut to ``names…`` on an 80-column terminal (issue 16). The first cell of a row names it."""
    from rich.console import Console, Group
    from rich.table import Table
    from rich.text import Text

    def build(columns: list[str], body: list[list[str]], bold_row: int | None, titled: bool = True) -> Table:
        table = Table(title=title if titled else None, title_justify="left")
        for i, name in enumerate(columns):
            table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
        for i, row in enumerate(body):
            table.add_row(*row, style="bold" if i == bold_row else None)
        return table

    wide = build(heads, rows, len(rows) - 1 if bold_last else None)
    if Console(width=10_000).measure(wide).maximum <= width:
        return wide
    narrow = build([heads[0], *(row[0] for row in rows)],
                   [[h, *(row[i] for row in rows)] for i, h in enumerate(heads) if i > 0], None, titled=False)
    return Group(Text(title, style="italic"), narrow)  # the title on its own line: not wrapped to the table


def render(doc: dict[str, Any], source: str, width: int = 10_000) -> Any:
    """The rich renderable for a stats document (daemon) or a data-dir document; each table in
    full when it fits ``width`` columns, else transposed (:func:`fit_table`)."""
    from rich.console import Group
    from rich.text import Text

    when = time.strftime("%H:%M:%S", time.localtime(doc.get("time", time.time())))
    if doc.get("source") == "data-dir":
        rows = []
        for ns, entry in doc["namespaces"].items():
            disk = entry["tiers"]["DISK"]
            rows.append([_short(ns), _int(disk["blocks"]), _bytes(disk["used_bytes"]), _bytes(entry["block_bytes"])])
        total = doc["total"]["tiers"]["DISK"]
        rows.append(["total", _int(total["blocks"]), _bytes(total["used_bytes"]), ""])
        table = fit_table(f"kvtier DISK tier at {doc['path']} (as of {when})",
                          ["namespace", "blocks", "used", "block bytes"], rows, width, bold_last=True)
        note = (f"LMDB map {_bytes(doc['map_size_bytes'])}; {doc['unreadable_records']} unreadable records. "
                "Hit and eviction counters live in the process that owns a store: use --url for a daemon.")
        return Group(table, Text(note, style="dim"))

    tiers = list(doc["total"].get("tier_names") or doc["total"]["tiers"])
    heads = ["namespace", "lookup tokens", "hit rate", *[f"hits {t}" for t in tiers], "computed tokens",
             "evicted blocks", "load failures", "TTFT saved"]
    named = [(_short(n), s) for n, s in doc["namespaces"].items()]
    if len(named) != 1:
        named.append(("total", doc["total"]))
    rows = []
    for name, s in named:
        failures = sum(f["blocks"] for f in s["load_failures"])
        ttft = s.get("ttft_saved_s")
        rows.append([name, _int(s["lookup_tokens"]), _pct(s["hit_rate"]), *[_int(s["hit_tokens"].get(t, 0)) for t in tiers],
                     _int(s["computed_tokens"]), _int(sum(s["evicted_blocks"].values())), _int(failures),
                     "n/a" if ttft is None else f"{ttft:.1f} s"])
    overview = fit_table(f"kvtier stats: {source} (as of {when})", heads, rows, width, bold_last=len(named) != 1)
    total = doc["total"]
    rows = []
    for t in tiers:
        u = total["tiers"].get(t, {})
        cap = u.get("capacity_bytes")
        rows.append([t, _bytes(u.get("used_bytes")), _bytes(cap), _pct(u["used_bytes"] / cap if cap else None),
                     _int(u.get("blocks")), _int(total["hit_tokens"].get(t, 0)), _int(total["served_tokens"].get(t, 0)),
                     _int(total["stored_tokens"].get(t, 0)), _int(total["evicted_blocks"].get(t, 0))])
    tier_table = fit_table("tiers (all namespaces)", ["tier", "used", "capacity", "occupancy", "blocks", "hit tokens",
                                                       "served tokens", "stored tokens", "evicted blocks"], rows, width)
    rates = doc.get("series", {}).get("bytes_per_s", {})
    rows = []
    for p, n in total["moved_bytes"].items():
        last = rates.get(p, [])[-1:] or [None]
        rows.append([p, _bytes(n), "–" if last[0] is None else _bytes(last[0]) + "/s"])
    path_table = fit_table("bytes moved per path (all namespaces)", ["path", "bytes", "bytes/s (last interval)"],
                           rows, width)
    parts = [overview, tier_table, path_table]
    failures = [f for f in total["load_failures"] if f["blocks"]]
    if failures:
        parts.append(Text("load failures: " + ", ".join(
            f"{f['tier'] + ' ' if f['tier'] else ''}{f['reason']} {f['blocks']}" for f in failures)))
    return Group(*parts)


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

    console = Console()
    if as_json:
        click.echo(json.dumps(read(), indent=2))
        return
    if not watch:
        console.print(render(read(), source, console.width))
        return
    from rich.live import Live
    from rich.text import Text

    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                try:
                    view = render(read(), source, console.width)
                except StatsUnavailable as exc:  # keep watching: a daemon may come back
                    view = Text(f"{exc.message} (retrying every {interval:g} s)", style="red")
                live.update(view, refresh=True)
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
