"""PNG plots beside a benchmark's JSON: what it measured as ratios to its baselines.

Every benchmark measures its machine's own baseline in the same run and reports ratios; a
`RatioPanel` draws one group of them as horizontal bars, with the line at the baseline (1x)
and, where the benchmark has them, its targets as markers. `OUT.json` gets `OUT.png`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RatioPanel", "write_ratio_plots", "plot_path"]


@dataclass(frozen=True, slots=True)
class RatioPanel:
    title: str
    ratios: Mapping[str, float]
    """Label -> measured / baseline."""
    baseline: str = "baseline"
    """What 1.0 is (e.g. "memcpy", "recompute", "redis-py")."""
    targets: Mapping[str, float] = field(default_factory=dict)
    better: str = "higher"
    """"higher" or "lower": which way is good (drawn in the axis label)."""


def plot_path(json_path: Path) -> Path:
    return json_path.with_suffix(".png")


def write_ratio_plots(json_path: Path, title: str, panels: Sequence[RatioPanel]) -> Path | None:
    """Draw `panels` into the PNG beside `json_path`; None when there is nothing to draw."""
    panels = [p for p in panels if p.ratios]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [max(1.6, 0.32 * len(p.ratios) + 0.9) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, sum(heights) + 0.6),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        labels = list(panel.ratios)
        values = [panel.ratios[label] for label in labels]
        rows = range(len(labels))
        colors = ["#3274d9" if v >= 1 else "#e0752d" for v in values]
        ax.barh(rows, values, color=colors, height=0.6)
        ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
        ax.text(1.0, len(labels) - 0.4, f" {panel.baseline} = 1x", fontsize=7, va="bottom")
        for row, label in enumerate(labels):
            ax.text(values[row], row, f" {values[row]:.2f}x", va="center", fontsize=7)
            if label in panel.targets:
                ax.plot(panel.targets[label], row, marker="|", markersize=14, color="#37872d")
        ax.set_yticks(list(rows), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(panel.title, fontsize=9, loc="left")
        ax.set_xlabel(f"ratio to {panel.baseline} ({panel.better} is better"
                      + ("; green tick: target" if panel.targets else "") + ")", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlim(0, max([*values, *panel.targets.values(), 1.0]) * 1.25)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = plot_path(json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
