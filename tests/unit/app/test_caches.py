"""Data-dir checks, locks and cache removal (kvtier.app.datadir, kvtier.app.caches) against
real DISK tiers: the lock the checks probe is the one a live store holds."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from kvtier.app import caches, datadir
from kvtier.app.caches import inspect_data_dir, known_data_dirs, remember_data_dir, remove_caches
from kvtier.app.datadir import DataDirError, check_data_dir, format_bytes, hold_lock, lock_holder
from kvtier.tiers.disk import DiskTier
from kvtier.types import BlockHash

NAMESPACE = b"n" * 32


def _fill(disk: DiskTier, count: int) -> None:
    block = torch.arange(4096, dtype=torch.float32).reshape(1, 2, 16, 8, 16)
    puts = [(BlockHash(bytes([i]) * 32), NAMESPACE, block) for i in range(count)]
    assert all(disk.write_batch(puts))


@pytest.fixture(autouse=True)
def private_homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTIER_DATA_DIR", raising=False)


def test_a_live_store_is_seen_with_its_pid_and_blocks_then_removed_once_closed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    disk = DiskTier(data / "disk", 64 << 20)
    _fill(disk, 5)
    info = inspect_data_dir(data)
    assert info.kinds == ["store"] and info.blocks is None  # py-lmdb opens an environment once per process
    assert info.holders == {"disk/kvtier.lock": os.getpid()}
    assert 5 * 16384 <= info.du_bytes < info.apparent_bytes  # the map file is sparse
    with pytest.raises(DataDirError, match=f"in use by pid {os.getpid()}"):
        check_data_dir(data)
    with pytest.raises(DataDirError, match="nothing removed"):
        remove_caches(data)
    assert (data / "disk" / "data.mdb").exists()
    disk.close()

    assert lock_holder(data / "disk" / "kvtier.lock") is None
    assert inspect_data_dir(data).blocks == 5
    assert check_data_dir(data) == []
    freed = remove_caches(data)
    assert freed >= 5 * 16384 and not data.exists()
    reopened = DiskTier(data / "disk", 64 << 20)  # a store opens the path anew
    assert len(reopened) == 0
    reopened.close()


@pytest.mark.slow  # starts a Python process that imports torch
def test_a_store_in_another_process_is_counted_beside_it(tmp_path: Path) -> None:
    """What `kvtier cache ls` sees while a demo runs: blocks read through LMDB's reader
    table next to the owner, the owner's pid from its lock."""
    data = tmp_path / "data"
    code = ("import sys, torch; sys.path.insert(0, sys.argv[2]); from test_caches import _fill; "
            "from kvtier.tiers.disk import DiskTier; disk = DiskTier(sys.argv[1], 64 << 20); _fill(disk, 3); "
            "print('ready', flush=True); sys.stdin.read(); disk.close()")
    child = subprocess.Popen([sys.executable, "-c", code, str(data / "disk"), str(Path(__file__).parent)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        info = inspect_data_dir(data)
        assert info.blocks == 3 and info.holders == {"disk/kvtier.lock": child.pid}
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    assert inspect_data_dir(data).holders == {}


def test_removal_keeps_files_that_are_not_kvtier_s(tmp_path: Path) -> None:
    data = tmp_path / "data"
    DiskTier(data / "disk", 64 << 20).close()
    (data / "notes.txt").write_text("mine")
    remove_caches(data)
    assert sorted(p.name for p in data.iterdir()) == ["notes.txt"]
    assert inspect_data_dir(data).kinds == []


def _daemon_dir(data: Path, namespaces: int, tenants: bool = True) -> list[Path]:
    """The layout of kvtier.server.layout: serve.lock, tenants/<tenant>/<hex>/ with its marker,
    spec.msgpack and disk/ (``tenants=False``: <hex>/ at the top, as daemons before tenants)."""
    data.mkdir(parents=True)
    (data / "serve.lock").touch()
    dirs = []
    for i in range(namespaces):
        parent = data / "tenants" / ("default" if i % 2 == 0 else "team-b") if tenants else data
        ns = parent / (f"{i:02x}" * 32)
        ns.mkdir(parents=True)
        (ns / "spec.msgpack").write_bytes(b"\x80")
        if tenants:
            (ns / "kvtier-namespace.msgpack").write_bytes(b"\x80")
        disk = DiskTier(ns / "disk", 64 << 20)
        _fill(disk, 3)
        disk.close()
        dirs.append(ns)
    return dirs


@pytest.mark.parametrize("tenants", [True, False], ids=["tenants", "flat"])
def test_a_daemon_dir_counts_its_namespaces_and_is_refused_while_the_daemon_runs(tmp_path: Path, tenants) -> None:
    # the daemon keeps tenants/<tenant>/<ns>: `cache ls` showed such a dir as 0 models, 0 blocks
    # and `cache rm` left its namespaces behind (a newcomer's report, 2026-12-03)
    data = tmp_path / "daemon"
    _daemon_dir(data, 2, tenants)
    (data / "other").mkdir()  # not a namespace (no spec): left alone
    info = inspect_data_dir(data)
    assert info.kinds == ["daemon"] and info.namespaces == 2 and info.blocks == 6 and info.holders == {}
    with hold_lock(data / "serve.lock"):  # as the running daemon holds it
        assert inspect_data_dir(data).holders == {"serve.lock": os.getpid()}
        with pytest.raises(DataDirError, match="in use"):
            remove_caches(data)
    assert inspect_data_dir(data).blocks == 6
    remove_caches(data)
    assert sorted(p.name for p in data.iterdir()) == ["other"]


def test_check_creates_the_dir_and_warns_when_the_cap_exceeds_the_free_space(tmp_path: Path) -> None:
    data = tmp_path / "new" / "data"
    assert check_data_dir(data, disk_bytes=1 << 20) == []
    assert (data / "disk").is_dir() and list((data / "disk").iterdir()) == []  # the probe file is gone
    warnings = check_data_dir(data, disk_bytes=1 << 60)
    assert len(warnings) == 1 and "less than the DISK cap 1048576 TiB" in warnings[0]


def test_check_refuses_a_nearly_full_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    statvfs = namedtuple("statvfs", "f_bavail f_frsize")
    monkeypatch.setattr(datadir.os, "statvfs", lambda path: statvfs(1000, 4096))
    with pytest.raises(DataDirError, match=r"only 3\.91 MiB free .* --disk-bytes 0"):
        check_data_dir(tmp_path / "data", disk_bytes=1 << 30)
    assert check_data_dir(tmp_path / "data", disk_bytes=0) == []  # no DISK tier: no space needed


def test_known_dirs_are_the_default_the_env_and_each_remembered_one_once(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    used = tmp_path / "used"
    used.mkdir()
    remember_data_dir(used)
    remember_data_dir(str(used) + "/")
    remember_data_dir(tmp_path / "gone")  # recorded, then missing: not listed
    monkeypatch.setenv("KVTIER_DATA_DIR", str(tmp_path / "env"))
    assert caches.state_file().read_text().splitlines() == [str(used), str(tmp_path / "gone")]
    assert known_data_dirs([tmp_path / "asked"]) == [
        tmp_path / "asked", tmp_path / "cache" / "kvtier", tmp_path / "env", used]


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 100 << 20, 20 << 30, 5 << 40)] == [
        "0 B", "1023 B", "1.5 KiB", "100 MiB", "20 GiB", "5 TiB"]


def test_cache_ls_keeps_paths_whole_in_a_narrow_terminal(tmp_path: Path) -> None:
    """A path cut over two lines cannot be copied into `kvtier cache rm`: the table when it
    fits the terminal, else one paragraph per dir, the path whole on its own line."""
    from click.testing import CliRunner

    from kvtier.app.cli import main

    data = tmp_path / ("a-long-directory-name-" * 3) / "data"
    disk = DiskTier(data / "disk", 64 << 20)
    _fill(disk, 3)
    disk.close()
    remember_data_dir(data)
    narrow = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "60"})
    assert narrow.exit_code == 0, narrow.output
    lines = narrow.output.splitlines()
    assert str(data) in lines and "    store, " in lines[lines.index(str(data)) + 1]
    assert "3 blocks, not in use" in lines[lines.index(str(data)) + 1]
    wide = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "300"})
    row = next(line for line in wide.output.splitlines() if line.startswith(str(data)))
    assert row.split()[1:2] == ["store"] and row.split()[-1] == "-"
