"""``kvtier replay``: hit rate per tier against capacity for a trace, and the capacity to buy.

    kvtier replay TRACE                      a store's trace (KVTIER_TRACE_PATH) or a Mooncake JSONL
    kvtier replay --sharegpt --users 800     N ShareGPT users chatting at once (kvtier.app.traces)

For each tier (GPU, CPU, DISK) the tier's capacity goes over a grid (``--points`` values
from 1/256 of the trace's distinct blocks to all of them, and the run's own capacity) while
the other tiers keep theirs (the trace's, or ``--gpu-blocks`` ...). Each point is replayed
under kvtier's own policy (the store's placement and SLRU code, one pass per point) and plain
LRU (every point from one stack-distance pass): kvtier.app.replay. Printed: a table (80
columns), then for each tier the smallest capacity whose hit rate in that tier and the ones
above it is within 1% (relative) of the best on the grid: found by bisection between the two
grid points around it (``--refine`` more passes per tier for kvtier; exact for LRU). ``--json PATH`` writes ``{"rows":
[{"tier", "policy", "capacity_blocks", "hit_rate", "cumulative_hit_rate", "total_hit_rate",
"configured"}], "recommendations", "trace", "speed"}``; ``--plot PATH`` draws the curves.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import click

TIERS = ("GPU", "CPU", "DISK")
WITHIN = 0.01
"""A recommended capacity reaches at least (1 - WITHIN) of the best hit rate on the grid."""

_TRACE: Any = None  # the trace in each worker process (set once, never pickled per task)


def _init_worker(trace: Any) -> None:
    global _TRACE
    _TRACE = trace


def _replay_point(tiers: dict[str, int]) -> tuple[dict[str, int], int, dict[str, int], float]:
    from kvtier.app.replay import replay_kvtier

    t0 = time.perf_counter()
    result = replay_kvtier(_TRACE, tiers)
    return tiers, result.lookups, result.hits, time.perf_counter() - t0


def grid(unique_blocks: int, configured: int, points: int) -> list[int]:
    """``points`` capacities from ``unique/256`` to ``unique`` (geometric), and ``configured``."""
    import numpy as np

    low = max(1, unique_blocks // 256)
    values = {int(round(v)) for v in np.geomspace(low, max(unique_blocks, low + 1), points)}
    if configured > 0:
        values.add(configured)
    return sorted(v for v in values if v > 0)


def sweep(trace: Any, tiers: dict[str, int], points: int = 8, jobs: int = 1,
          policies: tuple[str, ...] = ("kvtier", "lru"), refine: int = 4) -> dict[str, Any]:
    """Every row of the replay (see the module docstring) and the passes' speed."""
    from kvtier.app.replay import stack_distances

    unique = trace.unique_blocks
    plans = [(t, c) for t in TIERS if tiers.get(t, 0) > 0 for c in grid(unique, tiers[t], points)]
    rows: list[dict[str, Any]] = []
    speed: dict[str, Any] = {"block_requests": trace.block_requests}
    if "kvtier" in policies:
        t0 = time.perf_counter()
        _init_worker(trace)
        pool = ProcessPoolExecutor(min(jobs, len(plans)), initializer=_init_worker, initargs=(trace,)) if jobs > 1 else None
        try:
            passes = _kvtier_rows(plans, tiers, rows, pool)
            passes += sum(_bisect(rows, tier, tiers, refine, pool) for tier in TIERS if tiers.get(tier, 0) > 0)
        finally:
            if pool is not None:
                pool.shutdown()
        speed["kvtier_passes"] = passes[0]
        speed["kvtier_wall_s"] = time.perf_counter() - t0
        speed["kvtier_block_requests_per_s"] = trace.block_requests * passes[0] / max(passes[1], 1e-9)
    if "lru" in policies:
        t0 = time.perf_counter()
        distances = stack_distances(trace)
        speed["lru_pass_s"] = time.perf_counter() - t0
        speed["lru_block_requests_per_s"] = trace.block_requests / max(speed["lru_pass_s"], 1e-9)
        for tier, c in plans:
            rows.append(_row(tier, "lru", c, trace.block_requests, distances.hits({**tiers, tier: c}), tiers))
        for tier in TIERS:
            if tiers.get(tier, 0) > 0:
                c = _lru_smallest(distances, tiers, tier, rows)
                rows.append(_row(tier, "lru", c, trace.block_requests, distances.hits({**tiers, tier: c}), tiers))
    rows = list({(r["tier"], r["policy"], r["capacity_blocks"]): r for r in rows}.values())
    return {"rows": rows, "recommendations": recommend(rows), "speed": speed,
            "trace": {"source": trace.source, "block_size": trace.block_size, "requests": len(trace.requests),
                      "block_requests": trace.block_requests, "unique_blocks": unique, "tiers": tiers}}


class _Passes(tuple):
    """``(passes, seconds)`` that add up."""

    def __add__(self, other: Any) -> "_Passes":  # type: ignore[override]
        return _Passes((self[0] + other[0], self[1] + other[1]))

    def __radd__(self, other: Any) -> "_Passes":
        return self if other == 0 else self + other


