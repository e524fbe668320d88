"""PNG plots of a simulation report (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.sim.cluster import SimResult

__all__ = ["ladder_plots", "failover_plot"]


def _series(ax: Any, policies: Mapping[str, Mapping[str, Any]], key: str, *,
            log: bool = False) -> None:
    cmap = plt.get_cmap("tab20")
    colours = [cmap(i / 19) for i in range(20)]
    markers = "os^vD<>"
    for i, (name, block) in enumerate(policies.items()):
        ys = [y if y is not None else float("nan") for y in block[key]]
        ax.plot(block["qps"], ys, "-" + markers[i % len(markers)], label=name, markersize=3,
                linewidth=1.2, color=colours[i % len(colours)])
    ax.set_xlabel("QPS")
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


def ladder_plots(policies: Mapping[str, Mapping[str, Any]], out: Path, title: str
                 ) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    _series(axes[0], policies, "output_tok_s")
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title("throughput")
    _series(axes[1], policies, "ttft_p50_s", log=True)
    axes[1].set_ylabel("TTFT p50 (s)")
    axes[1].set_title("TTFT p50")
    _series(axes[2], policies, "ttft_p90_s", log=True)
    axes[2].set_ylabel("TTFT p90 (s)")
    axes[2].set_title("TTFT p90")
    axes[2].legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "ladder.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))

    fig, ax = plt.subplots(figsize=(8, 5))
    _series(ax, policies, "goodput_tok_s")
    ax.set_ylabel("output tokens / s with TTFT <= 2 s")
    ax.set_title(f"goodput at TTFT <= 2 s: {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))

    fig, ax = plt.subplots(figsize=(10, 5))
    names = list(policies)
    tiers = ("device", "host", "remote", "recomputed")
    colours = ("tab:green", "tab:blue", "tab:purple", "tab:red")
    bottom = [0.0] * len(names)
    for tier, colour in zip(tiers, colours, strict=True):
        vals = [policies[n]["hit_rates"][tier] for n in names]
        ax.bar(names, vals, bottom=bottom, label=tier, color=colour)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("share of prompt tokens")
    ax.set_title("where prompt tokens came from (first attempts)")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    path = out / "hit_rates.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))
    return paths


def _timeline(result: SimResult, bin_s: float) -> tuple[list[float], list[float],
                                                          list[float]]:
    bins: dict[int, list[float]] = {}
    done: dict[int, int] = {}
    for r in result.records:
        if r.ttft is not None:
            bins.setdefault(int(r.sent_at // bin_s), []).append(r.ttft)
        if r.done_at is not None and r.failed is None:
            done[int(r.done_at // bin_s)] = done.get(int(r.done_at // bin_s), 0) + \
                len(r.spec.output)
    keys = sorted(set(bins) | set(done))
    xs = [k * bin_s for k in keys]
    p90 = [sorted(bins[k])[int(0.9 * (len(bins[k]) - 1))] if k in bins else float("nan")
           for k in keys]
    tput = [done.get(k, 0) / bin_s for k in keys]
    return xs, p90, tput


def failover_plot(runs: Sequence[tuple[str, SimResult]], out: Path, bin_s: float = 5.0,
                  name: str = "failover.png") -> str:
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for label, result in runs:
        xs, p90, tput = _timeline(result, bin_s)
        axes[0].plot(xs, p90, label=label, linewidth=1.2)
        axes[1].plot(xs, tput, label=label, linewidth=1.2)
    for kill in runs[0][1].kills:
        for ax in axes:
            ax.axvline(kill.at, color="black", linestyle="--", linewidth=0.8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel(f"TTFT p90 of requests sent ({bin_s:.0f} s bins)")
    axes[1].set_ylabel("output tokens / s")
    axes[1].set_xlabel("simulated time (s); dashed: replicas killed")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle("failover: multi-turn chat, replicas killed mid-run")
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
