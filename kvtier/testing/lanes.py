"""pytest plugin (``-p kvtier.testing.lanes``, set in pyproject's ``addopts``): the fast lane.

``pytest -m "not slow"`` is the fast lane (README, "Tests"): every test that loads a real
model, starts other processes or runs long is marked ``slow`` and runs in the full suite
only. When pytest-xdist is installed (the ``test`` extra) this plugin runs the fast lane on
two worker processes, because most of its wall time is waiting (deadlines, sockets, I/O
threads) rather than CPU, so two workers on two cores halve it. Anything else is left as
typed: the full suite stays in one process (its timing-sensitive tests were written for
it), an explicit ``-n``/``-p no:xdist`` wins, and an xdist worker never adds workers.

It also keeps bytecode between runs where the environment turned it off
(``PYTHONDONTWRITEBYTECODE``, set on this project's machines): pytest then rewrites the
asserts of every test module and Python compiles every kvtier module again in each process,
7-9 s of CPU per process on this project's 2-core VM (``pytest --collect-only -m "not slow"``:
22.9 s of user time cold, 14.0-15.7 s with the cache), twice in the fast lane. Python's default is restored for the test run
only; the files go to ``__pycache__/`` folders, which git ignores.

The hook is pytest's documented way to add options before the command line is parsed
(https://docs.pytest.org/en/stable/reference/reference.html#pytest.hookspec.pytest_load_initial_conftests).
"""

from __future__ import annotations

import os
import sys

FAST_LANE = "not slow"
WORKERS = 2


def _markexpr(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
    return None


def _wants_one_process(args: list[str]) -> bool:
    return any(a.startswith(("-n", "--numprocesses", "--dist")) or a in ("no:xdist", "-pno:xdist") for a in args)


def pytest_load_initial_conftests(early_config, parser, args: list[str]) -> None:
    # Before any test module or conftest is imported: pytest reads the flag when it rewrites
    # one (https://docs.pytest.org/en/stable/how-to/assert.html#assertion-introspection-details).
    sys.dont_write_bytecode = False
    if os.environ.get("PYTEST_XDIST_WORKER") or _wants_one_process(args):
        return
    if (_markexpr(args) or "").strip() != FAST_LANE:
        return
    if not early_config.pluginmanager.hasplugin("xdist"):
        return
    args[:] = ["-n", str(min(WORKERS, os.cpu_count() or 1))] + args
