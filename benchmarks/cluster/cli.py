"""The command line: `python -m benchmarks.cluster [--quick] [--json OUT.json] [options]`.

Exit status 0 when every workload of every variant produced the tool's report, 1 otherwise
(the JSON and plots are written either way, failures included).
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.cluster.plan import MODELS, full_plan, quick_plan
from benchmarks.cluster.plots import write_plots
from benchmarks.cluster.runner import (
    QUICK_VARIANTS,
    VARIANTS,
    WORKLOADS,
    RunContext,
    run_variant,
)
from benchmarks.cluster.summary import policy_table, ratios, render, render_markdown
from benchmarks.cluster.tools import LoadTools
from deploy.local.cluster import REPO_ROOT
from kvstore.errors import ConfigError, KVKeepError

__all__ = ["main", "parse_args"]


def _csv(choices: Sequence[str]) -> Any:
    def parse(value: str) -> tuple[str, ...]:
        items = tuple(v.strip() for v in value.split(",") if v.strip())
        unknown = [v for v in items if v not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {value!r}")
        return items
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster",
                                     description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="short loads (a few minutes per policy) and round robin, llm-d, "
                             "kvkeep; without it: the full ladder and the no-store variants")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench-results" / "cluster",
                        help="plots and the tools' raw outputs (default %(default)s)")
    parser.add_argument("--variants", type=_csv(tuple(VARIANTS)), default=None,
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--workloads", type=_csv(WORKLOADS), default=WORKLOADS,
                        help=f"comma-separated, from {', '.join(WORKLOADS)} (in this order)")
    parser.add_argument("--model", choices=tuple(MODELS), default="small",
                        help="the random-weight model the workers serve (default %(default)s)")
    parser.add_argument("--inference-perf", type=Path, default=None,
                        help="the inference-perf executable (default: .venv-inference-perf)")
    parser.add_argument("--aiperf", type=Path, default=None,
                        help="the aiperf executable (default: .venv-aiperf)")
    parser.add_argument("--keep", action="store_true",
                        help="keep each cluster's directory (logs, etcd, daemon data)")
    return parser.parse_args(argv)


def _terminate_as_interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM (a CI timeout, `kill PID`) unwinds like Ctrl-C: every cluster and tool is stopped
    # by the `finally` and `with` blocks on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    plan = quick_plan(args.model) if args.quick else full_plan(args.model)
    variants = args.variants or (QUICK_VARIANTS if args.quick else tuple(VARIANTS))
    try:
        tools = LoadTools.find(args.inference_perf, args.aiperf)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    from deploy.local.model import build_tiny_llama

    model = build_tiny_llama(out_dir / f"model-{plan.model.name}", **plan.model.build_args())
    ctx = RunContext(plan=plan, tools=tools, model_dir=model.path, out_dir=out_dir,
                     say=lambda line: print(line, flush=True), workloads=args.workloads,
                     keep_cluster_dir=args.keep)
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    interrupted = False
    try:
        for name in variants:
            try:
                runs[name] = run_variant(VARIANTS[name], ctx)
            except KVKeepError as exc:  # the cluster did not start: record it, try the next
                runs[name] = {"cluster": {"failed": f"{type(exc).__name__}: {exc}"}}
                print(f"[{name}] FAILED: {str(exc).splitlines()[0]}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: every process of the running cluster was stopped", file=sys.stderr)
    table = policy_table(runs)
    results: dict[str, Any] = {
        "setup": {**plan.describe(), "model_dir": str(model.path),
                  "tools": {"inference_perf": str(tools.inference_perf),
                            "aiperf": str(tools.aiperf)}},
        "policies": table,
        "summary": ratios(table),
        "runs": runs,
        "caveats": [
            "2 shared CPU cores, loaded by other work: figures are indicative; ratios measured "
            "in the same run are what to read",
            "text prompts on /v1/completions: the router has no token ids for them, so the "
            "kvkeep policy's precise-prefix scorer sees nothing for first turns",
            "workloads run one after another on the same cluster per policy (each draws its own "
            "random text); the kill run is the last",
        ],
    }
    results["plots"] = [str(p) for p in write_plots(results, out_dir)]
    results["meta"] = {"benchmark": "cluster", "quick": args.quick, "host": platform.node(),
                       "python": platform.python_version(), "interrupted": interrupted,
                       "seconds": round(time.perf_counter() - started, 1)}
    json_path: Path = args.json or out_dir / "cluster.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "cluster.md").write_text(render_markdown(results) + "\n")
    print(render(results))
    print(f"results: {json_path}; plots: {', '.join(results['plots']) or 'none'}")
    failed = interrupted or len(runs) < len(variants) or any(
        isinstance(e, dict) and "failed" in e for r in runs.values() for e in r.values())
    return 1 if failed else 0
