"""Shared command line of every benchmark: `python -m benchmarks.NAME [--quick] [--json OUT]`."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.plots import RatioPanel, write_ratio_plots
from benchmarks.progress import progress

__all__ = ["run_benchmark", "as_json", "partial_writer", "partial_path"]


def partial_path(json_path: Path) -> Path:
    """Where a long benchmark keeps the stages it has finished: OUT.partial.json beside
    OUT.json, replaced after each stage and removed once OUT.json is written."""
    return json_path.with_name(json_path.stem + ".partial.json")


def _write_whole(path: Path, results: dict[str, Any]) -> None:
    # Whole or not at all: a run killed while writing leaves the previous file.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)


def partial_writer(name: str, args: argparse.Namespace) -> Callable[[dict[str, Any], str], None]:
    """`stage_done(results, stage)`: the results so far into `partial_path(args.json)`, marked
    partial with the last stage finished, so that a run cut off (a CI limit, a dead machine)
    still leaves the figures it measured. Does nothing without `--json`."""
    started = time.perf_counter()

    def stage_done(results: dict[str, Any], stage: str) -> None:
        if args.json is None:
            return
        path = partial_path(args.json)
        _write_whole(path, {**results, "meta": {
            "benchmark": name, "quick": args.quick, "partial": True, "last_stage": stage,
            "seconds": round(time.perf_counter() - started, 1)}})
        progress(f"stage done: {stage} (partial results in {path})")

    return stage_done


def run_benchmark(name: str, measure: Callable[[argparse.Namespace], dict[str, Any]],
                  render: Callable[[dict[str, Any]], str],
                  argv: Sequence[str] | None = None,
                  extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
                  plots: Callable[[dict[str, Any]], Sequence[RatioPanel]] | None = None
                  ) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller repeats")
    parser.add_argument("--json", type=Path, help="write the results here")
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    progress(f"{'quick' if args.quick else 'full'} run")
    results = measure(args)
    results["meta"] = {"benchmark": name, "quick": args.quick, "host": platform.node(),
                       "python": platform.python_version(),
                       "seconds": round(time.perf_counter() - started, 1)}
    if args.json:
        _write_whole(args.json, results)
        partial_path(args.json).unlink(missing_ok=True)
        if plots is not None:
            png = write_ratio_plots(args.json, f"benchmarks.{name}", plots(results))
            if png is not None:
                progress(f"plot: {png}")
    progress("done")
    if not args.quick or not args.json:
        sys.stdout.write(render(results) + "\n")
    return 0


def as_json(results: dict[str, Any]) -> str:
    """The `render` of a benchmark whose results read best as they are."""
    return json.dumps(results, indent=2)
