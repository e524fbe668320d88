"""A picture of the Grafana dashboard (dashboard.json) drawn with matplotlib from a Prometheus.

No Grafana can be installed from the package registries these machines reach, so this draws
what Grafana would: every panel's targets queried over a time range from a real Prometheus
(`query_range`, the API Grafana itself calls), one line per series named by the target's
`legendFormat`, panels and row headers placed on the dashboard's own 24-column grid
(`gridPos`), y axes in the panel's unit. Only the `timeseries` and `row` panel types it uses
are drawn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deploy.observability.prometheus import PrometheusServer
from deploy.observability.promql import RATE_INTERVAL

__all__ = ["render_dashboard", "legend"]

_ROW_UNITS = 30.0  # pixels per grid row, as in Grafana
_COL_PIXELS = 60.0
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def legend(template: str, labels: Mapping[str, str]) -> str:
    """Grafana's `{{label}}` substitution (an empty template: the series' labels)."""
    if not template:
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), template)


def render_dashboard(dashboard_path: Path, prometheus: PrometheusServer, start: float,
                     end: float, out: Path, *, step: float = 2.0, dpi: int = 75,
                     rate_interval: str = "10s") -> int:
    """Draw the dashboard over [start, end] into `out` (PNG); returns the series drawn.
    `rate_interval` stands for Grafana's `$__rate_interval` (a short run wants a short one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard: dict[str, Any] = json.loads(dashboard_path.read_text())
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    width_px, height_px = 24 * _COL_PIXELS, rows * _ROW_UNITS + 40
    fig = plt.figure(figsize=(width_px / 100, height_px / 100), dpi=100,
                     facecolor="#111217")
    fig.text(0.01, 1 - 20 / height_px, f"{dashboard['title']}  (drawn from a real run's "
             f"Prometheus: {end - start:.0f} s, rate window {rate_interval})", color="#d8d9da",
             fontsize=11, va="center")
    drawn = 0
    for panel in panels:
        pos = panel["gridPos"]
        left = pos["x"] / 24
        bottom = 1 - (40 + (pos["y"] + pos["h"]) * _ROW_UNITS) / height_px
        w, h = pos["w"] / 24, pos["h"] * _ROW_UNITS / height_px
        if panel["type"] == "row":
            fig.text(left + 0.005, bottom + h / 2, panel["title"], color="#6e9fff",
                     fontsize=10, fontweight="bold", va="center")
            continue
        ax = fig.add_axes((left + 0.03, bottom + 0.035 * 7 / pos["h"] / 3 + 0.012,
                           w - 0.045, h - 0.05))
        ax.set_facecolor("#181b1f")
        ax.set_title(panel["title"], color="#d8d9da", fontsize=8, loc="left")
        ax.tick_params(colors="#8e8e8e", labelsize=6)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.grid(color="#2c3235", linewidth=0.5)
        for target in panel.get("targets", ()):
            expr = target["expr"].replace(RATE_INTERVAL, rate_interval)
            for series in prometheus.query_range(expr, start, end, step):
                if not series.points:
                    continue
                xs = [t - start for t, _ in series.points]
                ys = [v for _, v in series.points]
                ax.plot(xs, ys, linewidth=1.0,
                        label=legend(target.get("legendFormat", ""), series.labels))
                drawn += 1
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_xlim(0, end - start)
        ax.set_xlabel("seconds into the run", color="#8e8e8e", fontsize=6, labelpad=1)
        if unit:
            ax.set_ylabel(unit, color="#8e8e8e", fontsize=6, labelpad=1)
        if ax.lines:
            ax.legend(fontsize=5, loc="upper left", facecolor="#181b1f", edgecolor="#2c3235",
                      labelcolor="#d8d9da", ncol=2)
        else:
            ax.text(0.5, 0.5, "no data", color="#8e8e8e", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, facecolor=fig.get_facecolor())
    plt.close(fig)
    return drawn
