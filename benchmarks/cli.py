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

__all__ = ["run_benchmark", "as_json"]


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
        args.json.parent.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: a run killed while writing leaves the previous results.
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        tmp.replace(args.json)
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
