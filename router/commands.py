"""`kvkeep router serve` and `kvkeep worker`: the router's command-line entry points.

    kvkeep router serve --listen 0.0.0.0:8000 --etcd http://etcd:2379 [--policy kvkeep]
    kvkeep worker --etcd http://etcd:2379 --url http://vllm-0:8000 [--id w0]
                  [--kv-events tcp://vllm-0:5557] [--metrics-listen 0.0.0.0:8001]

Both take the etcd TLS and auth flags of kvstore/etcd/flags.py (`--etcd https://...
--etcd-ca F --etcd-cert F --etcd-key F`, `--etcd-user U --etcd-password-file F`).

Without `--etcd` the router keeps its state in-process (one replica only) and takes its
workers from `--worker [ID=]URL[,kv-events=ENDPOINT]`, probing them itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from dataclasses import replace
from typing import Any

from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec
from kvstore.etcd.flags import add_etcd_arguments, etcd_spec_from_args
from kvstore.mac import MacKey
from router.config import RouterConfig, parse_static_worker
from router.conversations import config as continuation_config
from router.membership.allowlist import WorkerAllowList
from router.membership.workers import WorkerId
from router.policy import POLICIES, Thresholds, parse_weights
from router.policy_file import load_policy_file, resolve_limits, resolve_policy
from router.tenants import ApiKeys

__all__ = ["register", "serve_router", "run_worker_agent"]

log = logging.getLogger("kvkeep.router")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = subparsers.add_parser("router", help="the session-aware OpenAI router")
    router_sub = router.add_subparsers(dest="router_command", required=True)
    serve = router_sub.add_parser("serve", help="run one router replica")
    serve.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (default %(default)s)")
    add_etcd_arguments(serve, help="shared state (https:// means TLS); without it state is "
                                   "in-process (one replica)")
    serve.add_argument("--etcd-prefix", default="/kvkeep")
    serve.add_argument("--worker", action="append", default=[], metavar="[ID=]URL[,kv-events=EP]",
                       help="a static worker (in-process state only); repeat for more")
    defaults = Thresholds()
    serve.add_argument("--policy", choices=POLICIES, default=None,
                       help="the policy preset (default kvkeep, or the config file's)")
    serve.add_argument("--policy-config", default=None, metavar="FILE",
                       help="YAML or JSON policy: filters, scorers and weights, picker, session "
                            "rules, thresholds (example: deploy/router/policy.yaml); the flags "
                            "below override it")
    serve.add_argument("--weights", default="", metavar="NAME=W,...",
                       help="scorer weights, e.g. precise-prefix=3,queue=2,kv-utilization=2")
    serve.add_argument("--kv-threshold", type=float, default=None,
                       help="KV-cache usage above which a worker starts no new session "
                            f"(default {defaults.kv_new_session})")
    serve.add_argument("--max-waiting", type=int, default=None,
                       help="queued requests that make a worker saturated (all saturated: 429; "
                            f"default {defaults.max_waiting})")
    serve.add_argument("--migrate-waiting", type=int, default=None,
                       help="queued requests on a session's worker that make it migrate "
                            f"(default {defaults.migrate_waiting})")
    serve.add_argument("--migrate-imbalance", type=int, default=None,
                       help="extra outstanding requests (vs the least loaded) that make a "
                            "session migrate, together with --migrate-ratio "
                            f"(default {defaults.migrate_imbalance})")
    serve.add_argument("--migrate-ratio", type=float, default=None,
                       help=f"(default {defaults.migrate_ratio})")
    serve.add_argument("--migrate-cooldown", type=float, default=None, metavar="SECONDS",
                       help="a session bound or moved this recently does not migrate "
                            f"(default {defaults.migrate_cooldown_s})")
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help="API keys and their tenants, `<key> <tenant>` per line (`*`: an "
                            "operator); required to listen beyond loopback")
    serve.add_argument("--api-key", action="append", default=[],
                       help="an accepted bearer key of the tenant `default` (repeatable; "
                            "visible to every local user in `ps`: prefer --api-keys FILE or "
                            "KVKEEP_API_KEYS, comma-separated)")
    serve.add_argument("--cache-salt-key-file", default=None, metavar="FILE",
                       help="secret the tenants' cache salts are keyed by (hex or raw bytes, "
                            "at least 32; the same file on every replica); default: each "
                            "tenant's own API key digests, so a tenant's salt (and its cache) "
                            "changes with its keys")
    serve.add_argument("--allow-workers", action="append", default=[], metavar="ENTRIES",
                       help="worker addresses registrations may name: addresses, CIDRs, host "
                            "names or *.suffixes, each with an optional :PORT[-PORT] "
                            "(comma-separated, repeatable; default and without: loopback "
                            "only; also workers.allow in the config file)")
    serve.add_argument("--max-sessions", type=int, default=None,
                       help="session bindings in all (default 1000000)")
    serve.add_argument("--max-sessions-per-tenant", type=int, default=None,
                       help="session bindings per API-key tenant (default: a tenth of "
                            "--max-sessions; without API keys, --max-sessions)")
    serve.add_argument("--max-body-bytes", type=int, default=8 << 20)
    serve.add_argument("--session-ttl", type=float, default=3600.0, metavar="SECONDS")
    serve.add_argument("--stream-idle-timeout", type=float, default=30.0, metavar="SECONDS")
    serve.add_argument("--first-byte-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="how long a stream waits for its worker's first bytes (queueing, "
                            "long prefills) before it starts again elsewhere")
    serve.add_argument("--block-size", type=int, default=32, help="workers' KV block size")
    serve.add_argument("--static-ttl", type=float, default=3.0, metavar="SECONDS")
    serve.add_argument("--replica-id", default=socket.gethostname())
    serve.add_argument("--log-level", default="INFO")
    continuation_config.add_arguments(serve)
    serve.add_argument("--extproc-listen", default=None, metavar="HOST:PORT",
                       help="also serve the decisions as an Envoy ext_proc endpoint picker "
                            "(Gateway API Inference Extension protocol; needs kvkeep[gateway])")
    serve.add_argument("--extproc-fallbacks", type=int, default=2, metavar="N",
                       help="ranked fallback endpoints after the pick (default %(default)s)")
    serve.set_defaults(handler=_serve_command)

    worker = subparsers.add_parser("worker", help="register a vLLM server in etcd under a lease")
    add_etcd_arguments(worker, required=True)
    worker.add_argument("--etcd-prefix", default="/kvkeep")
    worker.add_argument("--url", required=True, help="the vLLM server's base URL")
    worker.add_argument("--id", default=None, help="worker id (default: host:port of --url)")
    worker.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                        help="the server's KV-event ZMQ endpoint as routers should connect")
    worker.add_argument("--model", action="append", default=None,
                        help="served model names (default: ask /v1/models)")
    worker.add_argument("--ttl", type=float, default=3.0, metavar="SECONDS")
    worker.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                        help="relay the server's /metrics (only that page) on HOST:PORT, so "
                             "Prometheus need not reach vLLM's API port "
                             "(router/node/metrics_relay.py)")
    worker.add_argument("--log-level", default="INFO")
    worker.set_defaults(handler=_worker_command)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _serve_command(args: argparse.Namespace) -> int:
    _logging(args.log_level)
    try:
        config = config_from_args(args)
        if isinstance(config.etcd_url, EtcdSpec):
            config.etcd_url.check_files()
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    loop_factory = None
    with contextlib.suppress(ImportError):
        import uvloop  # the event loop vLLM's own server runs on, when installed

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve_router(config))
    return 0


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    host, sep, port = str(args.listen).rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--listen must be HOST:PORT, not {args.listen!r}")
    loose = set(args.api_key)
    if args.api_key:
        # Trust review L7: argv is world-readable (`ps`, /proc/PID/cmdline).
        log.warning("--api-key puts a key in the command line, which every local user can "
                    "read (ps); give keys in a file (--api-keys) or KVKEEP_API_KEYS instead")
    loose.update(k.strip() for k in os.environ.get("KVKEEP_API_KEYS", "").split(",")
                 if k.strip())
    keys = ApiKeys.load(args.api_keys) if args.api_keys else None
    if loose:
        keys = ApiKeys.of_keys(loose) if keys is None else keys.merged(ApiKeys.of_keys(loose))
    if args.cache_salt_key_file:
        if keys is None:
            raise ConfigError("--cache-salt-key-file needs API keys (without them there is "
                              "one tenant and no salt is set)")
        keys = keys.with_salt_key(MacKey.from_file(args.cache_salt_key_file).secret)
    flags = {"kv_new_session": args.kv_threshold, "max_waiting": args.max_waiting,
             "migrate_waiting": args.migrate_waiting, "migrate_imbalance": args.migrate_imbalance,
             "migrate_ratio": args.migrate_ratio, "migrate_cooldown_s": args.migrate_cooldown}
    file = load_policy_file(args.policy_config) if args.policy_config else None
    policy = resolve_policy(
        file, preset=args.policy, weights=parse_weights(args.weights),
        thresholds={k: v for k, v in flags.items() if v is not None})
    limit_flags = {"max_sessions": args.max_sessions,
                   "max_sessions_per_tenant": args.max_sessions_per_tenant}
    limits = resolve_limits(file, {k: v for k, v in limit_flags.items() if v is not None})
    if keys is None and limits.max_sessions_per_tenant is None:
        # Without API keys every session is the one tenant's: its cap is the total.
        limits = replace(limits, max_sessions_per_tenant=limits.max_sessions)
    allow = args.allow_workers or (file.workers_allow if file is not None else None) or ()
    return RouterConfig(
        host=host or "0.0.0.0", port=int(port), etcd_url=etcd_spec_from_args(args),
        etcd_prefix=args.etcd_prefix,
        policy=policy, api_keys=keys, max_body_bytes=args.max_body_bytes,
        session_ttl_s=args.session_ttl, stream_idle_timeout_s=args.stream_idle_timeout,
        first_byte_timeout_s=args.first_byte_timeout,
        block_size=args.block_size,
        static_workers=tuple(parse_static_worker(w, i) for i, w in enumerate(args.worker)),
        static_ttl_s=args.static_ttl, replica_id=args.replica_id,
        workers_allow=WorkerAllowList.parse(allow), limits=limits,
        continuation=continuation_config.from_args(args),
        extproc_listen=_extproc_listen(args.extproc_listen, keys),
        extproc_fallbacks=args.extproc_fallbacks,
    )


def _extproc_listen(value: str | None, keys: ApiKeys | None) -> str | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--extproc-listen must be HOST:PORT, not {value!r}")
    try:
        from router.extproc.server import check_listen  # the optional protos are there
    except ImportError as exc:
        raise ConfigError(f"--extproc-listen needs the gateway extra "
                          f"(pip install 'kvkeep[gateway]'): {exc}") from exc
    address = f"{host or '0.0.0.0'}:{port}"
    check_listen(address, keys)
    return address


async def serve_router(config: RouterConfig) -> None:
    """Run one replica until SIGTERM or SIGINT."""
    from aiohttp import web

    from router.front.proxy import build_app
    from router.service import RouterService

    service = RouterService(config)
    runner = web.AppRunner(build_app(service), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_address=True)
    await site.start()
    # Everything allocated so far (modules, config, the app) lives for the whole process:
    # freezing it keeps the cyclic GC from re-walking it on every collection, and a higher
    # first-generation threshold makes collections rarer; both trim latency spikes.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    log.info("router %s listening on %s:%d (policy %s, state %s)", config.replica_id,
             config.host, config.port, config.policy.name, service.backend.name)
    if config.api_keys:
        log.info("auth: %d API keys of %d tenants (%s)", len(config.api_keys),
                 len(config.api_keys.tenants()), config.api_keys.source)
    else:
        log.warning("auth: OFF, loopback only, one tenant (give --api-keys to serve a network)")
    await _until_signalled()
    await runner.cleanup()


def _worker_command(args: argparse.Namespace) -> int:
    _logging(args.log_level)
    from urllib.parse import urlsplit

    from router.node.metrics_relay import parse_listen

    url = str(args.url).rstrip("/")
    parts = urlsplit(url)
    worker_id = args.id or f"{parts.hostname}:{parts.port or 80}"
    models = tuple(args.model) if args.model else None
    try:
        etcd = etcd_spec_from_args(args, check_files=True)
        relay = parse_listen(args.metrics_listen) if args.metrics_listen else None
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    assert etcd is not None  # --etcd is required
    try:
        asyncio.run(run_worker_agent(etcd, args.etcd_prefix, WorkerId(worker_id), url,
                                     args.kv_events, models, args.ttl, metrics_listen=relay))
    except ConfigError as exc:  # the relay's port is taken
        log.error("%s", exc)
        return 2
    return 0


async def run_worker_agent(etcd_url: EtcdSpec | str, prefix: str, worker_id: WorkerId, url: str,
                           kv_events: str | None, models: tuple[str, ...] | None,
                           ttl_s: float, *, metrics_listen: tuple[str, int] | None = None
                           ) -> None:
    import aiohttp

    from router.node.agent import AgentConfig, WorkerAgent
    from router.node.metrics_relay import MetricsRelay
    from router.state.etcd import EtcdBackend

    backend = EtcdBackend(etcd_url, prefix)
    await backend.start()
    async with aiohttp.ClientSession() as http:
        relay = None if metrics_listen is None else MetricsRelay(
            f"{url.rstrip('/')}/metrics", http, *metrics_listen)
        if relay is not None:
            try:
                await relay.start()
            except ConfigError:
                await backend.close()
                raise
        agent = WorkerAgent(backend, AgentConfig(worker_id, url, ttl_s, kv_events, models), http)
        task = asyncio.get_running_loop().create_task(agent.run())
        await _until_signalled(task)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # revokes the lease: routers see the worker leave at once
        if relay is not None:
            await relay.stop()
    await backend.close()


async def _until_signalled(task: asyncio.Task[Any] | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = loop.create_task(stop.wait())
    waits: set[asyncio.Future[Any]] = {waiter}
    if task is not None:
        waits.add(task)
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
