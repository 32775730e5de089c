"""Benchmark figures as PNG (`--plot PATH`): throughput against the swept load (batch size or concurrency),
and each latency's distribution at every load, one box per load. matplotlib is the `plot` extra.

The figure is drawn on matplotlib's Agg canvas directly (no pyplot), so no display or global backend is
touched.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path


def check_plot_available(path: str | None) -> None:
    """Fail before a benchmark runs, not after, when `--plot` cannot be honoured."""
    if path is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'kestrel[plot]'")


def plot_sweep(path: str, title: str, load_name: str, loads: list[int], throughput: dict[str, list[float]],
               latencies: dict[str, list[list[float]]], throughput_unit: str = "tokens/s",
               latency_unit: str = "ms") -> None:
    """One throughput panel (a line per `throughput` series, over `loads`) and one panel per latency
    metric (a box per load of its samples); saved as a PNG at `path`."""
    from matplotlib.figure import Figure

    panels = 1 + len(latencies)
    fig = Figure(figsize=(4.8 * panels, 4.2), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    ax = axes[0]
    for name, values in throughput.items():
        ax.plot(loads, values, marker="o", label=name)
    if len(loads) > 1 and min(loads) > 0 and max(loads) / min(loads) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [str(x) for x in loads])
    ax.set(xlabel=load_name, ylabel=throughput_unit, title="throughput")
    values = [v for series in throughput.values() for v in series if v > 0]
    if values and max(values) / min(values) > 20:  # e.g. prefill and decode tokens/s: both stay readable
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    for ax, (name, samples) in zip(axes[1:], latencies.items()):
        ax.boxplot(samples, tick_labels=[str(x) for x in loads], showfliers=True, flierprops={"markersize": 2})
        ax.set(xlabel=load_name, ylabel=latency_unit, title=name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
