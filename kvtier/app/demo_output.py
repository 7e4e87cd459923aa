"""What ``kvtier demo`` prints: progress as it runs, then a table and the figures that matter.

Output that reads anywhere (issue 16):

- on a terminal: a spinner while the model loads, a rich progress bar over the turns;
- in a pipe or a log file: one timestamped line per step and per turn as it finishes
  (``15:42:01 [6/32] conv 2 turn 2: 108 tok, 80 cached (CPU); TTFT 487 -> 250 ms; same``),
  no colour, no cursor movement, long lines never broken;
- the table in full form when the console is wide enough, else a compact form that fits 80
  columns (rich takes the width from the terminal, else ``$COLUMNS``, else 80);
- after the table, a legend, then each figure in words, the goals with what they mean, and a
  warning when the host's load average exceeded its cores during the run.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

from rich import box
from rich.console import Console
from rich.table import Table

from kvtier.app.demo import (
    GOAL_FIRST_TURN_MAX_RATIO,
    GOAL_MAX_RATIO,
    GOAL_MIN_CACHED_TOKENS,
    DemoReport,
    TurnResult,
    percentile,
)

LEGEND = ("TTFT = time to first token; without = full prefill; with = kvtier's lookup and load of the cached "
          "prefix plus the prefill of the rest; speedup = without / with; same = identical greedy output")
GOAL_LEGEND = (f"goals = median of TTFT with / without kvtier: <= {GOAL_MAX_RATIO} where >= "
               f"{GOAL_MIN_CACHED_TOKENS} tokens are cached (5x faster), <= {GOAL_FIRST_TURN_MAX_RATIO} "
               "on a first-turn miss (the lookup costs < 5%)")


class ConsoleOutput:
    """The demo's :class:`~kvtier.app.demo.DemoOutput` on a rich console.

    Args:
        console: where to print (default: stdout; a terminal gets live progress).
    """

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self.live = self.console.is_terminal
        self._bar: Any = None
        self._task: Any = None

    # -- as it runs ----------------------------------------------------------------------------
    def note(self, text: str) -> None:
        if self.live:
            self.console.print(text, highlight=False, markup=False)
        else:
            self._line(text)

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        started = time.perf_counter()
        if self.live:
            with self.console.status(text + " ..."):
                yield
            self.console.print(f"{text}: {time.perf_counter() - started:.0f} s", highlight=False, markup=False)
        else:
            self._line(text + " ...")
            yield
            self._line(f"{text}: done in {time.perf_counter() - started:.0f} s")

    def begin_turns(self, total: int) -> None:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=True)
            self._task = self._bar.add_task("turn 1", total=total)
            self._bar.start()
        else:
            self._line(f"running {total} turns, each without and then with kvtier")

    def turn_done(self, result: TurnResult, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"conv {result.conversation} turn {result.turn}")
        else:
            self._line(f"[{done}/{total}] " + turn_line(result))

    def end_turns(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _line(self, text: str) -> None:
        self.console.print(f"{time.strftime('%H:%M:%S')} {text}", highlight=False, markup=False, soft_wrap=True)

    # -- at the end ----------------------------------------------------------------------------
    def report(self, report: DemoReport, total_s: float) -> None:
        """The table, the legend, the figures, the goals and the run's conditions."""
        self.console.print()
        self.console.print(turn_table(report, self.console.width), highlight=False)
        for line in [LEGEND, *differences(report), *summary_lines(report, total_s)]:
            self.console.print(line, highlight=False, markup=False, soft_wrap=not self.live)


def turn_line(t: TurnResult) -> str:
    """One turn in a log line."""
    same = "same" if t.identical else f"DIFFERS at token {t.first_diff}"
    return (f"conv {t.conversation} turn {t.turn}: {t.prompt_tokens} tok, {t.cached_tokens} cached "
            f"({_tiers(t)}); TTFT {t.ttft_without_s * 1e3:.0f} -> {t.ttft_with_s * 1e3:.0f} ms; {same}")


def _tiers(t: TurnResult) -> str:
    if not t.cached_by_tier:
        return "miss"
    if len(t.cached_by_tier) == 1:
        return next(iter(t.cached_by_tier))
    return ", ".join(f"{tier} {n}" for tier, n in t.cached_by_tier.items())


def turn_table(report: DemoReport, width: int) -> Table:
    """The full table when it fits ``width`` columns, else the compact one (80 columns)."""
    full = _table(report, compact=False)
    if Console(width=10_000).measure(full).maximum <= width:
        return full
    return _table(report, compact=True)


