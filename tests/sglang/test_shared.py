"""Pages outlive the engine process and cross engine processes: a restarted process hits what
the last one stored on DISK; two processes share pages through one `kvtier serve` daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from tests.unit.server.conftest import REPO, spawn  # noqa: E402,F401  (spawn: the daemon fixture)
from tests.sglang.worker import NUM_PAGES  # noqa: E402

pytestmark = pytest.mark.sglang


def worker(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.sglang.worker", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_engine_process_hits_from_disk(tmp_path) -> None:
    assert worker("store", tmp_path / "d") == {"stored": NUM_PAGES}
    assert worker("load", tmp_path / "d") == {"hits": NUM_PAGES, "read": NUM_PAGES, "equal": True,
                                               "loaded": {"DISK": NUM_PAGES}}


def test_two_engine_processes_share_pages_through_the_daemon(tmp_path, spawn) -> None:  # noqa: F811
    daemon = spawn("--cpu-bytes", "4MiB", "--disk-bytes", "64MiB")
    assert worker("store", tmp_path / "a", daemon.url) == {"stored": NUM_PAGES}
    # another process, its own (empty) DISK: every page from the daemon, verified
    assert worker("load", tmp_path / "b", daemon.url) == {"hits": NUM_PAGES, "read": NUM_PAGES, "equal": True,
                                                          "loaded": {"REMOTE": NUM_PAGES}}
    # the same token ids under another model: another namespace on the daemon, no page
    other = worker("load", tmp_path / "c", daemon.url, "org/other-model")
    assert (other["hits"], other["read"]) == (0, 0)
