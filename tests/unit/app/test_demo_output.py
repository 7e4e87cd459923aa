"""What ``kvtier demo`` prints, from a made-up report (no model): the table's two forms, the
figures in words, the goals and the host-load warning (kvtier.app.demo_output)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

from kvtier.app.demo import DemoOptions, DemoReport, TurnResult
from kvtier.app.demo_output import ConsoleOutput, summary_lines, turn_line, turn_table


def _turn(conv: int, turn: int, prompt: int, cached: dict[str, int], without: float, with_: float,
          identical: bool = True) -> TurnResult:
    total = sum(cached.values())
    return TurnResult(conv, turn, prompt, total, max(cached, key=cached.get) if cached else None, cached, without,
                      with_, identical, None if identical else 3, None if identical else 0.0004, 32)


def _report(loads: list[float]) -> DemoReport:
    turns = [
        _turn(1, 1, 60, {}, 0.300, 0.310),
        _turn(1, 2, 108, {"CPU": 80}, 0.500, 0.250),
        _turn(2, 1, 1054, {"CPU": 16}, 2.000, 2.050),
        _turn(2, 2, 1109, {"CPU": 1024, "DISK": 32}, 2.400, 0.300),
        _turn(2, 3, 1162, {"DISK": 1104}, 2.600, 0.650, identical=False),
    ]
    return DemoReport(DemoOptions(), "SmolLM2-135M-Instruct", Path("/data"), turns, 0, 0, 90, 30.0, 60.0, 16, loads,
                      long_conversations=1)


def _printed(renderable, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_table_is_compact_within_80_columns_and_full_when_there_is_room() -> None:
    report = _report([0.5, 0.6])
    narrow = _printed(turn_table(report, 80), 80)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert re.search(r"\n\s*2\s+2\s+1109\s+1056\s+CPU\+DISK\s+2400 ms\s+300 ms\s+8\.00x\s+yes", narrow)
    assert "…" not in narrow  # nothing cut
    wide = _printed(turn_table(report, 200), 200)
    assert "cached tokens (tier)" in wide and "1056 (CPU 1024, DISK 32)" in wide
    assert max(len(line) for line in wide.splitlines()) > 80  # the full form uses the room


def test_summary_explains_the_goals_and_gives_each_a_figure() -> None:
    lines = summary_lines(_report([0.5, 0.6, 0.7]), 100.0)
    text = "\n".join(lines)
    assert "prompt tokens served from kvtier: 64.6% (2256 of 3493; by tier: CPU 1120, DISK 1136)" in text
    assert "identical output: 4 of 5 turns" in text
    assert any(line.startswith("goals = median of TTFT with / without kvtier") for line in lines)
    # >= 1000 cached: turns (2, 2) 0.125 and (2, 3) 0.25 -> median 0.1875
    assert "goal, turns with >= 1000 cached tokens (n=2): 0.188 (max 0.250; goal <= 0.2): met" in text
    # first-turn misses: 1.033 and 1.025 -> median 1.029
    assert "goal, first turns that miss (n=2): 1.029 (max 1.033; goal <= 1.05): met" in text
    assert "warning" not in text and "host busy" not in text


def test_a_busy_host_marks_the_verdicts_and_warns_once() -> None:
    cores = os.cpu_count() or 1
    lines = summary_lines(_report([0.5, cores + 1.5, 0.5]), 100.0)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and f"reached {cores + 1.5:.1f} on {cores} cores" in warnings[0]
    assert "rerun with --threads 1 on a quiet host" in warnings[0]
    assert all(line.endswith("(host busy: see the warning)") for line in lines if line.startswith("goal,"))


def test_no_goal_turns_reads_as_such() -> None:
    report = _report([0.5, 0.5])
    report.turns = report.turns[:2]
    assert "goal, turns with >= 1000 cached tokens: no such turns in this run" in summary_lines(report, 1.0)


def test_turn_line_and_piped_progress_are_plain_timestamped_lines() -> None:
    report = _report([0.5, 0.5])
    assert turn_line(report.turns[3]) == ("conv 2 turn 2: 1109 tok, 1056 cached (CPU 1024, DISK 32); "
                                          "TTFT 2400 -> 300 ms; same")
    assert turn_line(report.turns[0]).endswith("0 cached (miss); TTFT 300 -> 310 ms; same")
    assert "DIFFERS at token 3" in turn_line(report.turns[4])
    buffer = io.StringIO()
    output = ConsoleOutput(Console(file=buffer, width=80))  # not a terminal: lines, no bar
    with output.step("loading"):
        pass
    output.begin_turns(5)
    for i, turn in enumerate(report.turns, start=1):
        output.turn_done(turn, i, 5)
    output.end_turns()
    output.report(report, 90.0)
    text = buffer.getvalue()
    assert "\r" not in text and "\x1b" not in text
    stamped = [line for line in text.splitlines() if re.match(r"\d\d:\d\d:\d\d \[\d/5\] conv", line)]
    assert len(stamped) == 5
    assert "conv 2 turn 3: outputs differ from token 3; top-2 logit margin there 0.0004 (a near-tie" in text


@pytest.mark.parametrize("width", [80, 120])
def test_whole_report_fits_the_console_width_except_unbreakable_lines(width: int) -> None:
    buffer = io.StringIO()
    ConsoleOutput(Console(file=buffer, width=width)).report(_report([0.5, 0.5]), 90.0)
    table = buffer.getvalue().split("TTFT = time to first token")[0]
    assert max(len(line) for line in table.splitlines()) <= width
