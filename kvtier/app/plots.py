"""PNG plots of the demo and the benchmarks (matplotlib, Agg backend: no display needed).

- :func:`plot_demo`: TTFT per turn without and with kvtier, and each prompt's cached tokens,
  from the demo's JSON document (:meth:`kvtier.app.demo.DemoReport.summary`).
- :func:`plot_bench`: each benchmark row's value beside its same-run baseline, one panel per
  unit, from a benchmark's ``{"bench", "rows"}`` document (:mod:`bench.common`).
- :func:`plot_replay`: ``kvtier replay``'s miss-ratio curves, one panel per tier.

Both read the JSON documents the commands write, so saved results can be drawn again::

    python -m kvtier.app.plots bench/results/2026-11-30-cpu/tiers.json tiers.png

matplotlib is an optional dependency (``pip install 'kvtier[plot]'``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

_WITHOUT, _WITH, _BASE, _VALUE = "#9ca3af", "#2563eb", "#9ca3af", "#16a34a"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or 'kvtier[plot]')") from None
    matplotlib.use("Agg")  # never a window, also without a display
    import matplotlib.pyplot as plt

    return plt


def plot_demo(summary: Mapping[str, Any], path: str | Path) -> Path:
    """TTFT per turn (ms, log scale) without and with kvtier, and cached vs prompt tokens.

    Args:
        summary: the demo's JSON document (``turns`` with ``ttft_without_s``,
            ``ttft_with_s``, ``prompt_tokens``, ``cached_tokens``, ``conversation``, ``turn``).
        path: the PNG to write (parent directories are created).

    Raises:
        ValueError: no turns in ``summary``.
    """
    turns = list(summary.get("turns", []))
    if not turns:
        raise ValueError("expected a demo summary with at least one turn, got none")
    plt = _pyplot()
    xs = list(range(len(turns)))
    labels = [f"{t['conversation']}.{t['turn']}" for t in turns]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.35 * len(turns) + 3), 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    top.plot(xs, [t["ttft_without_s"] * 1e3 for t in turns], "o-", color=_WITHOUT,
             label="without kvtier (full prefill)")
    top.plot(xs, [t["ttft_with_s"] * 1e3 for t in turns], "o-", color=_WITH, label="with kvtier")
    top.set_yscale("log")
    top.set_ylabel("TTFT (ms, log scale)")
    title = f"kvtier demo: TTFT per turn ({summary.get('model_id', 'model')})"
    p50 = summary.get("ttft_p50_without_turn2plus_s"), summary.get("ttft_p50_with_turn2plus_s")
    if None not in p50:
        title += f"; turns >= 2: p50 {p50[0] * 1e3:.0f} -> {p50[1] * 1e3:.0f} ms"
    top.set_title(title)
    top.legend(loc="upper left")
    top.grid(True, which="both", alpha=0.3)
    bottom.bar(xs, [t["prompt_tokens"] for t in turns], color="#e5e7eb", label="prompt tokens")
    bottom.bar(xs, [t["cached_tokens"] for t in turns], color=_WITH, alpha=0.8, label="cached tokens (loaded)")
    bottom.set_ylabel("tokens")
    bottom.set_xlabel("conversation.turn")
    bottom.set_xticks(xs, labels, rotation=90 if len(turns) > 16 else 0)
    bottom.legend(loc="upper left")
    bottom.grid(True, axis="y", alpha=0.3)
    return _save(fig, plt, path)


def plot_bench(doc: Mapping[str, Any], path: str | Path) -> Path:
    """Each row's value beside its baseline (horizontal bars, one panel per unit), with the
    ratio written at the bar; rows without a baseline are drawn alone.

    Args:
        doc: ``{"bench": NAME, "rows": [{"metric", "value", "unit", "baseline", "ratio"}]}``.
        path: the PNG to write.

    Raises:
        ValueError: no rows.
    """
    rows = list(doc.get("rows", []))
    if not rows:
        raise ValueError(f"expected benchmark rows, got none in {doc.get('bench', 'the document')!r}")
    plt = _pyplot()
    units: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        units.setdefault(row["unit"], []).append(row)
    heights = [max(1.5, 0.55 * len(r) + 1.0) for r in units.values()]
    fig, axes = plt.subplots(len(units), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (unit, group) in zip(axes[:, 0], units.items()):
        ys = list(range(len(group)))[::-1]
        values = [r["value"] for r in group]
        baselines = [r["baseline"] if r["baseline"] is not None else 0 for r in group]
        ax.barh([y + 0.2 for y in ys], values, height=0.38, color=_VALUE, label="kvtier")
        ax.barh([y - 0.2 for y in ys], baselines, height=0.38, color=_BASE, label="baseline (same run)")
        for y, r in zip(ys, group):
            note = f"{r['value']:.3g}" + (f"  ({r['ratio']:.2f}x)" if r.get("ratio") is not None else "")
            ax.text(r["value"], y + 0.2, " " + note, va="center", fontsize=8)
        ax.set_yticks(ys, [r["metric"] for r in group], fontsize=8)
        ax.set_xlabel(unit)
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_xlim(0, max(values + baselines) * 1.3 or 1)
    axes[0, 0].set_title(f"kvtier bench: {doc.get('bench', '?')} (value vs same-run baseline)")
    axes[0, 0].legend(loc="lower right", fontsize=8)
    return _save(fig, plt, path)


def plot_replay(doc: Mapping[str, Any], path: str | Path) -> Path:
    """Miss-ratio curves of ``kvtier replay``: per tier, the hit rate of that tier and the
    faster ones against its capacity (log scale), kvtier's policy solid, plain LRU dashed,
    the run's own capacity and the recommended one marked.

    Args:
        doc: ``kvtier replay --json``'s document (``rows``, ``recommendations``, ``trace``).
        path: the PNG to write.

    Raises:
        ValueError: no rows.
    """
    rows = list(doc.get("rows", []))
    if not rows:
        raise ValueError("expected replay rows, got none")
    plt = _pyplot()
    tiers = [t for t in ("GPU", "CPU", "DISK") if any(r["tier"] == t for r in rows)]
    fig, axes = plt.subplots(1, len(tiers), figsize=(5 * len(tiers), 4.2), squeeze=False)
    colors = {"GPU": "#16a34a", "CPU": "#2563eb", "DISK": "#ea580c"}
    for ax, tier in zip(axes[0], tiers):
        for policy, style in (("kvtier", "o-"), ("lru", "s--")):
            curve = sorted((r for r in rows if r["tier"] == tier and r["policy"] == policy),
                           key=lambda r: r["capacity_blocks"])
            if curve:
                ax.plot([r["capacity_blocks"] for r in curve], [100 * r["cumulative_hit_rate"] for r in curve], style,
                        color=colors[tier], alpha=1.0 if policy == "kvtier" else 0.55, label=f"{policy}")
        for r in rows:
            if r["tier"] == tier and r["configured"] and r["policy"] == "kvtier":
                ax.axvline(r["capacity_blocks"], color="#6b7280", lw=1, ls=":", label="the run's capacity")
        for rec in doc.get("recommendations", []):
            if rec["tier"] == tier and rec["policy"] == "kvtier":
                ax.plot([rec["capacity_blocks"]], [100 * rec["cumulative_hit_rate"]], "*", ms=14, color="#111827",
                        label="recommended")
        ax.set_xscale("log")
        ax.set_xlabel(f"{tier} capacity (blocks)")
        ax.set_ylabel(f"hit rate, {tier} and faster tiers (%)")
        ax.set_ylim(0, 100)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    trace = doc.get("trace", {})
    fig.suptitle(f"kvtier replay: {trace.get('source', '')} ({trace.get('block_requests', 0):,} block requests)")
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_file(json_path: str | Path, png_path: str | Path) -> Path:
    """Draw a saved demo (``turns``) or benchmark (``rows``) JSON document."""
    doc = json.loads(Path(json_path).read_text())
    return plot_demo(doc, png_path) if "turns" in doc else plot_bench(doc, png_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m kvtier.app.plots RESULT.json OUT.png")
    print(plot_file(sys.argv[1], sys.argv[2]))
