"""The sweep's picture: p90 TTFT of resumed turns against concurrent agents, one line per
configuration, the SLO as a horizontal line — where each line crosses it is its capacity."""

from __future__ import annotations

from pathlib import Path

from benchmarks import reporting
from benchmarks.capacity.sweep import StepSummary, capacity


def plot(
    summaries: dict[str, list[StepSummary]], slo_s: float, path: Path, title: str
) -> Path | None:
    """Write the plot to ``path`` (None where matplotlib is missing)."""
    plt = reporting.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, steps in summaries.items():
        steps = sorted(steps, key=lambda s: s.agents)
        ax.plot(
            [s.agents for s in steps],
            [s.resumed_p90 for s in steps],
            marker="o",
            label=f"{name} (capacity {capacity(steps)})",
        )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.axhline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:.2f} s")
    reporting.save_plot(fig, ax, path, "concurrent agents", "p90 TTFT of resumed turns (s)", title)
    return path