def _table(report: DemoReport, compact: bool) -> Table:
    if compact:
        heads = ["conv", "turn", "prompt", "cached", "tier", "TTFT w/o", "TTFT with", "speedup", "same"]
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title=f"{report.model_id}: TTFT per turn")
    else:
        heads = ["conv", "turn", "prompt tokens", "cached tokens (tier)", "TTFT without", "TTFT with", "speedup",
                 "identical"]
        table = Table(title=f"kvtier demo: {report.model_id}, history = {report.options.history}")
    for head in heads:
        table.add_column(head, justify="left" if head in ("tier", "cached tokens (tier)", "same", "identical")
                         else "right", no_wrap=True)
    for t in report.turns:
        tiers = "+".join(t.cached_by_tier)  # fastest first: "CPU+DISK"
        cached = [str(t.cached_tokens), tiers] if compact else [_cached_cell(t)]
        table.add_row(str(t.conversation), str(t.turn), str(t.prompt_tokens), *cached,
                      f"{t.ttft_without_s * 1e3:.0f} ms", f"{t.ttft_with_s * 1e3:.0f} ms",
                      f"{t.ttft_without_s / t.ttft_with_s:.2f}x", "yes" if t.identical else "NO")
    return table


def _cached_cell(t: TurnResult) -> str:
    if not t.cached_tokens:
        return "0"
    if len(t.cached_by_tier) == 1:
        return f"{t.cached_tokens} {t.cached_from}"
    return f"{t.cached_tokens} ({_tiers(t)})"


def differences(report: DemoReport) -> list[str]:
    """A line per turn whose output differs: where, and whether it is a float near-tie."""
    lines = []
    for t in report.turns:
        if t.identical:
            continue
        margin = "unknown" if t.margin_at_diff is None else f"{t.margin_at_diff:.2g}"
        kind = " (a near-tie: float rounding)" if t.margin_at_diff is not None and t.margin_at_diff < 1e-3 else ""
        lines.append(f"conv {t.conversation} turn {t.turn}: outputs differ from token {t.first_diff}; "
                     f"top-2 logit margin there {margin}{kind}")
    return lines


def summary_lines(report: DemoReport, total_s: float) -> list[str]:
    """The figures under the table, one per line."""
    s = report.summary()
    prompt = sum(t.prompt_tokens for t in report.turns)
    cached = sum(t.cached_tokens for t in report.turns)
    tiers = ", ".join(f"{m} {n}" for m, n in sorted(s["cached_tokens_by_tier"].items())) or "none"
    later = sum(1 for t in report.turns if t.turn >= 2)
    busy = " (host busy: see the warning)" if report.host_busy else ""
    cores = os.cpu_count()
    lines = [
        f"prompt tokens served from kvtier: {s['token_hit_rate']:.1%} ({cached} of {prompt}; by tier: {tiers})",
        f"TTFT p50 (p90), all {len(report.turns)} turns: without {_s(s['ttft_p50_without_s'])} "
        f"({_s(s['ttft_p90_without_s'])}), with {_s(s['ttft_p50_with_s'])} ({_s(s['ttft_p90_with_s'])})",
        f"TTFT p50 (p90), {later} turns >= 2: without {_s(s['ttft_p50_without_turn2plus_s'])} "
        f"({_s(s['ttft_p90_without_turn2plus_s'])}), with {_s(s['ttft_p50_with_turn2plus_s'])} "
        f"({_s(s['ttft_p90_with_turn2plus_s'])}); median speedup {_x(s['median_speedup_turn2plus'])}",
        f"identical output: {s['identical_turns']} of {s['total_turns']} turns",
        GOAL_LEGEND,
        goal_line(f"turns with >= {GOAL_MIN_CACHED_TOKENS} cached tokens", report.goal_turns(), GOAL_MAX_RATIO) + busy,
        goal_line("first turns that miss", report.first_turn_misses(), GOAL_FIRST_TURN_MAX_RATIO) + busy,
        f"DISK: {report.disk_blocks_before} -> {report.disk_blocks_after} blocks in {report.data_dir / 'disk'} "
        "(memory tiers are flushed there on close): run again and turn 1 hits from DISK; "
        "`kvtier cache ls` shows its size, `kvtier clear` removes it",
        f"runtime {total_s:.0f} s (set-up {report.load_s:.0f} s, turns {report.run_s:.0f} s); load average "
        f"{_load(report.load_average[0])} before, {_load(max(report.load_averages))} at most during the turns, "
        f"on {cores} cores",
    ]
    if report.host_busy:
        lines.append(
            f"warning: the host's load average reached {_load(max(report.load_averages))} on {cores} cores during "
            "the run (other processes competed for them): figures unreliable: rerun with --threads 1 on a quiet host"
        )
    return lines


def goal_line(what: str, turns: list[TurnResult], max_ratio: float) -> str:
    """``goal, <what> (n=6): 0.132 (max 0.247; goal <= 0.2): met``."""
    if not turns:
        return f"goal, {what}: no such turns in this run"
    ratios = [t.ttft_with_s / t.ttft_without_s for t in turns]
    median = percentile(ratios, 50)
    assert median is not None
    verdict = "met" if median <= max_ratio else "NOT met"
    return f"goal, {what} (n={len(turns)}): {median:.3f} (max {max(ratios):.3f}; goal <= {max_ratio}): {verdict}"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _load(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.1f}"
