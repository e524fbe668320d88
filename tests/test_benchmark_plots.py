"""Benchmark progress lines and the PNG plots beside their JSON."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks import remote, restore, router, store
from benchmarks.plots import RatioPanel, plot_path, write_ratio_plots

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_plot_lands_beside_the_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert write_ratio_plots(out, "t", [RatioPanel("empty", {})]) is None
    png = write_ratio_plots(out, "t", [RatioPanel("r", {"a": 0.5, "b": 2.0}, targets={"a": 1})])
    assert png == plot_path(out) == tmp_path / "bench.png"
    assert png.read_bytes()[:8] == PNG


def test_each_benchmark_plots_its_ratios(tmp_path: Path) -> None:
    sizes = list(remote.SIZES)
    per_size = {s: 2.0 for s in sizes}
    panels = {
        "store": store.plots({"ratios": {"host_get_vs_memcpy": 0.7}, "targets": {
            "host_get_vs_memcpy": 0.5}}),
        "remote": remote.plots({
            "baseline": {"tcp_loopback_gbps": 4.0, "redis_get_gbps": per_size,
                         "redis_set_gbps": per_size},
            "remote": {"get_gbps": per_size, "put_gbps": per_size, "transport": "tcp"},
            "tcp_over_grpc": {"get": per_size, "put": per_size}}),
        "router": router.plots({
            "proxy": {"direct_ms_p50": 2.0, "routed_ms_p50": 3.0, "direct_ms_p99": 5.0,
                      "routed_ms_p99": 9.0},
            "replay": {"round-robin": {"mean_ttft_s": 1.0, "p99_ttft_s": 2.0},
                       "kvkeep": {"mean_ttft_s": 0.5, "p99_ttft_s": 1.0}}}),
        "restore": restore.plots({
            "context_tokens": [512, 2048],
            "restore_over_recompute": {"host": [0.1, 0.05], "remote": [0.3, 0.2]},
            "remote_over_host": {"remote": [2.0, 1.5], "remote_pipelined": [1.5, 1.2]}}),
    }
    assert panels["remote"][0].ratios["get " + sizes[0]] == 1.0
    assert panels["router"][0].ratios == {"time to last byte p50": 1.5,
                                          "time to last byte p99": 1.8}
    assert panels["restore"][0].ratios["remote @ 2048"] == 0.2
    for name, drawn in panels.items():
        assert all(p.ratios for p in drawn), name
        png = write_ratio_plots(tmp_path / f"{name}.json", name, drawn)
        assert png is not None and png.read_bytes()[:8] == PNG


def test_progress_goes_to_stderr_one_line_per_call() -> None:
    done = subprocess.run([sys.executable, "-c", "from benchmarks.progress import progress; "
                           "progress('phase one'); progress('phase two')"],
                          capture_output=True, text=True, check=True)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and lines[0].endswith("] phase one") and "+" in lines[0]
