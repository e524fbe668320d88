"""PNG plots of a cluster benchmark's JSON (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plots"]

_METRICS = (("ttft_mean_s", "TTFT mean (s)"), ("ttft_p90_s", "TTFT p90 (s)"),
            ("output_tok_s", "output tok/s"))


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Per-workload bars by policy, TTFT against rate for the shared-prefix ladder, and the
    kill run's TTFT timeline. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    policies: dict[str, dict[str, Any]] = results.get("policies", {})
    if not policies:
        return []
    written = [_bars(policies, out_dir / "cluster-policies.png")]
    ladder = _ladder(policies, out_dir / "cluster-shared-prefix-ladder.png")
    if ladder is not None:
        written.append(ladder)
    kill = _kill_timeline(results.get("runs", {}), out_dir / "cluster-kill-timeline.png")
    if kill is not None:
        written.append(kill)
    return written


def _bars(policies: dict[str, dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    names = list(policies)
    workloads = sorted({w for p in policies.values() for w in p})
    fig, axes = plt.subplots(len(_METRICS), max(1, len(workloads)),
                             figsize=(3.4 * max(1, len(workloads)), 7.5), squeeze=False)
    for col, workload in enumerate(workloads):
        for row, (key, label) in enumerate(_METRICS):
            ax = axes[row][col]
            values = [policies[n].get(workload, {}).get(key) for n in names]
            ax.bar(range(len(names)), [v or 0.0 for v in values],
                   color=[f"C{i}" for i in range(len(names))])
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
            for i, v in enumerate(values):
                ax.annotate("n/a" if v is None else f"{v:.3g}", (i, v or 0.0),
                            ha="center", va="bottom", fontsize=7)
            if row == 0:
                ax.set_title(workload, fontsize=9)
            if col == 0:
                ax.set_ylabel(label)
    fig.suptitle("kvkeep real small cluster: the tools' own figures per policy "
                 "(a 2-core CPU machine: indicative)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ladder(policies: dict[str, dict[str, Any]], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    series = {n: p["shared_prefix"]["stages"] for n, p in policies.items()
              if p.get("shared_prefix", {}).get("stages")}
    if not series:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for name, stages in series.items():
        rates = [s["requested_rate"] for s in stages]
        for ax, (key, label) in zip(axes, (("ttft_p50_s", "TTFT p50 (s)"),
                                           ("ttft_p90_s", "TTFT p90 (s)"),
                                           ("output_tok_s", "output tok/s")), strict=True):
            ax.plot(rates, [s.get(key) for s in stages], marker="o", label=name)
            ax.set_xlabel("requested QPS")
            ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle("shared_prefix (inference-perf) by rate", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _kill_timeline(runs: dict[str, dict[str, Any]], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    kills = {n: r["multi_turn_kill"]["kill"] for n, r in runs.items()
             if isinstance(r.get("multi_turn_kill"), dict) and "kill" in r["multi_turn_kill"]}
    if not kills:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (name, kill) in enumerate(kills.items()):
        ok = [(t, ttft) for t, ttft, _ in kill["timeline"] if ttft is not None]
        failed = [t for t, ttft, _ in kill["timeline"] if ttft is None]
        ax.plot([t for t, _ in ok], [v for _, v in ok], marker=".", linestyle="-",
                linewidth=0.6, color=f"C{i}", label=name)
        if failed:
            ax.scatter(failed, [0.0] * len(failed), marker="x", color=f"C{i}")
        ax.axvline(kill["at_s"], color=f"C{i}", linestyle="--", linewidth=0.8)
    ax.set_xlabel("seconds since the first request (dashed: worker SIGKILLed; x: failed)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("multi_turn with one worker SIGKILLed (inference-perf per-request)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
