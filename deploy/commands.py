"""`kvkeep demo` and `kvkeep chaos` (registered into the CLI by kvstore/commands/kvkeep.py).

    kvkeep demo [--json OUT.json] [--keep] [--model-dir DIR]
    kvkeep chaos [--kills 2] [--sessions 6] [--seed 0] [--json OUT.json]
    kvkeep chaos --scenario FILE|NAME [--json OUT.json]     (deploy/chaos/*.yaml)
    kvkeep chaos --kubectl --router-url URL [--namespace kvkeep] [--selector ...]

Both start nothing until run: this module imports only argparse, so building the CLI parser
never pulls in vLLM, torch or the openai client.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from kvstore.errors import ConfigError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = subparsers.add_parser(
        "demo", help="failover demo on a real local cluster (a worker dies mid-stream)",
        description="Start etcd, 2 kvstore daemons, 2 vLLM workers with the kvkeep connector "
                    "and a router on loopback; SIGKILL a worker in the middle of a streamed "
                    "answer and check that nobody notices. Exit status 0 iff every check "
                    "passes.")
    demo.add_argument("--json", type=Path, default=None, metavar="PATH",
                      help="write the summary (checks and numbers) as JSON")
    demo.add_argument("--keep", action="store_true",
                      help="keep the cluster's temp dir (logs, data) after the run")
    demo.add_argument("--model-dir", type=Path, default=None,
                      help="a tiny model built before (default: build one, ~5 s)")
    demo.add_argument("--stream-tokens", type=int, default=320,
                      help="length of the answer during which the worker dies")
    demo.add_argument("--kill-after", type=int, default=40, metavar="CHUNKS",
                      help="chunks the client has read when the worker is killed")
    demo.add_argument("--tls", action="store_true",
                      help="etcd over TLS with client certificates, daemons over mTLS with "
                           "signed registrations (deploy/k8s's settings, a throwaway CA)")
    demo.set_defaults(handler=_demo)

    chaos = subparsers.add_parser(
        "chaos", help="faults under load on a real cluster; check no session is lost",
        description="--scenario: a scenario file (deploy/chaos/*.yaml, or its name: `ci`) "
                    "gives the cluster, the load and a schedule of faults (workers, daemons, "
                    "routers killed; etcd paused or restarted; a daemon's disk filled, its "
                    "blocks corrupted, it slowed; a node partitioned); the report has the "
                    "figures (deploy/chaos/README.md). Without it, --kills N is the scenario: "
                    "streamed chat sessions, N busy workers SIGKILLed mid-answer 45 s apart "
                    "(each restarted). Every answer must equal its reference, computed before "
                    "any failure. --kubectl: a deployed cluster (deploy/k8s): rounds of "
                    "concurrent turns, a random worker pod deleted with kubectl during each "
                    "round but the last.")
    chaos.add_argument("--scenario", default=None, metavar="FILE",
                       help="a scenario file, or the name of one in deploy/chaos/")
    chaos.add_argument("--kills", type=int, default=2)
    chaos.add_argument("--sessions", type=int, default=6)
    chaos.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    chaos.add_argument("--seed", type=int, default=0, help="which worker dies, and when")
    chaos.add_argument("--deadline", type=float, default=300.0, metavar="SECONDS",
                       help="--kubectl: stop starting rounds after this long")
    chaos.add_argument("--json", type=Path, default=None, metavar="PATH")
    chaos.add_argument("--keep", action="store_true", help="keep the local cluster's temp dir")
    chaos.add_argument("--model-dir", type=Path, default=None)
    chaos.add_argument("--workers", type=int, default=2, help="local cluster size")
    chaos.add_argument("--kubectl", action="store_true",
                       help="target a Kubernetes deployment instead of a local cluster")
    chaos.add_argument("--router-url", default=None,
                       help="--kubectl: the router as this machine reaches it (e.g. through "
                            "`kubectl -n kvkeep port-forward svc/kvkeep-router 8000:8000`)")
    chaos.add_argument("--namespace", default="kvkeep")
    chaos.add_argument("--selector", default="app.kubernetes.io/name=kvkeep,"
                                             "app.kubernetes.io/component=worker",
                       help="label selector of the worker pods")
    chaos.add_argument("--model", default=None,
                       help="served model name (default: tiny locally, ask /v1/models with "
                            "--kubectl)")
    chaos.set_defaults(handler=_chaos)


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C: the `finally` that stops the cluster's processes runs.
    (Python's default would end this process at once and orphan every child it started.)"""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def _demo(args: argparse.Namespace) -> int:
    from deploy.demo import DemoOptions, run_demo

    try:
        options = DemoOptions(json_path=args.json, keep_dir=args.keep, model_dir=args.model_dir,
                              stream_tokens=args.stream_tokens,
                              kill_after_chunks=args.kill_after, tls=args.tls)
    except ConfigError as exc:
        print(f"kvkeep demo: {exc}", file=sys.stderr)
        return 2
    _exit_on_sigterm()
    return 0 if run_demo(options).passed else 1


def _chaos(args: argparse.Namespace) -> int:
    if not args.kubectl:
        return _chaos_scenario(args)
    # A deployed cluster (deploy/k8s): rounds of turns, worker pods deleted with kubectl. The
    # scenario runner drives local processes (it restarts, pauses and partitions them).
    from deploy.chaos import ChaosOptions, run_kubectl_chaos

    try:
        options = ChaosOptions(kills=args.kills, sessions=args.sessions,
                               max_tokens=args.max_tokens, seed=args.seed,
                               deadline_s=args.deadline, json_path=args.json,
                               keep_dir=args.keep, model_dir=args.model_dir,
                               workers=args.workers, model=args.model)
    except ConfigError as exc:
        print(f"kvkeep chaos: {exc}", file=sys.stderr)
        return 2
    if args.scenario is not None:
        print("kvkeep chaos: --scenario runs on a local cluster only (not with --kubectl)",
              file=sys.stderr)
        return 2
    if not args.router_url:
        print("kvkeep chaos --kubectl needs --router-url", file=sys.stderr)
        return 2
    _exit_on_sigterm()
    report = run_kubectl_chaos(options, router_url=args.router_url,
                               namespace=args.namespace, selector=args.selector)
    return 0 if report.passed else 1


def _chaos_scenario(args: argparse.Namespace) -> int:
    """A local cluster: a scenario file, or `--kills N` built into one (`kills_scenario`)."""
    from deploy.chaos.scenario import Scenario, kills_scenario, load_scenario
    from deploy.chaos.scenario_runner import resolve_scenario, run_scenario

    source: Path | Scenario
    try:
        if args.scenario is not None:
            source = resolve_scenario(args.scenario)
            load_scenario(source)  # bad input is an error before anything starts
        else:
            source = kills_scenario(kills=args.kills, sessions=args.sessions,
                                    max_tokens=args.max_tokens, seed=args.seed,
                                    workers=args.workers)
    except ConfigError as exc:
        print(f"kvkeep chaos: {exc}", file=sys.stderr)
        return 2
    _exit_on_sigterm()
    result = run_scenario(source, json_path=args.json, model_dir=args.model_dir,
                          keep_dir=args.keep)
    return 0 if result["passed"] else 1