def _kvtier_rows(plans: list[tuple[str, int]], tiers: dict[str, int], rows: list, pool: Any) -> _Passes:
    """One kvtier pass per ``(tier, capacity)``; rows added; the passes made."""
    configs = [{**tiers, tier: c} for tier, c in plans]
    results = list(pool.map(_replay_point, configs)) if pool is not None else [_replay_point(c) for c in configs]
    for (tier, c), (_, lookups, hits, _) in zip(plans, results):
        rows.append(_row(tier, "kvtier", c, lookups, hits, tiers))
    return _Passes((len(configs), sum(r[3] for r in results)))


def _bisect(rows: list, tier: str, tiers: dict[str, int], steps: int, pool: Any) -> _Passes:
    """Narrow the smallest capacity within :data:`WITHIN` of the best (kvtier) by bisection
    between the grid points around it; rows added."""
    done = _Passes((0, 0.0))
    for _ in range(steps):
        curve = sorted((r for r in rows if r["tier"] == tier and r["policy"] == "kvtier"),
                       key=lambda r: r["capacity_blocks"])
        best = max(r["cumulative_hit_rate"] for r in curve)
        i = next(i for i, r in enumerate(curve) if r["cumulative_hit_rate"] >= (1 - WITHIN) * best)
        if i == 0 or curve[i]["capacity_blocks"] - curve[i - 1]["capacity_blocks"] < 2:
            break
        middle = (curve[i - 1]["capacity_blocks"] + curve[i]["capacity_blocks"]) // 2
        done = done + _kvtier_rows([(tier, middle)], tiers, rows, pool)
    return done


def _lru_smallest(distances: Any, tiers: dict[str, int], tier: str, rows: list) -> int:
    """The smallest capacity of ``tier`` within :data:`WITHIN` of its best LRU cumulative
    hit rate on the grid (exact: binary search over every capacity)."""
    above = TIERS[: TIERS.index(tier) + 1]
    curve = [r for r in rows if r["tier"] == tier and r["policy"] == "lru"]
    best = max(r["cumulative_hit_rate"] for r in curve)
    target = (1 - WITHIN) * best * distances.own.size
    lo, hi = 1, max(r["capacity_blocks"] for r in curve)
    while lo < hi:
        mid = (lo + hi) // 2
        hits = distances.hits({**tiers, tier: mid})
        if sum(hits.get(t, 0) for t in above) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _row(tier: str, policy: str, capacity: int, lookups: int, hits: dict[str, int], tiers: dict[str, int]) -> dict:
    above = TIERS[: TIERS.index(tier) + 1]
    rate = (lambda n: n / lookups if lookups else 0.0)
    return {"tier": tier, "policy": policy, "capacity_blocks": capacity, "hit_rate": rate(hits.get(tier, 0)),
            "cumulative_hit_rate": rate(sum(hits.get(t, 0) for t in above)), "total_hit_rate": rate(sum(hits.values())),
            "configured": capacity == tiers.get(tier)}


