"""The README's commands and Quickstart work as written (issue 16: "every README command right
the first time"): every ``kvtier ...`` command line in it names a command and flags that exist,
and the Quickstart snippet runs and prints what the README says it prints."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README = (REPO_ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    """The README's fenced code blocks tagged ``language`` ("" for untagged ones)."""
    blocks: list[str] = []
    current: list[str] | None = None
    tag = ""
    for line in README.splitlines():
        if line.startswith("```"):
            if current is None:
                current, tag = [], line[3:].strip()
            else:
                if tag == language:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _kvtier_command_lines() -> list[list[str]]:
    """Each ``kvtier ...`` invocation in the README's bash blocks and after a ``$ `` prompt in
    its output samples (and ``make demo ARGS=...``)."""
    lines = [line for block in _blocks("bash") for line in block.replace("\\\n", " ").splitlines()]
    lines += [line[2:] for block in _blocks("") for line in block.splitlines() if line.startswith("$ ")]
    found = []
    for line in lines:
        words = shlex.split(line.split("#", 1)[0].strip().rstrip("&"))
        if words[:1] == ["kvtier"]:
            found.append(words[1:])
        elif words[:2] == ["make", "demo"]:
            args = [w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")]
            found.append(["demo", *(shlex.split(args[0]) if args else [])])
    return found


def test_every_kvtier_command_in_the_readme_exists_with_its_flags() -> None:
    from kvtier.app.cli import main

    lines = _kvtier_command_lines()
    assert len(lines) >= 6, lines  # demo, serve, stats, cache ls, clear, ...
    for words in lines:
        command: click.Command = main
        while isinstance(command, click.Group) and words and not words[0].startswith("-"):
            assert words[0] in command.commands, f"`kvtier {' '.join(words)}`: no command {words[0]!r}"
            command, words = command.commands[words[0]], words[1:]
        flags = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        for word in words:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in flags, f"`kvtier ... {word}`: {command.name} has no such flag"


def _quickstart() -> str:
    section = README[README.index("## Quickstart"):]
    return _blocks("python")[[b in section for b in _blocks("python")].index(True)]


@pytest.mark.slow  # two subprocesses that import torch and transformers and load a model
def test_quickstart_prints_cached_tokens_and_their_tier_and_a_new_process_hits_disk(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    code = _quickstart()
    assert 'load_model("smollm2")' in code
    code = code.replace('load_model("smollm2")', 'load_model("tiny-llama")')  # no weights to download
    env = {**os.environ, "KVTIER_DATA_DIR": str(tmp_path / "data"), "KVTIER_CPU_BYTES": "64MiB",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs.append(proc.stdout.splitlines())
    pattern = re.compile(r"^prompt (\d+) tokens, (\d+) cached tokens(?: \((.+)\))?$")
    for lines in runs:
        assert len(lines) == 2 and all(pattern.match(line) for line in lines), lines
    first, second = ([pattern.match(line) for line in lines] for lines in runs)
    assert int(first[1][2]) > 0 and "CPU" in first[1][3]  # the follow-up hits the first request's blocks
    assert int(second[0][2]) > 0 and "DISK" in second[0][3]  # a new process: from DISK
