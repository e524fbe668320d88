"""`python -m benchmarks.sim [--quick] [--json OUT] [--workload llmd-shared-prefix|chat]`

Runs every policy of `policies.toml` on the simulated cluster of the parameter file, reports
each policy's ladder, the calibration against llm-d's published table, the summary ratios, a
failover run (multi-turn chat, replicas killed mid-run, with and without the store) and the
text-prompt diagnosis, and writes PNG plots beside the JSON (or under `--plots`).

`--quick`: the same shape on half the cluster (4 replicas, 75 prefix groups, half the QPS,
published stage lengths, five of the published rates), whose figures are compared with half
the published ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cli import run_benchmark
from benchmarks.sim.cluster import Kill, SimResult, Simulation
from benchmarks.sim.params import DEFAULT_PARAMS, LOAD_MODES, SimParams, load_params
from benchmarks.sim.plots import failover_plot, ladder_plots
from benchmarks.sim.report import calibration, failover_block, policy_block, summary
from benchmarks.sim.router_adapter import DEFAULT_POLICIES, SimPolicy, load_policies
from benchmarks.sim.workloads import LLMD_STAGES, ChatWorkload, SharedPrefixWorkload

__all__ = ["main", "run_ladder", "run_failover", "quick_ladder"]

_QUICK_RATES = (3, 10, 20, 40, 60)


def quick_ladder(rate_scale: float) -> tuple[tuple[float, float], ...]:
    stages = [(LLMD_STAGES[0][0] * rate_scale, LLMD_STAGES[0][1])]
    stages += [(r * rate_scale, d) for r, d in LLMD_STAGES[1:] if r in _QUICK_RATES]
    return tuple(stages)


def _shared_prefix(params: SimParams, quick: bool, seed: int) -> SharedPrefixWorkload:
    eng = params.engine
    if quick:
        return SharedPrefixWorkload(groups=75, stages=quick_ladder(0.5), vocab=params.model.vocab,
                                    block_size=eng.block_size, seed=seed)
    return SharedPrefixWorkload(vocab=params.model.vocab, block_size=eng.block_size, seed=seed)


def run_ladder(params: SimParams, specs: dict[str, SimPolicy], *, quick: bool, seed: int,
               workload: str, log: Any = None) -> tuple[dict[str, Any], dict[str, SimResult]]:
    replicas = 4 if quick else 8
    blocks: dict[str, Any] = {}
    results: dict[str, SimResult] = {}
    for name, spec in specs.items():
        started = time.perf_counter()
        wl: Any
        if workload == "chat":
            wl = _chat(params, quick, seed)
        else:
            wl = _shared_prefix(params, quick, seed)
        result = Simulation(params, spec, wl, replicas=replicas, seed=seed).run()
        wall = time.perf_counter() - started
        blocks[name] = policy_block(result, wall, rate_scale=2.0 if quick and
                                    workload != "chat" else 1.0)
        results[name] = result
        if log is not None:
            log(f"{name}: {wall:.1f} s, {len(result.records)} requests")
    return blocks, results


def _chat(params: SimParams, quick: bool, seed: int) -> ChatWorkload:
    eng = params.engine
    if quick:
        return ChatWorkload(sessions=200, session_rate=1.6, vocab=params.model.vocab,
                            block_size=eng.block_size, seed=seed)
    return ChatWorkload(sessions=600, session_rate=3.0, vocab=params.model.vocab,
                        block_size=eng.block_size, seed=seed)


def run_failover(params: SimParams, spec: SimPolicy, *, quick: bool, seed: int,
                 kill_at: float, replicas_killed: tuple[int, ...] = (0, 1), node: bool = False
                 ) -> tuple[SimResult, SimResult]:
    replicas = 4 if quick else 8
    kill = Kill(kill_at, replicas_killed, node)
    out = []
    for store in (True, False):
        wl = _chat(params, quick, seed)
        out.append(Simulation(params, spec, wl, replicas=replicas, seed=seed, kills=[kill],
                              store=store).run())
    return out[0], out[1]


def _merge(args: argparse.Namespace) -> dict[str, Any]:
    """Combine runs of single policies (run in parallel processes) into one report."""
    parts = [json.loads(Path(p).read_text()) for p in args.merge]
    blocks: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for part in parts:
        blocks.update(part["policies"])
        for key in ("workload", "params_file", "load_mode", "policy_file", "replicas",
                    "failover", "failover_node"):
            if key in part:
                out.setdefault(key, part[key])
    out["policies"] = blocks
    fo = out.get("failover")
    if fo is not None and "targets" not in fo:  # a report from before targets were added
        fo["targets"] = {"zero_lost_sessions": fo["lost_sessions"] == 0,
                         "p99_with_store_le_0.5x_without":
                             (fo["restore_vs_recompute_p99"] or 1.0) <= 0.5}
    quick = out.get("replicas") == 4
    if out.get("workload") != "chat":
        out["calibration"] = calibration(blocks, tok_scale=0.5 if quick else 1.0)
    out["summary"] = summary(blocks)
    plots_dir = args.plots or (args.json.parent / "sim-plots" if args.json else
                               Path("bench-results/sim-plots"))
    out["plots"] = ladder_plots(blocks, plots_dir, f"{out.get('workload')}, "
                                f"{out.get('replicas')} simulated replicas")
    out["plots"] += [p for part in parts for p in part.get("plots", [])
                     if "failover" in Path(p).name]
    return out


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.merge:
        return _merge(args)
    params = load_params(args.params)
    if args.load_mode is not None:
        params = params.with_overrides("store", load_mode=args.load_mode)
    specs = load_policies(args.policy_file)
    if args.policies:
        wanted = args.policies.split(",")
        missing = [n for n in wanted if n not in specs]
        if missing:
            raise SystemExit(f"unknown policies {missing}; known: {sorted(specs)}")
        specs = {n: specs[n] for n in wanted}
    elif args.quick and not args.diagnose:
        specs = {n: s for n, s in specs.items() if s.group == "main"}

    def log(msg: str) -> None:
        sys.stderr.write(f"[sim] {msg}\n")

    # the router logs every dead worker and rebinding; the report counts them instead
    logging.getLogger("router").setLevel(logging.ERROR)
    if args.failover_only:
        specs = {}
    blocks, _ = run_ladder(params, specs, quick=args.quick, seed=args.seed,
                           workload=args.workload, log=log)
    out: dict[str, Any] = {"workload": args.workload, "params_file": str(args.params),
                           "load_mode": params.store.load_mode,
                           "policy_file": str(args.policy_file),
                           "replicas": 4 if args.quick else 8, "policies": blocks}
    if args.workload != "chat":
        out["calibration"] = calibration(blocks, tok_scale=0.5 if args.quick else 1.0)
    out["summary"] = summary(blocks)
    plots_dir = args.plots or (args.json.parent / "sim-plots" if args.json else
                               Path("bench-results/sim-plots"))
    plots = ladder_plots(blocks, plots_dir, f"{args.workload}, "
                         f"{out['replicas']} simulated replicas") if blocks else []
    if not args.no_failover:
        spec = load_policies(args.policy_file)["kvkeep"]
        kill_at = 60.0 if args.quick else 100.0
        killed = tuple(int(i) for i in args.kill.split(","))
        with_store, without = run_failover(params, spec, quick=args.quick, seed=args.seed,
                                           kill_at=kill_at, replicas_killed=killed,
                                           node=args.kill_node)
        key = "failover_node" if args.kill_node else "failover"
        out[key] = failover_block(with_store, without)
        plots.append(failover_plot([("kvkeep with store", with_store),
                                    ("kvkeep without store", without)], plots_dir,
                                   name=f"{key}.png"))
        log("failover done")
    out["plots"] = plots
    return out


def _render(results: dict[str, Any]) -> str:
    lines = [f"workload {results['workload']} on {results['replicas']} replicas"]
    for name, block in results["policies"].items():
        lines.append(f"{name}:")
        for i, qps in enumerate(block["qps"]):
            lines.append(f"  {qps:>5} qps: {block['output_tok_s'][i]} tok/s, goodput "
                         f"{block['goodput_tok_s'][i]}, TTFT p50 {block['ttft_p50_s'][i]} "
                         f"p90 {block['ttft_p90_s'][i]}")
    for key in ("calibration", "summary", "failover"):
        if key in results:
            flat = {k: v for k, v in results[key].items() if not isinstance(v, dict | list)}
            lines.append(f"{key}: {flat}")
    return "\n".join(lines)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("llmd-shared-prefix", "chat"),
                        default="llmd-shared-prefix")
    parser.add_argument("--policies", help="comma-separated names from the policy file")
    parser.add_argument("--params", type=Path, default=DEFAULT_PARAMS)
    parser.add_argument("--policy-file", type=Path, default=DEFAULT_POLICIES)
    parser.add_argument("--load-mode", choices=LOAD_MODES,
                        help="the connector's load_mode for the store (default: the parameter "
                             "file's)")
    parser.add_argument("--plots", type=Path, help="directory for the PNG plots")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-failover", action="store_true")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine reports of single-policy runs instead of simulating")
    parser.add_argument("--kill", default="0,1",
                        help="replicas the failover run kills (default 0,1: two pods)")
    parser.add_argument("--kill-node", action="store_true",
                        help="the killed replicas' node daemons die too (host tiers lost); "
                             "kill all of a node's replicas, e.g. --kill 0,1,2,3")
    parser.add_argument("--failover-only", action="store_true",
                        help="only the failover run (no ladder)")
    parser.add_argument("--diagnose", action="store_true",
                        help="with --quick, also run the text-prompt diagnosis policies")


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("sim", _measure, _render, argv, _extra)


if __name__ == "__main__":
    raise SystemExit(main())