def recommend(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tier and policy: the smallest capacity within :data:`WITHIN` of the best
    cumulative hit rate (that tier and the faster ones) on the grid."""
    out = []
    for tier in TIERS:
        for policy in ("kvtier", "lru"):
            curve = sorted((r for r in rows if r["tier"] == tier and r["policy"] == policy),
                           key=lambda r: r["capacity_blocks"])
            if not curve:
                continue
            best = max(r["cumulative_hit_rate"] for r in curve)
            pick = next(r for r in curve if r["cumulative_hit_rate"] >= (1 - WITHIN) * best)
            out.append({"tier": tier, "policy": policy, "capacity_blocks": pick["capacity_blocks"],
                        "cumulative_hit_rate": pick["cumulative_hit_rate"], "best_cumulative_hit_rate": best})
    return out


def render(doc: dict[str, Any]) -> list[str]:
    """The table and the recommendations, at most 80 columns."""
    t = doc["trace"]
    lines = [f"kvtier replay: {t['source']}"[:80],
             f"{t['requests']:,} requests, {t['block_requests']:,} block requests, {t['unique_blocks']:,} distinct "
             f"blocks of {t['block_size']} tokens"[:80],
             "tiers (blocks): " + ", ".join(f"{k} {v:,}" for k, v in t["tiers"].items() if v),
             "", f"{'tier':<5}{'capacity':>11}  {'kvtier: tier':>12}{'<= tier':>9}{'all':>8}  {'lru: tier':>9}{'<= tier':>9}"]
    by_key = {(r["tier"], r["policy"], r["capacity_blocks"]): r for r in doc["rows"]}
    for tier, _, capacity in sorted({(r["tier"], 0, r["capacity_blocks"]) for r in doc["rows"]},
                                    key=lambda k: (TIERS.index(k[0]), k[2])):
        k, lr = by_key.get((tier, "kvtier", capacity)), by_key.get((tier, "lru", capacity))
        mark = "=" if (k or lr)["configured"] else " "
        cells = [f"{x:.1%}" if x is not None else "-" for x in (
            k and k["hit_rate"], k and k["cumulative_hit_rate"], k and k["total_hit_rate"],
            lr and lr["hit_rate"], lr and lr["cumulative_hit_rate"])]
        lines.append(f"{tier:<5}{capacity:>10,}{mark} {cells[0]:>12}{cells[1]:>9}{cells[2]:>8}  {cells[3]:>9}{cells[4]:>9}")
    lines += ["", "= the run's own capacity; hit rates per block looked up; <= tier: that tier",
              "  and the faster ones", f"recommended: the smallest capacity within {WITHIN:.0%} of the best '<= tier'"]
    for r in doc["recommendations"]:
        lines.append(f"  {r['tier']:<5}{r['policy']:<7}{r['capacity_blocks']:>10,} blocks: {r['cumulative_hit_rate']:.1%} "
                     f"(best {r['best_cumulative_hit_rate']:.1%})")
    s = doc["speed"]
    if "kvtier_block_requests_per_s" in s:
        lines.append(f"speed: kvtier {s['kvtier_block_requests_per_s']:,.0f} block requests/s per pass "
                     f"({s['kvtier_passes']} passes)"[:80])
    if "lru_block_requests_per_s" in s:
        lines.append(f"       lru {s['lru_block_requests_per_s']:,.0f} block requests/s (one pass, all capacities)")
    return lines


@click.command("replay")
@click.argument("trace_path", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--sharegpt", is_flag=True, help="Build the trace from ShareGPT conversations (N users at once).")
@click.option("--users", type=click.IntRange(1), default=800, show_default=True, help="With --sharegpt.")
@click.option("--turns", type=click.IntRange(1), default=8, show_default=True, help="With --sharegpt: turns per user.")
@click.option("--seed", type=int, default=0, show_default=True, help="With --sharegpt.")
@click.option("--tokenizer", type=click.Choice(["words", "smollm2"]), default="words", show_default=True,
              help="With --sharegpt: word ids (no model) or SmolLM2's tokenizer and chat template.")
@click.option("--block-size", type=click.IntRange(1), default=None,
              help="Tokens per block (--sharegpt: default 16; a Mooncake trace: default 512).")
@click.option("--gpu-blocks", type=click.IntRange(0), default=None, help="GPU capacity (default: the trace's).")
@click.option("--cpu-blocks", type=click.IntRange(0), default=None, help="CPU capacity (default: the trace's).")
@click.option("--disk-blocks", type=click.IntRange(0), default=None, help="DISK capacity (default: the trace's).")
@click.option("--points", type=click.IntRange(2, 64), default=8, show_default=True, help="Capacities per tier.")
@click.option("--refine", type=click.IntRange(0, 16), default=4, show_default=True,
              help="kvtier passes per tier bisecting towards the recommended capacity.")
@click.option("--policy", "policies", type=click.Choice(["kvtier", "lru"]), multiple=True,
              help="Policies to replay (default both).")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Processes for the kvtier passes (default: cores).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the rows as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw the curves as a PNG here (needs matplotlib).")
@click.option("--save-trace", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --sharegpt: also write the built trace (kvtier's trace format) here.")
def replay(trace_path: Path | None, sharegpt: bool, users: int, turns: int, seed: int, tokenizer: str,
           block_size: int | None, gpu_blocks: int | None, cpu_blocks: int | None, disk_blocks: int | None,
           points: int, refine: int, policies: tuple[str, ...], jobs: int | None, json_path: Path | None, plot_path: Path | None,
           save_trace: Path | None) -> None:
    """Hit rate per tier against capacity (kvtier's SLRU and plain LRU), and what to buy."""
    from kvtier.app.traces import read_trace, sharegpt_trace, write_trace

    if (trace_path is None) == (not sharegpt):
        raise click.UsageError("give a TRACE file or --sharegpt (one of them)")
    try:
        trace = (read_trace(trace_path, block_size) if trace_path is not None else
                 sharegpt_trace(users, turns, seed, block_size or 16, tokenizer))
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if save_trace is not None:
        write_trace(trace, save_trace)
    tiers = dict(trace.tiers or default_tiers(trace.unique_blocks))
    for name, value in (("GPU", gpu_blocks), ("CPU", cpu_blocks), ("DISK", disk_blocks)):
        if value is not None:
            tiers[name] = value
    if not tiers.get("GPU") and not tiers.get("CPU"):
        raise click.UsageError("expected a GPU or CPU tier of >= 1 block")
    doc = sweep(trace, tiers, points, jobs or os.cpu_count() or 1, tuple(policies) or ("kvtier", "lru"), refine)
    for line in render(doc):
        click.echo(line)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=1))
        click.echo(f"rows written to {json_path}")
    if plot_path is not None:
        from kvtier.app.plots import plot_replay

        click.echo(f"plot written to {plot_path and plot_replay(doc, plot_path)}")


def default_tiers(unique_blocks: int) -> dict[str, int]:
    """Capacities for a trace that names none: GPU 1/16, CPU 1/4, DISK all of its blocks."""
    return {"GPU": max(1, unique_blocks // 16), "CPU": max(1, unique_blocks // 4), "DISK": unique_blocks}
