"""``kvtier cache ls``, ``kvtier cache rm`` and ``kvtier clear``: the caches kvtier keeps on disk.

Built on :mod:`kvtier.app.caches` (which dirs, their size as ``du`` counts it, blocks, the
live process holding one) and :mod:`kvtier.app.datadir` (locks). Torch-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from kvtier.app.caches import CacheDir, inspect_data_dir, known_data_dirs, remove_caches, state_file
from kvtier.app.datadir import DataDirError, describe_holder, format_bytes
from kvtier.config import ENV_PREFIX, StoreConfig


class DataDirUnusable(click.ClickException):
    """A data dir a command cannot use: one line on stderr (``Error: ...``), exit code 2."""

    exit_code = 2


def current_data_dir(data_dir: str | None) -> Path:
    """``--data-dir``, else ``$KVTIER_DATA_DIR``, else the default (as the other commands)."""
    if data_dir:
        return Path(data_dir).expanduser().absolute()
    env = os.environ.get(ENV_PREFIX + "DATA_DIR")
    return Path(env).expanduser().absolute() if env else StoreConfig().data_dir.absolute()


@click.group()
def cache() -> None:
    """Show and remove kvtier's caches: the data dirs of `kvtier demo`, the library and
    `kvtier serve` (DISK tiers: LMDB files, sparse, so sizes are shown as `du` counts them)."""


@cache.command("ls")
@click.argument("dirs", nargs=-1, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of the table.")
def ls(dirs: tuple[Path, ...], as_json: bool) -> None:
    """List the known data dirs (the default one, $KVTIER_DATA_DIR, every dir a demo or a
    daemon ran on) and DIRS: what each holds, its size on disk, blocks, and the process using it."""
    infos = [inspect_data_dir(path) for path in known_data_dirs(list(dirs))]
    if as_json:
        click.echo(json.dumps([_as_json(info) for info in infos], indent=2))
        return
    from rich.console import Console

    console = Console(highlight=False)
    table = _table(infos)
    if Console(width=10_000).measure(table).maximum <= console.width:
        console.print(table)
    else:  # a narrow terminal: paths whole (to copy), one dir per paragraph
        for info in infos:
            console.print(_home(info.path), markup=False, soft_wrap=True)
            console.print("    " + ", ".join(_cells(info, names=True)), markup=False)
    used = sum(i.du_bytes for i in infos)
    apparent = sum(i.apparent_bytes for i in infos)
    console.print(f"{len(infos)} data dirs, {format_bytes(used)} on disk (du; the LMDB files are sparse: ls -l "
                  f"shows {format_bytes(apparent)}). Dirs are recorded in {_home(state_file())}.", markup=False)
    console.print("remove with: kvtier cache rm DIR (kvtier clear: the current data dir)", markup=False)


def _table(infos: list[CacheDir]):
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("data dir", no_wrap=True)
    table.add_column("holds", no_wrap=True)
    table.add_column("on disk", justify="right", no_wrap=True)
    table.add_column("blocks", justify="right", no_wrap=True)
    table.add_column("in use by", no_wrap=True)
    for info in infos:
        table.add_row(_home(info.path), *_cells(info))
    return table


def _cells(info: CacheDir, names: bool = False) -> list[str]:
    """holds, on disk, blocks, in use by; ``names``: labelled, empty ones left out."""
    if not info.exists:
        return ["(missing)"] if names else ["(missing)", "", "", ""]
    kinds = ", ".join(_kind(k, info.namespaces) for k in info.kinds)
    blocks = "?" if info.blocks is None else f"{info.blocks:,}"
    holders = ", ".join(_holder(pid) for pid in sorted(set(info.holders.values())))
    if names:
        return [kinds or "nothing", f"{format_bytes(info.du_bytes)} on disk",
                *([f"{blocks} blocks"] if info.kinds else []), f"in use by {holders}" if holders else "not in use"]
    return [kinds or "nothing", format_bytes(info.du_bytes), blocks if info.kinds else "", holders or "-"]


def _holder(pid: int) -> str:
    """``pid 1234 (kvtier demo)``: the program and its command, not every flag."""
    text = describe_holder(pid)
    if "(" not in text:
        return text
    head, command = text.split(" (", 1)
    return f"{head} ({' '.join(command.rstrip(')').split()[:2])})"


def _kind(kind: str, namespaces: int) -> str:
    if kind != "daemon":
        return kind
    return f"daemon: {namespaces} model" + ("" if namespaces == 1 else "s")


def _as_json(info: CacheDir) -> dict:
    return {"path": str(info.path), "exists": info.exists, "kinds": info.kinds, "du_bytes": info.du_bytes,
            "apparent_bytes": info.apparent_bytes, "blocks": info.blocks, "namespaces": info.namespaces,
            "holders": info.holders}


def _home(path: Path) -> str:
    home = os.path.expanduser("~")
    text = str(path)
    return "~" + text[len(home):] if home not in ("/", "") and (text == home or text.startswith(home + "/")) else text


@cache.command("rm")
@click.argument("dirs", nargs=-1, type=click.Path(path_type=Path))
@click.option("--all", "all_dirs", is_flag=True, help="Every known data dir (see `kvtier cache ls`).")
@click.option("--data-dir", default=None, help=f"The data dir when no DIRS are given (env {ENV_PREFIX}DATA_DIR).")
def rm(dirs: tuple[Path, ...], all_dirs: bool, data_dir: str | None) -> None:
    """Remove the caches in DIRS (default: the current data dir): DISK tiers, the daemon's
    namespaces and lock files; other files stay. A dir in use by a live process is refused."""
    targets = known_data_dirs() if all_dirs else [Path(d).expanduser().absolute() for d in dirs]
    _remove(targets or [current_data_dir(data_dir)])


@click.command()
@click.option("--data-dir", default=None, help=f"The data dir to empty (env {ENV_PREFIX}DATA_DIR; default "
                                                 "~/.cache/kvtier).")
def clear(data_dir: str | None) -> None:
    """Remove the caches in the current data dir (same as `kvtier cache rm`)."""
    _remove([current_data_dir(data_dir)])


def _remove(targets: list[Path]) -> None:
    failures = []
    for path in targets:
        if not path.exists():
            click.echo(f"{_home(path)}: nothing there")
            continue
        if not path.is_dir():
            failures.append(f"{path} is a file, not a data dir; nothing removed")
            continue
        if not inspect_data_dir(path).kinds:
            click.echo(f"{_home(path)}: no kvtier cache there")
            continue
        try:
            freed = remove_caches(path)
        except DataDirError as exc:
            failures.append(str(exc))
            continue
        gone = "removed" if not path.exists() else "emptied (other files stay)"
        click.echo(f"{_home(path)}: {gone}, {format_bytes(freed)} freed")
    if failures:
        raise DataDirUnusable("; ".join(failures))
